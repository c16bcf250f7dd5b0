"""Flywheel's Django project: settings, URLs, ASGI/WSGI entry points and the Celery app."""

from webapp.celery import app as celery_app

__all__ = ["celery_app"]
