"""URLs of the serving process (`manage.py serve_policy`), not of the web app."""

from django.urls import path

from inference import apis

urlpatterns = [
    path("v1/chat/completions", apis.chat_completions),
    path("v1/completions", apis.completions),
    path("v1/models", apis.models),
    path("internal/load", apis.load_version),
    path("healthz", apis.healthz),
    path("metrics", apis.metrics_view),
]
