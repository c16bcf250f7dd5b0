"""Rate limits: fixed one-minute windows counted in Redis, shared by every process that counts
(web replicas, serving replicas). Three budgets:

- ingest: a project's events per minute (`Project.rate_limit_per_minute`), for the webhook and
  bearer ingest, and for what the serving process will record (a served completion is an event);
- serving: requests per minute per API key (`FLYWHEEL_SERVE_RATE_PER_KEY`) and per project
  (`FLYWHEEL_SERVE_RATE_PER_PROJECT`), checked by the serving process before it generates.

When Redis cannot be reached the limit is not applied (logged): the durable write goes to
PostgreSQL, and refusing feedback because a counter is down would lose it.

Every process counts its budgets in one `Tally` (core/cache.py), `RATES`: a request far from every
limit is admitted on the process's own counts, settled with Redis within 0.1 s, and only one near
a limit (or the first of a counter in this process) waits on Redis. Each process's counts reach
the others' within that settle (a served completion's share of the ingest budget, the webhook's).
"""

from __future__ import annotations

import logging
import time

from django.conf import settings
from redis.exceptions import RedisError

from core.cache import Tally
from core.errors import RateLimited
from feedback.models import Project

log = logging.getLogger(__name__)
WINDOW_S = 60


RATES = Tally()


def _bucket(key: str) -> str:
    """This minute's counter of `key` (ingest and serving count the project's events in one)."""
    return f"rate:{key}:{int(time.time() // WINDOW_S)}"


def retry_after_s() -> int:
    return WINDOW_S - int(time.time() % WINDOW_S)


def _counted_in_redis(counters: list[tuple[str, int, int]], what: str) -> tuple[int, int] | None:
    """`RATES.count_within`: (index, total) of the counter over its limit, or None, also when
    Redis is away (the limit not applied, logged)."""
    try:
        return RATES.count_within(counters, 2 * WINDOW_S)
    except (RedisError, OSError):
        log.warning("%s not applied: Redis is unreachable", what, exc_info=True)
        return None


def _over(what: str, fix: str) -> RateLimited:
    retry = retry_after_s()
    return RateLimited(what, fix.format(retry=retry), headers={"Retry-After": str(retry)})


def ingest_rate_check(project: Project, events: int, *,
                      fix: str = "Retry after {retry} s with the same webhook-id; nothing from this request was "
                                 "stored.") -> None:
    """Counts `events` against the project's per-minute budget; raises RateLimited over it."""
    counters = [(_bucket(f"ingest:{project.id}"), max(events, 1), project.rate_limit_per_minute)]
    if not RATES.admit(counters, 2 * WINDOW_S) and _counted_in_redis(counters, "ingest rate limit") is not None:
        raise _over(f"project {project.slug!r} is over its rate of {project.rate_limit_per_minute} events per "
                    "minute", fix)


_SERVE_FIX = "Retry after {retry} s (Retry-After); nothing was generated or recorded for this request."


def _serving_counters(project: Project, key_id: int | None, completions: int) -> list[tuple[str, int, int]]:
    return [(_bucket(f"serve-key:{key_id}"), 1, settings.FLYWHEEL_SERVE_RATE_PER_KEY),
            (_bucket(f"serve-project:{project.id}"), 1, settings.FLYWHEEL_SERVE_RATE_PER_PROJECT),
            (_bucket(f"ingest:{project.id}"), max(completions, 1), project.rate_limit_per_minute)]


def serving_admitted_here(project: Project, key_id: int | None, completions: int) -> bool:
    """True when a serving request is within its budgets by this process's counts (counted, no
    I/O); False when `serving_rate_check` must count it in Redis."""
    return RATES.admit(_serving_counters(project, key_id, completions), 2 * WINDOW_S)


def serving_rate_check(project: Project, key_id: int | None, completions: int) -> None:
    """A serving request for `completions` choices: counted per key and per project, and, as the
    trajectories it will record, against the project's ingest rate, in that order and in one round
    trip (a budget spends nothing once an earlier one refused). Raises RateLimited over any."""
    counters = _serving_counters(project, key_id, completions)
    over = _counted_in_redis(counters, "serving rate limits")
    if over is None:
        return
    if over[0] == 0:
        raise _over(f"this API key is over its rate of {counters[0][2]} completion requests per minute",
                    _SERVE_FIX + " Spread requests over the minute, or use a key per client.")
    if over[0] == 1:
        raise _over(f"project {project.slug!r} is over its rate of {counters[1][2]} completion requests per minute",
                    _SERVE_FIX)
    raise _over(f"project {project.slug!r} is over its rate of {project.rate_limit_per_minute} events per minute",
                _SERVE_FIX + " (Every completion is recorded as a trajectory, which counts against the project's "
                             "ingest rate.)")
