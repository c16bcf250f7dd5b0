"""Writes of users' data in the feedback app: the project's data policy, the opt-out list, the
erasure of one user's rows (and of their copies in the export folder), retention.

The erasure of what training derived (rewards, rubric scores: CASCADE from the trajectory), and the
report of the versions that learned from the data, is `training.lineage.services.user_erase`, which
calls `user_rows_erase` here.

    .venv/bin/python -m pytest tests/feedback/test_users_data.py -q
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from core.errors import BadRequest
from feedback.models import ConsentOptOut, DataPolicy, FeedbackEvent, Project, Quarantine, Trajectory
from feedback.selectors import in_project
from feedback.services import data_policy_of, user_hash_of
from feedback.userdata import redaction

RETENTION_BATCH = 1000  # rows deleted per statement: a sweep never holds long locks
# Transaction-local setting: while 'on', the rollups' delete triggers (webapp migration 0004) skip
# the deleted rows, so the hourly rollups keep them (the retention sweep).
ROLLUPS_KEEP = "flywheel.rollups_keep"


def data_policy_set(project: Project, **fields: Any) -> DataPolicy:
    """Changes the project's data policy (consent_default, retention_days, erasure_policy,
    redactors, custom_patterns); every value is checked first and nothing is saved on an error.
    Not audited: every change goes through training.lineage.services.data_policy_update, which
    calls it and writes the AuditLog row (the audit log is the training app's)."""
    policy = data_policy_of(project)
    unknown = set(fields) - {"consent_default", "retention_days", "erasure_policy", "redactors", "custom_patterns"}
    if unknown:
        raise BadRequest(f"unknown data policy fields {sorted(unknown)}",
                         "Use consent_default, retention_days, erasure_policy, redactors or custom_patterns.")
    _check_choice(fields, "consent_default", DataPolicy.CONSENTS)
    _check_choice(fields, "erasure_policy", DataPolicy.ERASURE_POLICIES)
    days = fields.get("retention_days")
    if days is not None and (type(days) is not int or not 1 <= days <= 36_500):
        raise BadRequest(f"retention_days={days!r} is not a number of days",
                         "Give a whole number of days from 1 to 36500, or null to keep raw events for ever.")
    if "redactors" in fields or "custom_patterns" in fields:
        redaction.redactor_for(fields.get("redactors", policy.redactors),
                               fields.get("custom_patterns", policy.custom_patterns))  # raises BadRequest
    if "redactors" in fields:
        fields["redactors"] = list(dict.fromkeys(fields["redactors"]))
    if "custom_patterns" in fields:  # exactly what was checked is kept, nothing more
        fields["custom_patterns"] = [{"name": c["name"], "pattern": c["pattern"]} for c in fields["custom_patterns"]]
    for name, value in fields.items():
        setattr(policy, name, value)
    policy.save()
    return policy


def _check_choice(fields: dict[str, Any], name: str, choices: list[tuple[str, str]]) -> None:
    if name in fields and fields[name] not in {c for c, _ in choices}:
        raise BadRequest(f"{name}={fields[name]!r} is not known", f"Use one of {[c for c, _ in choices]}.")


def consent_opt_out_set(project: Project, user: str, opted_out: bool) -> bool:
    """Puts the user on (or off) the project's opt-out list; returns whether they were on it.
    From the moment this commits, no run that starts trains on their trajectories or feedback
    (feedback.selectors.trainable). Not audited: called by
    training.lineage.services.consent_opt_out_update, which writes the AuditLog row."""
    hashed = _user_hash(project, user)
    before = ConsentOptOut.objects.filter(project=project, user_hash=hashed).exists()
    if opted_out and not before:
        ConsentOptOut.objects.get_or_create(project=project, user_hash=hashed)
    elif not opted_out:
        ConsentOptOut.objects.filter(project=project, user_hash=hashed).delete()
    return before


def _user_hash(project: Project, user: Any) -> str:
    if not isinstance(user, str | int) or isinstance(user, bool) or not str(user) or len(str(user)) > 255:
        raise BadRequest("'user' must be the product's user id, 1 to 255 characters",
                         "Send the same id the events carried in 'user' (it is hashed the same way).")
    return user_hash_of(project, user)


@dataclass
class RowsErased:
    counts: dict[str, int]
    export_files: list[str]


def user_rows_erase(project: Project, user: Any) -> RowsErased:
    """Deletes every row of the feedback app that carries the user's hashed id or their text: the
    trajectories served to them (with their steps, feedback, rewards, rubric scores and
    quarantine rows, by CASCADE), their feedback on anyone's trajectory (the rewards of those
    trajectories too: they are recomputed without it), feedback still waiting for one of their
    trajectories, their opt-out row, and their rows in the export folder's JSON Lines files.
    In the caller's transaction: all of it or nothing."""
    hashed = _user_hash(project, user)
    trajectories = Trajectory.objects.filter(project=project, user_hash=hashed)
    external_ids = list(trajectories.values_list("external_id", flat=True))
    texts = _texts_of(trajectories)
    others = list(FeedbackEvent.objects.filter(project=project, user_hash=hashed, trajectory__isnull=False)
                  .exclude(trajectory__user_hash=hashed).values_list("trajectory_id", flat=True).distinct())
    counts = {
        "quarantine": Quarantine.objects.filter(project=project, trajectory__user_hash=hashed).delete()[0]
        + Quarantine.objects.filter(project=project, item__in=[f"trajectory {e}" for e in external_ids]).delete()[0],
        "rewards_recomputed": _rewards_drop(others),
        "feedback": FeedbackEvent.objects.filter(project=project, user_hash=hashed).delete()[0]
        + FeedbackEvent.objects.filter(in_project(project), trajectory__isnull=True,
                                       trajectory_external_id__in=external_ids).delete()[0],
        "trajectories": len(external_ids),
        "opt_out": ConsentOptOut.objects.filter(project=project, user_hash=hashed).delete()[0],
    }
    deleted = trajectories.delete()[1]
    counts.update({f"cascade:{label.split('.')[-1].lower()}": n for label, n in deleted.items()})
    files = exports_scrub(texts)
    return RowsErased(counts, files)


def _rewards_drop(trajectory_ids: list[int]) -> int:
    if not trajectory_ids:
        return 0
    with connection.cursor() as cur:  # training's table, by name: the feedback app does not import it
        cur.execute("DELETE FROM training_reward WHERE trajectory_id = ANY(%s)", [trajectory_ids])
        return cur.rowcount


def _texts_of(trajectories) -> set[str]:
    """Every text a user's trajectories hold (prompt messages, steps): what an export row copies."""
    texts: set[str] = set()
    for trajectory in trajectories.prefetch_related("steps"):
        texts |= {str(m.get("content")) for m in trajectory.prompt or [] if isinstance(m, dict) and m.get("content")}
        texts |= {s.content for s in trajectory.steps.all() if s.content}
    return texts


def exports_scrub(texts: Iterable[str], folder: Path | None = None) -> list[str]:
    """Rewrites every JSON Lines file under the export folder without the rows that hold one of
    `texts` as a value (an export copies prompt and step texts verbatim); returns the files
    changed. A file is replaced whole (a temporary file renamed over it)."""
    wanted = set(texts)
    folder = Path(folder or settings.FLYWHEEL_EXPORT_DIR)
    if not wanted or not folder.is_dir():
        return []
    changed = []
    for path in sorted(folder.rglob("*.jsonl")):
        if _scrub_file(path, wanted):
            changed.append(str(path))
    return changed


def _scrub_file(path: Path, wanted: set[str]) -> bool:
    dropped = False
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".scrub-")
    with os.fdopen(fd, "w", encoding="utf-8") as out, path.open(encoding="utf-8", errors="replace") as src:
        for line in src:
            if _holds(line, wanted):
                dropped = True
                continue
            out.write(line)
    if dropped:
        os.replace(tmp, path)
    else:
        os.unlink(tmp)
    return dropped


def _holds(line: str, wanted: set[str]) -> bool:
    try:
        row = json.loads(line)
    except ValueError:
        return any(t in line for t in wanted)  # not JSON: any occurrence counts
    stack = [row]
    while stack:
        value = stack.pop()
        if isinstance(value, str) and value in wanted:
            return True
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return False


def retention_sweep(project: Project, now=None, batch: int = RETENTION_BATCH, max_batches: int = 100) -> dict[str, int]:
    """Deletes the project's raw events older than its retention (feedback events, then
    trajectories with their steps, rewards and scores), `batch` rows a statement and at most
    `max_batches` statements a call (the next beat tick goes on).

    Rollups and versions outlive retention: each batch runs in a transaction with `ROLLUPS_KEEP`
    on, so the delete triggers (webapp migration 0004) mark no rollup units dirty and the hourly
    rollups keep counting the expired rows. An erasure (`user_rows_erase`) leaves it off: the next
    refresh recomputes the user's hours without their rows."""
    days = data_policy_of(project).retention_days
    if not days:
        return {"feedback": 0, "trajectories": 0}
    cutoff = (now or timezone.now()) - timedelta(days=days)
    counts = {"feedback": 0, "trajectories": 0}
    for _ in range(max_batches):
        with transaction.atomic():
            _rollups_keep(True)
            gone = _delete_batch(FeedbackEvent.objects.filter(project=project, received_at__lt=cutoff), batch)
            counts["feedback"] += gone
            if not gone:
                gone = _delete_batch(Trajectory.objects.filter(project=project, received_at__lt=cutoff), batch)
                counts["trajectories"] += gone
            _rollups_keep(False)  # a caller's outer transaction goes on marking its deletes
        if not gone:
            break
    return counts


def _rollups_keep(on: bool) -> None:
    """SET LOCAL ROLLUPS_KEEP: the rest of the transaction (or until set off) deletes raw rows
    without marking their rollup units dirty. A batch that fails takes it back with its rollback."""
    with connection.cursor() as cur:
        cur.execute("SELECT set_config(%s, %s, true)", [ROLLUPS_KEEP, "on" if on else "off"])


def _delete_batch(queryset, batch: int) -> int:
    ids = list(queryset.order_by("pk").values_list("pk", flat=True)[:batch])
    if not ids:
        return 0
    queryset.model.objects.filter(pk__in=ids).delete()
    return len(ids)
