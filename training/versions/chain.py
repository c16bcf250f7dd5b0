"""Reads of the audit log's hash chain (training/audit_chain.py recomputes it)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from django.db import connection, transaction

from training.audit_chain import ChainBreak, ChainRow, first_break
from training.models import AuditLog

_ROWS = """
SELECT id, seq, prev_hash, hash, project_id, actor, action, target, before::text, after::text, reason, at
FROM {table} ORDER BY seq, id
"""


@dataclass(frozen=True)
class ChainReport:
    rows: int
    broken: ChainBreak | None
    head_seq: int  # the last row's seq and hash: kept elsewhere, they reveal a tail cut off later
    head_hash: str


def audit_chain_verify(batch: int = 2000) -> ChainReport:
    """Walks the whole chain in `seq` order (a server-side cursor, `batch` rows at a time)."""
    last: list[ChainRow] = []

    def rows(cur) -> Iterator[ChainRow]:
        while chunk := cur.fetchmany(batch):
            for values in chunk:
                last[:] = [ChainRow(*values)]
                yield last[0]

    with transaction.atomic(), connection.chunked_cursor() as cur:
        cur.execute(_ROWS.format(table=connection.ops.quote_name(AuditLog._meta.db_table)))
        count, broken = first_break(rows(cur))
    head = last[0] if last else None
    return ChainReport(count, broken, head.seq if head else 0, head.hash if head else "")
