"""WebSocket consumers: authenticate, join the project's group, forward pushes."""

from __future__ import annotations

import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from core.notify import project_group

# A connection re-checks its membership before a push when the last check is older than this:
# a member removed from the project (or deactivated) stops receiving within this many seconds.
MEMBERSHIP_RECHECK_S = 60.0


class ProjectConsumer(AsyncJsonWebsocketConsumer):
    """ws/projects/<slug>/: live events of one project for a logged-in member of it."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        # The dashboard's rule (webapp.selectors.project_access): members of the project only; a
        # project one is no member of is refused like one that does not exist.
        project_id = await self._member_project_id(user, self.scope["url_route"]["kwargs"]["slug"])
        if project_id is None:
            await self.close(code=4404)
            return
        self.project_id, self.checked_at = project_id, time.monotonic()
        self.group = project_group(project_id)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def project_event(self, message: dict) -> None:
        if time.monotonic() - self.checked_at >= MEMBERSHIP_RECHECK_S:
            user, slug = self.scope["user"], self.scope["url_route"]["kwargs"]["slug"]
            if await self._member_project_id(user, slug) != self.project_id:
                await self.close(code=4404)
                return
            self.checked_at = time.monotonic()
        await self.send_json(message["payload"])

    @database_sync_to_async
    def _member_project_id(self, user, slug: str) -> int | None:
        if hasattr(user, "refresh_from_db"):
            user.refresh_from_db(fields=["is_active"])  # deactivated since the session began
        # Imported here: webapp.routing imports this module before Django's apps are ready.
        from core.errors import NotFound
        from feedback.selectors import project_for_member

        try:
            return project_for_member(user, slug)[0].id
        except NotFound:
            return None
