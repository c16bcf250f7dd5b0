"""Dashboard pages (owned by the dashboard)."""

from django.urls import path

from webapp import views

urlpatterns = [
    path("", views.overview, name="overview"),
]
