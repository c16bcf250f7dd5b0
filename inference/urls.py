"""URLs of the serving process's public listener (`manage.py serve_policy`), not of the web app.

The internal endpoints are on another listener (inference/internal_urls.py, loopback only)."""

from django.urls import path

from inference import apis

urlpatterns = [
    path("v1/chat/completions", apis.chat_completions),
    path("v1/completions", apis.completions),
    path("v1/models", apis.models),
    path("healthz", apis.healthz),
    path("metrics", apis.metrics_view),
]
