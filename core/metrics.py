"""Prometheus metrics: the process-wide counters and histograms, the request-latency middleware,
and the guarded `/metrics` answer shared by the web app and the serving process.

    curl -H "Authorization: Bearer $FLYWHEEL_METRICS_TOKEN" http://web:8000/metrics
    curl http://127.0.0.1:8001/metrics            # loopback, when no token is configured

Who may scrape: with `FLYWHEEL_METRICS_TOKEN` set, only a request bearing it (from anywhere);
without it, only a direct loopback connection (none of the headers a reverse proxy on the same
machine adds, `PROXY_HEADERS`: X-Real-IP, X-Forwarded-*, Forwarded...; proxied requests would
otherwise look local).

The serving process's own metrics are in inference/metrics.py (free of Django, like the engines).
Counters live in the process that counts (each web replica, each serving process); figures the
database already holds (versions by state, reward means, training step) are read at scrape time
by collectors that the web app registers (webapp/metrics.py), so any one web replica reports them.
"""

from __future__ import annotations

import collections
import hmac
import time
from collections.abc import Callable, Iterable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

INGEST_EVENTS = Counter("flywheel_ingest_events", "Events through feedback_ingest, by outcome.", ["status"])
HTTP_SECONDS = Histogram("flywheel_http_request_duration_seconds", "Time to answer an HTTP request, by route.",
                         ["method", "route", "status"], buckets=LATENCY_BUCKETS)
def ingest_counted(statuses: Iterable[str]) -> None:
    # One increment a status, not an event: a labelled counter's look-up and lock cost a batch of
    # 1,000 events more than its parse of the body.
    for status, count in collections.Counter(statuses).items():
        INGEST_EVENTS.labels(status).inc(count)


class RequestMetricsMiddleware:
    """Latency histogram by the matched URL pattern (bounded label set; an unmatched path is
    `unmatched`, so a scanner cannot grow the series). Sync and async, so that it never makes
    Django hop threads under ASGI."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest):
        if self.is_async:
            return self._acall(request)
        start = time.perf_counter()
        response = self.get_response(request)
        _observe(request, response, start)
        return response

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        start = time.perf_counter()
        response = await self.get_response(request)
        _observe(request, response, start)
        return response


def _observe(request: HttpRequest, response: HttpResponse, start: float) -> None:
    match = getattr(request, "resolver_match", None)
    route = match.route if match is not None and match.route else "unmatched"
    method = request.method if request.method in _METHODS else "other"
    HTTP_SECONDS.labels(method, route, str(response.status_code)).observe(time.perf_counter() - start)


_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
_LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})
# What a reverse proxy on this machine adds to what it forwards (nginx's X-Real-IP, Traefik's
# and HAProxy's X-Forwarded-*, the CDNs' client headers): a request bearing any one came from
# elsewhere, whatever REMOTE_ADDR says. Present at all counts, even empty.
PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip",
                 "x-client-ip", "x-cluster-client-ip", "true-client-ip", "cf-connecting-ip", "fastly-client-ip", "via")


def scrape_refusal(request: HttpRequest) -> JsonResponse | None:
    """None when `request` may read the metrics; else the 401/403 that says how to get them."""
    token = getattr(settings, "FLYWHEEL_METRICS_TOKEN", "")
    if token:
        sent = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if sent and hmac.compare_digest(sent.encode(), token.encode()):
            return None
        return _refused(401, "/metrics needs the metrics token",
                        "Send 'Authorization: Bearer <FLYWHEEL_METRICS_TOKEN>' (Prometheus: "
                        "authorization.credentials in the scrape config).")
    proxied = any(request.headers.get(name) is not None for name in PROXY_HEADERS)
    if request.META.get("REMOTE_ADDR") in _LOOPBACK and not proxied:
        return None
    return _refused(403, "/metrics answers only loopback connections when no metrics token is set",
                    "Set FLYWHEEL_METRICS_TOKEN on this process and scrape with it as a bearer token, "
                    "or scrape from the same machine without a proxy.")


def _refused(status: int, message: str, fix: str) -> JsonResponse:
    code = "unauthorized" if status == 401 else "forbidden"
    return JsonResponse({"error": {"code": code, "message": message, "fix": fix}}, status=status)


def metrics_response(request: HttpRequest, extra: Callable[[], bytes] | None = None) -> HttpResponse:
    """This process's registry, then `extra()` (more exposition text, e.g. figures read from the
    database), only for a caller allowed to scrape."""
    refusal = scrape_refusal(request)
    if refusal is not None:
        return refusal
    body = generate_latest(REGISTRY) + (extra() if extra is not None else b"")
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
