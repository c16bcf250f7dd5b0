"""WebSocket consumers: authenticate, join the project's group, forward pushes.

Without Redis (the channel layer) a socket cannot join its group: it is accepted and closed at
once with 1013 (try again later), and the browser reconnects with backoff (dashboard.js) until
Redis is back. A socket open when Redis goes away is closed the same way as its receive fails.
Without PostgreSQL the session cannot be read: the handshake is refused (`StoreGuard`, a warning
rather than a 500 and its trace) and the browser retries the same way.
"""

from __future__ import annotations

import logging
import time

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from redis.exceptions import RedisError

from core.errors import STORE_ERRORS
from core.notify import channel_layer_call, project_group

log = logging.getLogger(__name__)
TRY_AGAIN_LATER = 1013


class StoreGuard:
    """ASGI middleware around the WebSocket stack: a database error while the session and user
    are loaded closes the socket with 1013 (refusing the handshake) instead of failing it."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.app(scope, receive, send)
        except STORE_ERRORS as exc:
            log.warning("live updates unavailable: the database is unavailable (%s)", type(exc).__name__)
            try:
                await send({"type": "websocket.close", "code": TRY_AGAIN_LATER})
            except Exception:  # noqa: BLE001 - the client may be gone already
                pass

# A connection re-checks its membership before a push when the last check is older than this:
# a member removed from the project (or deactivated) stops receiving within this many seconds.
MEMBERSHIP_RECHECK_S = 60.0


class ProjectConsumer(AsyncJsonWebsocketConsumer):
    """ws/projects/<slug>/: live events of one project for a logged-in member of it."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (RedisError, OSError) as exc:  # the channel layer's receive failed: Redis went away
            log.warning("live updates interrupted (%s: %s); the browser will reconnect", type(exc).__name__, exc)
            try:
                await send({"type": "websocket.close", "code": TRY_AGAIN_LATER})
            except Exception:  # noqa: BLE001 - the client may be gone already
                pass

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
        group = project_group(project_id)
        try:
            await channel_layer_call(self.channel_layer.group_add, group, self.channel_name)
        except (TimeoutError, RedisError, OSError) as exc:
            log.warning("live updates unavailable (%s: %s); the browser will reconnect", type(exc).__name__, exc)
            await self.accept()
            await self.close(code=TRY_AGAIN_LATER)
            return
        self.group = group
        await self.accept()

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "group"):
            try:
                await channel_layer_call(self.channel_layer.group_discard, self.group, self.channel_name)
            except (TimeoutError, RedisError, OSError):
                pass  # the membership expires by itself (channels_redis group_expiry)

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
