"""Dashboard pages (owned by the dashboard)."""

from django.urls import path

from webapp import views

urlpatterns = [
    path("", views.index, name="index"),
    path("vendor/plotly.min.js", views.plotly_js, name="plotly-js"),
    path("p/<slug:slug>/", views.overview, name="overview"),
    path("p/<slug:slug>/runs/", views.runs, name="runs"),
    path("p/<slug:slug>/rubrics/", views.rubrics, name="rubrics"),
    path("p/<slug:slug>/rollouts/", views.rollouts, name="rollouts"),
    path("p/<slug:slug>/rollouts/<int:trajectory_id>/", views.replay, name="replay"),
    path("p/<slug:slug>/registry/", views.registry, name="registry"),
    path("p/<slug:slug>/corpora/", views.corpora, name="corpora"),
    path("p/<slug:slug>/data/", views.data, name="data"),
    path("p/<slug:slug>/registry/v<int:number>/<str:action>/", views.registry_action, name="registry-action"),
]
