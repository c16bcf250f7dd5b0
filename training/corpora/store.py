"""The corpus blob store: each file's bytes once, named by their SHA-256, under FLYWHEEL_CORPUS_DIR."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from django.conf import settings


def blob_path(sha: str) -> Path:
    return Path(settings.FLYWHEEL_CORPUS_DIR) / "blobs" / sha[:2] / sha


def blob_put(data: bytes) -> str:
    """Stores `data` once under its SHA-256 (written to a temporary file, then renamed: a reader
    never sees half a blob)."""
    sha = hashlib.sha256(data).hexdigest()
    target = blob_path(sha)
    if target.exists():
        return sha
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, target)
    return sha


def blob_text(sha: str) -> str:
    return blob_path(sha).read_text(encoding="utf-8")
