"""Where a policy version's weights are on disk, and loading them into a running server.

Django-aware glue between PolicyVersion rows, the checkpoint store and the engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from inference.serving import PolicyServer, ServingError


def version_folder(version) -> Path:
    """An HF folder holding `version`'s weights, verified (materialised from the store if needed)."""
    from training.services import policy_folder
    from webapp.errors import NotFound

    try:
        return policy_folder(version)
    except NotFound as exc:
        raise ServingError(409, exc.message, exc.fix) from None


def _version(project_slug: str, number: Any):
    from training.models import PolicyVersion

    if type(number) is not int:
        raise ServingError(400, "'version' must be an integer policy version number", "Send {\"version\": 3}.")
    version = PolicyVersion.objects.filter(project__slug=project_slug, number=number).first()
    if version is None:
        raise ServingError(404, f"no policy version {number} in project {project_slug!r}", "Check the number.")
    return version


def server_load(server: PolicyServer, body: dict[str, Any]) -> dict[str, Any]:
    """{"version": N} swaps production; {"canary": N, "share": s} loads a canary; {"canary": null} drops it."""
    if "version" in body:
        version = _version(server.project_slug, body["version"])
        server.load_version(version_folder(version), version.number)
    if "canary" in body:
        if body["canary"] is None:
            server.set_canary(None, 0.0)
        else:
            share = body.get("share", 0.1)
            if not isinstance(share, int | float) or not 0 < share < 1:
                raise ServingError(400, "'share' must be a fraction in (0, 1)", "Send e.g. {\"share\": 0.1}.")
            version = _version(server.project_slug, body["canary"])
            engine = server.engine.__class__(version_folder(version), version=version.number)
            server.set_canary(engine, float(share))
    return {"version": server.engine.version, "canary": server.canary.version if server.canary else None,
            "canary_share": server.canary_share}
