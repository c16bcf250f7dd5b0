"""Writes of the feedback app: projects and credentials, and the ingest of event batches.

`feedback_ingest` is the one path by which trajectories and feedback reach the database, from the
webhook, the serving process and the simulators alike.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
from base64 import b64encode
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import msgspec
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import DataError, IntegrityError, connection, transaction
from django.utils import timezone

from core.errors import BadRequest, NotFound
from core.metrics import ingest_counted
from feedback.events import (
    EventError,
    FeedbackRecord,
    TrajectoryRecord,
    event_identity,
    hash_user,
    parse_event,
)
from feedback.models import SERVICE_ACCOUNT_PREFIX, ApiKey, DataPolicy, Membership, Project, WebhookSecret
from feedback.userdata import redaction

SECRET_ROTATION_GRACE = timedelta(hours=24)
# How long a delivered webhook-id is remembered. A Standard Webhooks sender retries a message
# under its first id with a new timestamp for about a day (Svix's schedule ends near 27 h); after
# that a re-sent batch is still stored once, each event answered "duplicate" by its own id.
DELIVERY_KEEP = timedelta(days=7)

log = logging.getLogger(__name__)


# --- projects and credentials -------------------------------------------------------------------


@dataclass(frozen=True)
class ProjectCredentials:
    project: Project
    api_key: str
    webhook_secret: str


def project_create(name: str, slug: str | None = None) -> ProjectCredentials:
    from django.utils.text import slugify

    slug = slug or slugify(name)[:64]
    if not slug:
        raise BadRequest(f"project name {name!r} gives an empty slug", "Use letters or digits in the name.")
    if Project.objects.filter(slug=slug).exists():
        raise BadRequest(f"a project with slug {slug!r} exists", "Choose another name or pass --slug.")
    with transaction.atomic():
        project = Project.objects.create(name=name, slug=slug)
        raw_key = api_key_create(project, ["ingest", "read", "serve"], name="default")
        secret = webhook_secret_create(project)
    return ProjectCredentials(project=project, api_key=raw_key, webhook_secret=secret.secret)


def api_key_create(project: Project, scopes: Iterable[str], name: str = "default", owner: Any = None) -> str:
    """Creates a key and returns it in clear: the only time it is shown (only its hash is kept).

    `owner`: the person or service account the key acts as (decisions made with it are theirs:
    their role in the project, the two-person rule); None for a key that decides nothing."""
    scopes = sorted(set(scopes))
    unknown = set(scopes) - set(ApiKey.SCOPES)
    if unknown:
        raise BadRequest(f"unknown scopes {sorted(unknown)}", f"Use any of {list(ApiKey.SCOPES)}.")
    raw = f"fw_{secrets.token_urlsafe(32)}"
    ApiKey.objects.create(project=project, name=name, prefix=raw[:11], key_hash=ApiKey.hash_key(raw), scopes=scopes,
                          owner=owner)
    return raw


def service_account_get(name: str) -> Any:
    """The service account `service:<name>` (created on first use): a user with no password that
    acts only through keys bound to it, or as the named starter of what the system starts
    (`service:scheduler` starts the beat's training runs)."""
    if not name or len(name) > 100 or not all(c.isalnum() or c in "-_." for c in name):
        raise BadRequest(f"service account name {name!r} is not valid", "Use letters, digits, '-', '_' or '.'.")
    user, created = get_user_model().objects.get_or_create(username=f"{SERVICE_ACCOUNT_PREFIX}{name}")
    if created:
        user.set_unusable_password()
        user.save(update_fields=["password"])
    return user


def membership_set(project: Project, user: Any, role: str | None) -> str | None:
    """Gives `user` `role` in `project` (None removes them); returns the role they had before.
    Callers that act for a person go through training.promotion.services.membership_grant, which
    also writes the audit row."""
    if role is not None and role not in Membership.RANK:
        raise BadRequest(f"unknown role {role!r}", f"Use one of {list(Membership.RANK)}.")
    with transaction.atomic():
        row = Membership.objects.select_for_update().filter(project=project, user=user).first()
        before = row.role if row else None
        if role is None:
            if row is not None:
                row.delete()
        elif row is None:
            Membership.objects.create(project=project, user=user, role=role)
        elif row.role != role:
            row.role = role
            row.save(update_fields=["role"])
    return before


def api_key_revoke(prefix: str) -> ApiKey:
    key = ApiKey.objects.filter(prefix=prefix, revoked_at__isnull=True).first()
    if key is None:
        raise NotFound(f"no active API key starts with {prefix!r}", "List keys in the admin; give the 11-char prefix.")
    key.revoked_at = timezone.now()
    key.save(update_fields=["revoked_at"])
    return key


def webhook_secret_create(project: Project) -> WebhookSecret:
    """A new signing secret, stored encrypted; the returned row's `.secret` is the only time the
    clear value is handed out (show it to the person once)."""
    raw = f"whsec_{b64encode(secrets.token_bytes(24)).decode()}"
    row = WebhookSecret(project=project)
    row.secret = raw
    row.save()
    return row


def webhook_secret_rotate(project: Project, grace: timedelta = SECRET_ROTATION_GRACE) -> WebhookSecret:
    """A new secret; the current ones stay valid for `grace` so senders can switch without loss."""
    now = timezone.now()
    with transaction.atomic():
        current = WebhookSecret.objects.select_for_update().filter(project=project, revoked_at__isnull=True)
        # At most two are active: older ones than the newest current one end now.
        ordered = list(current.order_by("-created_at"))
        for old in ordered[1:]:
            old.revoked_at = now
            old.save(update_fields=["revoked_at"])
        if ordered:
            ordered[0].expires_at = now + grace
            ordered[0].save(update_fields=["expires_at"])
        return webhook_secret_create(project)


# --- ingest -------------------------------------------------------------------------------------


def user_hash_key(project: Project) -> str:
    """The HMAC key user ids of `project` are hashed with: the server's pepper (never stored in
    the database nor sent anywhere), separated per project so one project's hashes do not match
    another's."""
    pepper = settings.FLYWHEEL_USER_PEPPER.encode()
    return hmac.new(pepper, f"project:{project.pk}".encode(), hashlib.sha256).hexdigest()


def user_audit_ref(project: Project, user: str | int) -> str:
    """What the audit log names a user by (an opt-out, an opt-in): a peppered HMAC of their stored
    hash, so it is neither their id nor the hash their rows carry. The audit log cannot be changed,
    and an erasure must leave no row with the user's hash; whoever is given the id (and holds the
    pepper) can still find the user's consent history."""
    return hmac.new(user_hash_key(project).encode(), f"audit:{user_hash_of(project, user)}".encode(),
                    hashlib.sha256).hexdigest()


def data_policy_of(project: Project) -> DataPolicy:
    """The project's data policy; an unsaved row with the defaults when it has none. Read with the
    project when that was fetched with select_related("data_policy") (ingest's authentication
    does: a query less a request), else from the database now."""
    related = Project.data_policy.related
    if related.is_cached(project):
        return related.get_cached_value(project) or DataPolicy(project=project)
    return DataPolicy.objects.filter(project=project).first() or DataPolicy(project=project)


def user_hash_of(project: Project, user: str | int) -> str:
    """The stored form of a user id of `project` (what ingest writes for the same id). An id
    ingest would refuse (a lone surrogate) still hashes, to a value no stored row carries."""
    text = str(user).encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return hash_user(text, user_hash_key(project))


@dataclass(slots=True)
class EventResult:
    index: int
    id: str | None
    type: str | None
    status: str  # accepted | duplicate | rejected
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "id": self.id, "type": self.type, "status": self.status}
        if self.reason:
            out["reason"] = self.reason
        return out


def feedback_ingest(
    project: Project,
    raw_events: list[Any],
    *,
    webhook_id: str | None = None,
    on_commit: Callable[[dict[str, int]], None] | None = None,
) -> list[EventResult]:
    """Validates and stores a batch in one transaction; returns one result per event.

    Idempotent per event id (a unique constraint with ON CONFLICT DO NOTHING, so concurrent
    duplicate deliveries store one row), and per `webhook_id` when given. Returns only after
    the transaction committed: an acknowledged event is durable."""
    results = _ingest(project, raw_events, webhook_id, on_commit)
    ingest_counted(r.status for r in results)
    return results


def _ingest(project: Project, raw_events: list[Any], webhook_id: str | None,
            on_commit: Callable[[dict[str, int]], None] | None) -> list[EventResult]:
    now = timezone.now()
    results, trajectories, feedback, redacted = _parse_batch(project, raw_events, now)
    with transaction.atomic():
        _statement_timeout()
        if not _deliver_and_lock(project, webhook_id, len(raw_events), trajectories, feedback):
            return [_as_duplicate(r, "webhook-id was already delivered") for r in results]
        # Feedback naming a trajectory this project does not have is stored and linked when one
        # lands here, whether or not another project has that id: nothing tells the two apart.
        refused: dict[tuple[str, str], str] = {}
        rows = list(feedback.values())
        try:
            with transaction.atomic():  # a savepoint: a row the database refuses costs only its event
                new_ids, new_feedback = _insert_all(project, list(trajectories.values()), rows, now)
        except (DataError, IntegrityError, UnicodeError, TypeError, ValueError):
            log.exception("the database refused a batch that passed parse_event; retrying event by event")
            new_ids, new_feedback = _insert_each(project, list(trajectories.values()), rows, now, refused)
        counts = _settle(results, new_ids, new_feedback, refused)
        if redacted:
            transaction.on_commit(lambda: redaction_tally(project, redacted))
        if on_commit is not None:
            transaction.on_commit(lambda: on_commit(counts))
    return results


def _parse_batch(project: Project, raw_events: list[Any], now: datetime):
    results: list[EventResult] = []
    trajectories: dict[str, TrajectoryRecord] = {}  # external id -> record (first one wins)
    feedback: dict[str, FeedbackRecord] = {}
    key = user_hash_key(project)
    policy = data_policy_of(project)
    # Before anything is parsed, stored or trained on; a policy that does not compile refuses the
    # batch (nothing is ever stored unredacted).
    redactor = redaction.redactor_of_policy(policy.redactors, policy.custom_patterns) if (
        policy.redactors or policy.custom_patterns) else None
    redacted: dict[str, int] = {}
    for index, raw in enumerate(raw_events):
        kind, ident = event_identity(raw)
        result = EventResult(index=index, id=ident, type=kind, status="rejected")
        results.append(result)
        try:
            record = parse_event(redaction.redact_event(raw, redactor, redacted) if redactor else raw, now, key)
        except EventError as exc:
            result.reason = str(exc)
            continue
        except Exception as exc:  # a parser bug: it costs this event, never the batch
            log.exception("parse_event raised %s on event %d", type(exc).__name__, index)
            result.reason = (f"this event could not be validated ({type(exc).__name__}) and was not stored; "
                             "check it against the ingest contract and send it again")
            continue
        seen = trajectories if isinstance(record, TrajectoryRecord) else feedback
        ident_of = record.external_id if isinstance(record, TrajectoryRecord) else record.event_id
        if ident_of in seen:
            result.status, result.reason = "duplicate", "the same id appears earlier in this batch"
            continue
        record.consent = record.consent or policy.consent_default
        seen[ident_of] = record
        result.status = "pending"
    return results, trajectories, feedback, redacted


def redaction_tally(project: Project, counts: dict[str, int]) -> None:
    """Adds one batch's matches per redactor to the project's tallies (after its commit). The
    tallies are counters for /metrics and the Data page, not data: their commit does not wait for
    the disk (a crash may lose the last batches' counts), so redaction costs a batch no second
    flush of the log."""
    names = sorted(counts)
    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("SET LOCAL synchronous_commit TO off")
        cur.execute(
            "INSERT INTO feedback_redactiontally (project_id, redactor, count) "
            "SELECT %s, r, c FROM unnest(%s::text[], %s::bigint[]) AS t(r, c) "
            "ON CONFLICT (project_id, redactor) DO UPDATE SET count = feedback_redactiontally.count + EXCLUDED.count",
            [project.id, names, [counts[n] for n in names]],
        )


def _statement_timeout() -> None:
    # A write stuck behind a lock answers 503 (the client retries) instead of holding the
    # request, and the connection, for ever.
    from django.conf import settings

    with connection.cursor() as cur:
        cur.execute("SELECT set_config('statement_timeout', %s, true)", [str(settings.INGEST_STATEMENT_TIMEOUT_MS)])


def _as_duplicate(result: EventResult, reason: str) -> EventResult:
    if result.status != "rejected":
        result.status, result.reason = "duplicate", reason
    return result


def _deliver_and_lock(project: Project, webhook_id: str | None, count: int, trajectories: dict,
                      feedback: dict) -> bool:
    """Records the delivery (False: this webhook-id was delivered before) and takes the batch's
    trajectory-id locks, in one statement.

    The locks: feedback and its trajectory may arrive in two concurrent requests; each would miss
    the other's uncommitted row and the link would never be made. A transaction-level advisory
    lock per trajectory id (taken in sorted order: no deadlock) serialises exactly those pairs."""
    ids = sorted(set(trajectories) | {f.trajectory_external_id for f in feedback.values()})
    with connection.cursor() as cur:
        cur.execute(
            "WITH d AS (INSERT INTO feedback_webhookdelivery (project_id, webhook_id, received_at, event_count) "
            "SELECT %s, w, now(), %s FROM unnest(%s::text[]) AS w "
            "ON CONFLICT (project_id, webhook_id) DO NOTHING RETURNING id) "
            "SELECT (SELECT count(*) FROM d), (SELECT count(pg_advisory_xact_lock(k)) FROM "
            "(SELECT DISTINCT hashtextextended(x, %s) AS k FROM unnest(%s::text[]) AS x ORDER BY k) AS s)",
            [project.id, count, [webhook_id] if webhook_id is not None else [], project.id, ids],
        )
        delivered, _ = cur.fetchone()
    return webhook_id is None or delivered == 1


def _insert_all(project: Project, trajectories: list[TrajectoryRecord], feedback: list[FeedbackRecord],
                now: datetime) -> tuple[dict[str, int], set[str]]:
    new_ids = _insert_trajectories(project, trajectories, now)
    return new_ids, _insert_feedback(project, feedback, now)


def _insert_each(project: Project, trajectories: list[TrajectoryRecord], feedback: list[FeedbackRecord],
                 now: datetime, refused: dict[tuple[str, str], str]) -> tuple[dict[str, int], set[str]]:
    """The slow path: one savepoint per event, so the row the database refuses is that event's
    rejection (it is a gap in parse_event to close)."""
    new_ids: dict[str, int] = {}
    new_feedback: set[str] = set()
    events = [("trajectory", t.external_id, [t], []) for t in trajectories]
    events += [("feedback", f.event_id, [], [f]) for f in feedback]
    for kind, ident, traj, fb in events:
        try:
            with transaction.atomic():
                ids, stored = _insert_all(project, traj, fb, now)
        except (DataError, IntegrityError, UnicodeError, TypeError, ValueError) as exc:
            reason = str(exc).splitlines()[0][:200].encode("utf-8", "backslashreplace").decode()
            refused[(kind, ident)] = f"the database refused this event ({reason}); it was not stored"
            continue
        new_ids.update(ids)
        new_feedback |= stored
    return new_ids, new_feedback


_ROWS_JSON = msgspec.json.Encoder()


def _json_rows(rows: list[list[Any]]) -> str:
    # One parameter per table: the whole batch serialised once (msgspec: about a sixth of
    # json.dumps's time) and taken apart by jsonb_array_elements in the database, instead of a
    # Python array of text per column. Every number in a record is finite (parse_event refuses NaN
    # and infinities everywhere: tests/feedback/test_ingest_properties.py), and a lone surrogate
    # raises UnicodeEncodeError here (the batch goes event by event, refusing only that one).
    return _ROWS_JSON.encode(rows).decode()


# Trajectories and their steps in one statement: the steps join the trajectories the insert
# returned, so a trajectory stored before (a duplicate) gets no second set of steps; feedback that
# arrived before its trajectory is linked in the same statement (it sees every earlier commit:
# the batch's locks were taken first).
_INSERT_TRAJECTORIES = """
WITH t AS (
    INSERT INTO feedback_trajectory (project_id, external_id, policy_version, source, task, tags, prompt, extra,
                                     occurred_at, received_at, user_hash, no_train)
    SELECT %s, r->>0, (r->>1)::int, r->>2, r->>3, r->4, r->5, r->6, (r->>7)::timestamptz, %s, r->>8, (r->>9)::bool
    FROM jsonb_array_elements(%s::jsonb) AS r
    ON CONFLICT (project_id, external_id) DO NOTHING RETURNING external_id, id
), s AS (
    INSERT INTO feedback_step (trajectory_id, index, role, content, tool_calls, token_ids, logprobs, routing,
                               reward, extra)
    SELECT t.id, (x->>1)::int, x->>2, x->>3, NULLIF(x->4, 'null'), NULLIF(x->5, 'null'), NULLIF(x->6, 'null'),
           NULLIF(x->7, 'null'), (x->>8)::float8, x->9
    FROM jsonb_array_elements(%s::jsonb) WITH ORDINALITY AS e(x, n) JOIN t ON t.external_id = x->>0
    ORDER BY e.n
), l AS (
    -- feedback stored before its trajectory (an earlier request's): linked now, looked up per
    -- trajectory of the batch (OFFSET 0 keeps the lateral a nested loop whatever the statistics)
    UPDATE feedback_feedbackevent fe SET trajectory_id = o.trajectory_id
    FROM (SELECT f.id, t.id AS trajectory_id FROM t CROSS JOIN LATERAL (
              SELECT id FROM feedback_feedbackevent
              WHERE project_id = (SELECT %s::bigint) AND trajectory_id IS NULL
                    AND trajectory_external_id = t.external_id
              OFFSET 0) f) o
    WHERE fe.id = o.id
)
SELECT external_id, id FROM t
"""


def _insert_trajectories(project: Project, trajectories: list[TrajectoryRecord], now: datetime) -> dict[str, int]:
    if not trajectories:
        return {}
    rows = [[t.external_id, t.policy_version, t.source, t.task, t.tags, t.prompt, t.extra, t.occurred_at.isoformat(),
             t.user_hash, t.consent == "no_train"] for t in trajectories]
    steps = [[t.external_id, s.index, s.role, s.content, s.tool_calls, s.token_ids, s.logprobs, s.routing, s.reward,
              s.extra] for t in trajectories for s in t.steps]
    with connection.cursor() as cur:
        cur.execute(_INSERT_TRAJECTORIES, [project.id, now, _json_rows(rows), _json_rows(steps), project.id])
        return dict(cur.fetchall())


# Each event's trajectory is found by its own probe of the unique index, whatever the planner's
# statistics say: a batch's work is bounded by the batch, not by the project. A lateral with LIMIT
# stays a nested loop (as a join, a planner that had not yet counted a new project's rows hashed
# all of them for every batch: 58 ms against 20 ms a 500-event batch at 200,000 trajectories), and
# the project id is an InitPlan, `(SELECT %s::bigint)`, not a literal: a literal the statistics do
# not know is estimated at one row, every index that leads with project_id then ties with the
# unique one, and the planner took one with a filter that read the project per probe
# (feedback.selectors.in_project; tests/feedback/test_ingest_scaling.py).
_INSERT_FEEDBACK = """
INSERT INTO feedback_feedbackevent (project_id, event_id, trajectory_external_id, trajectory_id, signal, value, step,
                                    user_hash, aspect_labels, extra, occurred_at, received_at, no_train)
SELECT %s, r->>0, r->>1, t.id, r->>2, (r->>3)::float8, (r->>4)::int, r->>5, NULLIF(r->6, 'null'), r->7,
       (r->>8)::timestamptz, %s, (r->>9)::bool
FROM jsonb_array_elements(%s::jsonb) AS r
LEFT JOIN LATERAL (SELECT id FROM feedback_trajectory WHERE project_id = (SELECT %s::bigint) AND external_id = r->>1
                   LIMIT 1) t ON true
ON CONFLICT (project_id, event_id) DO NOTHING RETURNING event_id
"""


def _insert_feedback(project: Project, rows: list[FeedbackRecord], now: datetime) -> set[str]:
    if not rows:
        return set()
    data = [[f.event_id, f.trajectory_external_id, f.signal, f.value, f.step, f.user_hash, f.aspect_labels, f.extra,
             f.occurred_at.isoformat(), f.consent == "no_train"] for f in rows]
    with connection.cursor() as cur:
        cur.execute(_INSERT_FEEDBACK, [project.id, now, _json_rows(data), project.id])
        return {row[0] for row in cur.fetchall()}


def feedback_link_orphans(project: Project) -> int:
    """Safety net run by beat: links any feedback whose trajectory has landed since. Its work is
    the project's orphans (fb_orphans), each probing the trajectories' unique index, as ingest's
    look-ups do: never all of the project's trajectories."""
    with connection.cursor() as cur:
        cur.execute(
            "UPDATE feedback_feedbackevent fe SET trajectory_id = m.trajectory_id FROM ("
            " SELECT o.id, t.id AS trajectory_id FROM (SELECT id, trajectory_external_id FROM feedback_feedbackevent"
            "  WHERE project_id = (SELECT %s::bigint) AND trajectory_id IS NULL OFFSET 0) o"
            " CROSS JOIN LATERAL (SELECT id FROM feedback_trajectory WHERE project_id = (SELECT %s::bigint)"
            "  AND external_id = o.trajectory_external_id LIMIT 1) t) m "
            "WHERE fe.id = m.id",
            [project.id, project.id],
        )
        return cur.rowcount


def webhook_deliveries_prune(now: datetime | None = None, batch: int = 1000, max_batches: int = 100) -> int:
    """Forgets the webhook-ids delivered before DELIVERY_KEEP, oldest first, `batch` rows a
    statement and at most `max_batches` a call (beat's next tick goes on): the table and its
    unique index, which every signed batch inserts into at a random place, stay the size of a
    week of deliveries instead of growing with every batch ever sent."""
    cutoff = (now or timezone.now()) - DELIVERY_KEEP
    gone = 0
    with connection.cursor() as cur:
        cur.execute("SELECT received_at FROM feedback_webhookdelivery ORDER BY id LIMIT 1")
        oldest = cur.fetchone()
        if oldest is None or oldest[0] >= cutoff:  # nothing that old: no scan of the week's rows
            return 0
        for _ in range(max_batches):
            cur.execute("DELETE FROM feedback_webhookdelivery WHERE id IN (SELECT id FROM feedback_webhookdelivery "
                        "WHERE received_at < %s ORDER BY id LIMIT %s)", [cutoff, batch])
            gone += cur.rowcount
            if cur.rowcount < batch:
                break
    return gone


def _settle(results: list[EventResult], new_ids: dict[str, int], new_feedback: set[str],
            refused: dict[tuple[str, str], str]) -> dict[str, int]:
    counts = {"accepted": 0, "duplicate": 0, "rejected": 0, "trajectories": 0, "feedback": 0}
    for result in results:
        if result.status == "pending":
            is_trajectory = result.type == "trajectory"
            if (result.type, result.id) in refused:
                result.status, result.reason = "rejected", refused[(result.type, result.id)]
            elif result.id in (new_ids if is_trajectory else new_feedback):
                result.status = "accepted"
                counts["trajectories" if is_trajectory else "feedback"] += 1
            else:
                result.status, result.reason = "duplicate", "an event with this id was stored before"
        counts[result.status] += 1
    return counts


# --- quarantine ---------------------------------------------------------------------------------

_QUARANTINE_UPSERT = """
INSERT INTO feedback_quarantine (project_id, kind, item, trajectory_id, error, detail, failures, first_at, last_at)
VALUES (%s, %s, %s, %s, %s, %s::jsonb, 1, now(), now())
ON CONFLICT (project_id, kind, item) DO UPDATE
    SET error = EXCLUDED.error, detail = EXCLUDED.detail, failures = feedback_quarantine.failures + 1,
        last_at = now()
"""


def quarantine_record(project_id: int, kind: str, item: str, error: str, *, trajectory_id: int | None = None,
                      detail: dict[str, Any] | None = None) -> None:
    """Sets a bad item aside with its error so its queue goes on (rewards, training, rollups, the
    serving recorder); shown under "last errors" on the project's overview. One row per item: a
    repeat counts up. Call it outside the transaction that failed (that one is rolled back)."""
    log.warning("quarantined %s item %r of project %s: %s", kind, item, project_id, error[:500])
    text = json.dumps(detail or {}, default=str, ensure_ascii=True)
    with connection.cursor() as cur:
        cur.execute(_QUARANTINE_UPSERT, [project_id, kind, item[:255], trajectory_id,
                                         error.replace("\x00", "")[:10_000], text])
