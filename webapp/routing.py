from django.urls import path

from webapp.consumers import ProjectConsumer

websocket_urlpatterns = [
    path("ws/projects/<slug:slug>/", ProjectConsumer.as_asgi()),
]
