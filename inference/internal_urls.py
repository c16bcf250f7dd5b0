"""URLs of the serving process's internal listener: loopback only, FLYWHEEL_INTERNAL_TOKEN."""

from django.urls import path

from inference import apis

urlpatterns = [
    path("internal/load", apis.load_version),
    path("healthz", apis.healthz),
]
