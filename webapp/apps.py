from django.apps import AppConfig


class WebappConfig(AppConfig):
    name = "webapp"
    label = "webapp"
    default_auto_field = "django.db.models.BigAutoField"
