"""URLs of the serving process's internal listener (loopback unless --internal-host says otherwise;
FLYWHEEL_INTERNAL_TOKEN either way)."""

from django.urls import path

from inference import apis, replica

urlpatterns = [
    path("internal/load", apis.load_version),
    path("internal/push", replica.push),
    path("healthz", apis.healthz),
]
