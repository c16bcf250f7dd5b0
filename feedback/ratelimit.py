"""Per-project ingest rate limit: a fixed one-minute window counted in Redis.

When Redis cannot be reached the limit is not applied (logged): the durable write goes to
PostgreSQL, and refusing feedback because a counter is down would lose it.
"""

from __future__ import annotations

import logging
import time

from django.core.cache import cache
from redis.exceptions import RedisError

from core.errors import RateLimited
from feedback.models import Project

log = logging.getLogger(__name__)


def ingest_rate_check(project: Project, events: int) -> None:
    """Counts `events` against the project's per-minute budget; raises RateLimited over it."""
    window = int(time.time() // 60)
    key = f"ingest-rate:{project.id}:{window}"
    try:
        cache.add(key, 0, timeout=120)
        used = cache.incr(key, max(events, 1))
    except (RedisError, OSError):
        log.warning("rate limit not applied to %s: Redis is unreachable", project.slug, exc_info=True)
        return
    if used > project.rate_limit_per_minute:
        retry = 60 - int(time.time() % 60)
        raise RateLimited(
            f"project {project.slug!r} is over its rate of {project.rate_limit_per_minute} events per minute",
            f"Retry after {retry} s with the same webhook-id; nothing from this request was stored.",
            headers={"Retry-After": str(retry)},
        )
