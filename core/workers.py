"""Who runs a piece of work, and whether it still can: recorded with a claim (a training run's
`worker`, a gate's audit row), read by the sweeper (training/runs/sweep.py)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from core.embedded import pid_alive


@dataclass(frozen=True)
class WorkerRef:
    """`kind|node|host|pid|task_id`: a Celery worker process (or a local caller) holding work."""

    kind: str  # celery | local
    node: str
    host: str
    pid: int
    task_id: str = ""

    def __str__(self) -> str:
        return "|".join([self.kind, self.node, self.host, str(self.pid), self.task_id])[:200]

    @classmethod
    def parse(cls, text: str) -> WorkerRef | None:
        parts = (text or "").split("|")
        if len(parts) != 5 or not parts[3].isdigit():
            return None
        return cls(parts[0], parts[1], parts[2], int(parts[3]), parts[4])

    @classmethod
    def here(cls, kind: str = "local", node: str = "", task_id: str = "") -> WorkerRef:
        return cls(kind, node or kind, socket.gethostname(), os.getpid(), task_id)

    def gone(self) -> str | None:
        """Why this worker certainly cannot run the work any more (its process on this host is
        gone); None when it may still (alive, or on another host: time limits decide there)."""
        if self.host == socket.gethostname() and not pid_alive(self.pid):
            return f"worker process {self.pid} on {self.host} ({self.node}) is gone"
        return None
