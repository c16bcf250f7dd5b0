"""The audit log's hash chain, recomputed outside the database (no Django here).

    python manage.py audit verify      # walks the whole chain; exit 1 at the first bad row

Each `training_auditlog` row carries `seq` (1, 2, ...), `prev_hash` (the previous row's `hash`; 64
zeros for the first) and `hash` = SHA-256 of `canonical(row)`. The database computes them in a
BEFORE INSERT trigger (training/migrations/0005_audit_chain.py); this module computes the same
bytes independently, so a row altered after the fact (even by the table's owner, who can switch
the triggers off) no longer matches its hash, and a deleted row leaves a gap in `seq` and a
`prev_hash` that names no row.

The canonical text is one field a line; a text field is `<length>:<text>` (length in characters,
so no value can fake a field boundary), SQL NULL is `-`, JSON is PostgreSQL's jsonb text form
(read back as `before::text`), time is microseconds since the epoch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

VERSION = "flywheel-audit-v1"
GENESIS = "0" * 64
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class ChainRow:
    """One row as read back for checking: JSON fields as their jsonb text (`before::text`)."""

    id: int
    seq: int
    prev_hash: str
    hash: str
    project_id: int
    actor: str
    action: str
    target: str
    before: str | None
    after: str | None
    reason: str
    at: datetime


@dataclass(frozen=True)
class ChainBreak:
    """The first row where the chain does not hold, and what is wrong with it."""

    row_id: int
    seq: int
    problem: str


def _field(value: str | None) -> str:
    return "-" if value is None else f"{len(value)}:{value}"


def epoch_us(at: datetime) -> int:
    return (at - _EPOCH) // timedelta(microseconds=1)


def canonical(row: ChainRow, seq: int, prev_hash: str) -> bytes:
    lines = [VERSION, str(seq), prev_hash, str(row.project_id), _field(row.actor), _field(row.action),
             _field(row.target), _field(row.before), _field(row.after), _field(row.reason), str(epoch_us(row.at))]
    return "\n".join(lines).encode("utf-8")


def row_hash(row: ChainRow, seq: int, prev_hash: str) -> str:
    return hashlib.sha256(canonical(row, seq, prev_hash)).hexdigest()


def first_break(rows: Iterable[ChainRow]) -> tuple[int, ChainBreak | None]:
    """Walks `rows` in `seq` order; returns (rows checked, the first break or None)."""
    expected_seq, prev, count = 1, GENESIS, 0
    for row in rows:
        count += 1
        if row.seq != expected_seq:
            missing = "deleted" if row.seq > expected_seq else "repeated or out of order"
            return count, ChainBreak(row.id, row.seq, f"seq {row.seq} where {expected_seq} was expected "
                                                      f"(rows {missing})")
        if row.prev_hash != prev:
            return count, ChainBreak(row.id, row.seq, "prev_hash is not the previous row's hash "
                                                      "(the previous row was deleted or replaced)")
        if row_hash(row, row.seq, row.prev_hash) != row.hash:
            return count, ChainBreak(row.id, row.seq, "hash does not match the row's content (the row was altered)")
        expected_seq, prev = row.seq + 1, row.hash
    return count, None
