"""The web app's GET /metrics: this process's counters (core/metrics.py) plus figures read from
the database and the broker at scrape time, so any web replica reports them.

    curl -H "Authorization: Bearer $FLYWHEEL_METRICS_TOKEN" http://127.0.0.1:8000/metrics
"""

from __future__ import annotations

from collections.abc import Iterator

import redis
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.metrics import metrics_response
from feedback.models import RedactionTally
from training.replicas.selectors import replicas_probe_refused
from webapp import selectors

QUEUES = ("celery", "ingest", "rewards", "train", "rollouts", "gate")
# Kombu's Redis transport keeps a queue's priorities 3, 6 and 9 in sibling lists.
_PRIORITY_SUFFIXES = ("", "\x06\x163", "\x06\x166", "\x06\x169")


def queue_depths() -> dict[str, int]:
    prefix = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {}).get("global_keyprefix", "")
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_timeout=2)
    try:
        pipe = client.pipeline()
        for queue in QUEUES:
            for suffix in _PRIORITY_SUFFIXES:
                pipe.llen(f"{prefix}{queue}{suffix}")
        lengths = pipe.execute()
    finally:
        client.close()
    step = len(_PRIORITY_SUFFIXES)
    return {queue: sum(lengths[i * step:(i + 1) * step]) for i, queue in enumerate(QUEUES)}


class DatabaseCollector(Collector):
    def collect(self) -> Iterator:
        yield from _queues()
        versions = GaugeMetricFamily("flywheel_policy_versions", "Policy versions by state.",
                                     labels=["project", "state"])
        for row in selectors.metrics_versions_by_state():
            versions.add_metric([row["project__slug"], row["state"]], row["n"])
        yield versions
        reward = GaugeMetricFamily("flywheel_reward_mean", "Mean reward of the trajectories each version served "
                                   "(rewards computed in the last 24 h).", labels=["project", "version"])
        for row in selectors.metrics_reward_means():
            reward.add_metric([row["trajectory__project__slug"], str(row["trajectory__policy_version"])], row["mean"])
        yield reward
        yield from _training()
        probe = GaugeMetricFamily("flywheel_replica_probe_failed", "1 for each live serving replica whose last probe "
                                  "after a swap was refused (it kept its old version; alert on it).",
                                  labels=["project", "address", "version"])
        for slug, address, version in replicas_probe_refused():
            probe.add_metric([slug, address, str(version)], 1)
        yield probe
        redactions = CounterMetricFamily("flywheel_redactions", "Matches replaced at ingest, by redactor.",
                                         labels=["project", "redactor"])
        for slug, redactor, n in RedactionTally.objects.values_list("project__slug", "redactor", "count"):
            redactions.add_metric([slug, redactor], n)
        yield redactions


def _queues() -> Iterator:
    up = GaugeMetricFamily("flywheel_broker_up", "1 when the broker answered this scrape.")
    try:
        depths = queue_depths()
    except redis.RedisError:
        up.add_metric([], 0)
        yield up
        return
    up.add_metric([], 1)
    depth = GaugeMetricFamily("flywheel_queue_depth", "Celery tasks waiting, by queue.", labels=["queue"])
    for queue, n in depths.items():
        depth.add_metric([queue], n)
    yield from (up, depth)


def _training() -> Iterator:
    step = GaugeMetricFamily("flywheel_training_step", "Newest optimiser step of the newest run.", labels=["project"])
    speed = GaugeMetricFamily("flywheel_training_tokens_per_second", "Trainer throughput at that step.",
                              labels=["project"])
    for row in selectors.metrics_training_latest():
        step.add_metric([row["run__project__slug"]], row["step"])
        speed.add_metric([row["run__project__slug"]], row["tokens_per_s"])
    dropped = CounterMetricFamily("flywheel_training_trajectories_dropped_stale", "Trajectories the trainer left "
                                  "out as too many versions behind.", labels=["project"])
    for row in selectors.metrics_dropped_stale():
        dropped.add_metric([row["run__project__slug"]], row["n"] or 0)
    yield from (step, speed, dropped)


DATABASE_REGISTRY = CollectorRegistry(auto_describe=False)
DATABASE_REGISTRY.register(DatabaseCollector())


def metrics_view(request: HttpRequest) -> HttpResponse:
    return metrics_response(request, extra=lambda: generate_latest(DATABASE_REGISTRY))
