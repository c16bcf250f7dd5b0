"""URLs of the serving process's internal listener (loopback unless --internal-host says otherwise;
FLYWHEEL_INTERNAL_TOKEN either way)."""

from django.urls import path

from inference import apis, background_apis, replica

urlpatterns = [
    path("internal/load", apis.load_version),
    path("internal/push", replica.push),
    path("internal/rollouts", background_apis.rollouts),
    path("internal/rollouts/weights", background_apis.rollout_weights),
    path("healthz", apis.healthz),
]
