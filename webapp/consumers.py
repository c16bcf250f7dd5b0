"""WebSocket consumers: authenticate, join the project's group, forward pushes."""

from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from core.notify import project_group


class ProjectConsumer(AsyncJsonWebsocketConsumer):
    """ws/projects/<slug>/: live events of one project for a logged-in user."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        if not (user.is_staff or user.is_superuser):  # the dashboard's rule (webapp.selectors.access_check)
            await self.close(code=4403)
            return
        project_id = await self._project_id(self.scope["url_route"]["kwargs"]["slug"])
        if project_id is None:
            await self.close(code=4404)
            return
        self.group = project_group(project_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def project_event(self, message: dict) -> None:
        await self.send_json(message["payload"])

    @database_sync_to_async
    def _project_id(self, slug: str) -> int | None:
        # Imported here: webapp.routing imports this module before Django's apps are ready.
        from feedback.models import Project

        return Project.objects.filter(slug=slug).values_list("id", flat=True).first()
