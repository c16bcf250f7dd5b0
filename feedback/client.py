"""Python sender for Flywheel's ingest webhook. Depends on httpx and standardwebhooks only.

    from feedback.client import FlywheelClient
    client = FlywheelClient("http://127.0.0.1:8000", "whsec_…", project="my-product")
    client.send([{"type": "feedback", "id": "fb-1", "trajectory_id": "traj-1", "signal": "accept"}])

Each `send` is one delivery: it is signed (Standard Webhooks), and retried on 429/5xx and
connection errors with exponential backoff, always with the same `webhook-id`, so a retry
of a delivery that did land is answered as a duplicate and never stored twice.
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from standardwebhooks.webhooks import Webhook

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class FlywheelError(RuntimeError):
    """The server refused a delivery for good (a 4xx other than 429), or retries ran out."""

    def __init__(self, status: int | None, body: Any) -> None:
        super().__init__(f"Flywheel answered {status}: {body}")
        self.status = status
        self.body = body


@dataclass
class SendResult:
    webhook_id: str
    results: list[dict[str, Any]]
    attempts: int

    @property
    def accepted(self) -> int:
        return sum(1 for r in self.results if r["status"] == "accepted")

    @property
    def rejected(self) -> list[dict[str, Any]]:
        return [r for r in self.results if r["status"] == "rejected"]


class FlywheelClient:
    def __init__(
        self,
        url: str,
        secret: str,
        *,
        project: str,
        max_retries: int = 6,
        backoff_s: float = 0.25,
        timeout_s: float = 30.0,
        max_wait_s: float = 60.0,
        http: httpx.Client | None = None,
    ) -> None:
        self.endpoint = url.rstrip("/") + "/api/v1/events"
        self.project = project
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_wait_s = max_wait_s
        self._webhook = Webhook(secret)
        self._http = http or httpx.Client(timeout=timeout_s)

    def send(self, events: list[dict[str, Any]], *, webhook_id: str | None = None) -> SendResult:
        body = json.dumps({"events": events}, allow_nan=False, separators=(",", ":"))
        webhook_id = webhook_id or f"msg_{uuid.uuid4().hex}"
        for attempt in range(1, self.max_retries + 2):
            status, payload, retry_after = self._post(webhook_id, body)
            if status == 202:
                return SendResult(webhook_id, payload["results"], attempt)
            if status is not None and status not in RETRY_STATUSES:
                raise FlywheelError(status, payload)
            if attempt > self.max_retries:
                raise FlywheelError(status, payload)
            wait = retry_after if retry_after is not None else self._delay(attempt)
            time.sleep(min(wait, self.max_wait_s))
        raise AssertionError("unreachable")

    def send_many(self, events: Iterable[dict[str, Any]], batch_size: int = 500) -> Iterator[SendResult]:
        batch: list[dict[str, Any]] = []
        for event in events:
            batch.append(event)
            if len(batch) == batch_size:
                yield self.send(batch)
                batch = []
        if batch:
            yield self.send(batch)

    def close(self) -> None:
        self._http.close()

    def _post(self, webhook_id: str, body: str) -> tuple[int | None, Any, float | None]:
        # Signed at each attempt: a retry after minutes must not carry a stale timestamp.
        now = datetime.now(tz=UTC)
        headers = {
            "content-type": "application/json",
            "webhook-id": webhook_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": self._webhook.sign(webhook_id, now, body),
            "flywheel-project": self.project,
        }
        try:
            response = self._http.post(self.endpoint, content=body.encode(), headers=headers)
        except httpx.TransportError as exc:
            return None, str(exc), None
        try:
            payload = response.json()
        except ValueError:
            payload = response.text
        retry_after = response.headers.get("retry-after")
        return response.status_code, payload, float(retry_after) if retry_after and retry_after.isdigit() else None

    def _delay(self, attempt: int) -> float:
        return self.backoff_s * (2 ** (attempt - 1)) * (0.5 + random.random() / 2)
