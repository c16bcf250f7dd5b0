"""Per-project ingest rate limit: a fixed one-minute window counted in Redis."""

from __future__ import annotations

import time

from django.core.cache import cache

from feedback.models import Project
from webapp.errors import RateLimited


def ingest_rate_check(project: Project, events: int) -> None:
    """Counts `events` against the project's per-minute budget; raises RateLimited over it."""
    window = int(time.time() // 60)
    key = f"ingest-rate:{project.id}:{window}"
    cache.add(key, 0, timeout=120)
    used = cache.incr(key, max(events, 1))
    if used > project.rate_limit_per_minute:
        retry = 60 - int(time.time() % 60)
        raise RateLimited(
            f"project {project.slug!r} is over its rate of {project.rate_limit_per_minute} events per minute",
            f"Retry after {retry} s with the same webhook-id; nothing from this request was stored.",
            headers={"Retry-After": str(retry)},
        )
