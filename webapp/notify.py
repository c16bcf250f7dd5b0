"""The one notifier: pushes a payload to a project's dashboard group over the channel layer.

Failures are logged, never raised: a push happens after a commit and must not turn an
acknowledged write into an error.
"""

from __future__ import annotations

import logging
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger(__name__)


def project_group(project_id: int) -> str:
    return f"project-{project_id}"


def project_event(project_id: int, payload: dict[str, Any]) -> None:
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(project_group(project_id), {"type": "project.event", "payload": payload})
    except Exception:  # noqa: BLE001 - a lost push is shown as stale data, never as a failed write
        log.warning("could not push %s to project %s", payload.get("type"), project_id, exc_info=True)
