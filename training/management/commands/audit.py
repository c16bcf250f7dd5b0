"""python manage.py audit verify [--head SEQ:HASH]

Walks the audit log's hash chain (training/audit_chain.py) and reports the first row that was
altered, deleted or inserted out of the chain; exit 1 then. Prints the head (last seq and hash):
kept outside the database, it lets a later `--head` run detect rows cut from the end too.
Needs only SELECT on the log: the application's role can run it.
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from training.audit_chain import GENESIS
from training.models import AuditLog
from training.versions.chain import audit_chain_verify


class Command(BaseCommand):
    help = "Check the audit log's hash chain (exit 1 at the first bad row)."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="action", required=True)
        verify = sub.add_parser("verify", help="check every row's hash and link to the previous row")
        verify.add_argument("--head", default="",
                            help="SEQ:HASH printed by an earlier verify: that row must still be in the chain")

    def handle(self, *args, **opts):
        report = audit_chain_verify()
        if report.broken is not None:
            b = report.broken
            raise CommandError(f"audit chain broken at row id={b.row_id} seq={b.seq}: {b.problem}. "
                               f"{report.rows - 1} rows before it verified.")
        if opts["head"]:
            self._check_head(opts["head"])
        self.stdout.write(f"OK: {report.rows} audit rows chained; head seq={report.head_seq} "
                          f"hash={report.head_hash or GENESIS}")

    def _check_head(self, head: str) -> None:
        seq, _, digest = head.partition(":")
        if not seq.isdigit() or len(digest) != 64:
            raise CommandError(f"--head must be SEQ:HASH as printed by `audit verify`, got {head!r}")
        if int(seq) == 0:
            return
        row = AuditLog.objects.filter(seq=int(seq)).values_list("hash", flat=True).first()
        if row != digest:
            found = "is missing" if row is None else f"has hash {row}"
            raise CommandError(f"audit chain head seq={seq} {found}, not {digest}: rows were cut from "
                               "the end or the chain was rewritten")
