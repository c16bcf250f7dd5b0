"""The internal listener's per-replica tokens (stdlib only: the web app imports it without the
serving process's modules).

The web app holds FLYWHEEL_INTERNAL_TOKEN and sends each registered replica its own token,
derived from it and the address the replica registered; a replica accepts its own token (and the
shared one only if it was given it). Deploy replicas with FLYWHEEL_REPLICA_TOKEN alone
(`manage.py replica_token ADDRESS`) and one that is taken over cannot push to the others.
"""

from __future__ import annotations

import hashlib
import hmac


def replica_token(master: str, address: str) -> str:
    """The token of the replica registered at `address` (what the web app sends it)."""
    return hmac.new(master.encode(), f"flywheel-replica:{address}".encode(), hashlib.sha256).hexdigest()
