"""Writes of rewards: the versioned reward spec and scoring trajectories with it (feedback map +
verifiable checks + judge rubric → Reward and RubricScore rows).

    .venv/bin/python -m pytest tests/training/test_services.py tests/training/rewards/test_reward_spec.py -q
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import DataError, IntegrityError, transaction
from django.db.models import Prefetch
from django.utils import timezone

from core.errors import BadRequest
from core.notify import project_event
from feedback.models import FeedbackEvent, Project, Step, Trajectory
from feedback.services import quarantine_record
from training.models import AgentTask, Reward, RewardDue, RewardSpec, RubricScore
from training.rewards import selectors
from training.rewards.checks import CheckConfigError, CheckResult, SandboxUnavailable, check_from_config
from training.rewards.judges import AspectScore, Judge, make_judge
from training.rewards.reward_model import Labelled, UsersModel, expected_signal_reward, fit_reward_model
from training.rewards.spec import DEFAULT_SIGNAL_REWARDS, RewardSpecData, compute_reward

if TYPE_CHECKING:
    from training.rewards.agents import AgentReward

DEFAULT_JUDGE: dict[str, Any] = {"kind": "rule", "aspects": ["style", "concision"]}


DEFAULT_ASPECTS: list[dict[str, Any]] = [
    {"name": "style", "weight": 0.1, "description": "short lines, PEP 8 names"},
    {"name": "concision", "weight": 0.1, "description": "no padding, no repeated lines"},
]


SPEC_FIELDS = ("signal_rewards", "checks", "aspects", "judge", "settle_seconds")


def reward_spec_default(project: Project) -> RewardSpec:
    """The project's first spec (Cursor Tab's map, rule-judged style and concision), made once."""
    spec, _ = RewardSpec.objects.get_or_create(
        project=project, version=1,
        defaults={"signal_rewards": dict(DEFAULT_SIGNAL_REWARDS), "checks": [], "aspects": DEFAULT_ASPECTS,
                  "judge": DEFAULT_JUDGE, "settle_seconds": 60},
    )
    return spec


def reward_spec_current(project: Project) -> RewardSpec:
    spec = RewardSpec.objects.filter(project=project).order_by("-version").first()
    return spec if spec is not None else reward_spec_default(project)


def _spec_validate(fields: dict[str, Any]) -> None:
    try:
        RewardSpecData.from_json(fields["signal_rewards"], fields["checks"], fields["aspects"])
        for check in fields["checks"]:
            check_from_config(check)
        if fields["judge"]:
            _judge_for(fields["judge"], fields["aspects"])
    except (ValueError, TypeError, KeyError) as exc:
        raise BadRequest(f"invalid reward spec: {exc}", "Fix the named field; see training/rewards/.") from exc
    if int(fields["settle_seconds"]) < 0:
        raise BadRequest("settle_seconds must be >= 0", "Give the settle window in seconds.")


def reward_spec_update(project: Project, **changes: Any) -> RewardSpec:
    """Edit the current spec; once a Reward used it, the edit becomes a new version instead."""
    unknown = sorted(set(changes) - set(SPEC_FIELDS))
    if unknown:
        raise BadRequest(f"unknown reward spec fields {unknown}", f"Use any of {list(SPEC_FIELDS)}.")
    reward_spec_default(project)
    with transaction.atomic():
        current = RewardSpec.objects.select_for_update().filter(project=project).order_by("-version").first()
        fields = {**{f: getattr(current, f) for f in SPEC_FIELDS}, **changes}
        _spec_validate(fields)
        if not Reward.objects.filter(spec=current).exists():
            # rescored in full, from the first trajectory
            RewardSpec.objects.filter(pk=current.pk).update(**fields, full_pass_at=None, full_pass_cursor=None)
            current.refresh_from_db()
            return current
        return RewardSpec.objects.create(project=project, version=current.version + 1, **fields)


def _judge_for(config: dict[str, Any], aspects: Sequence[dict[str, Any]]) -> Judge:
    params = dict(config)
    if params.get("kind") == "model" and "aspects" not in params:
        params["aspects"] = {a["name"]: a.get("description", a["name"]) for a in aspects}
    return make_judge(params)


def _texts(trajectory: Trajectory) -> tuple[str, str]:
    """(prompt text, completion text): the last prompt message and the assistant steps."""
    messages = trajectory.prompt or []
    prompt = str(messages[-1].get("content", "")) if messages else ""
    completion = "".join(s.content for s in trajectory.steps.all() if s.role == "assistant")
    return prompt, completion


def _check_context(trajectory: Trajectory) -> dict[str, Any]:
    # Check inputs (code prefix, a test snippet) ride along in the trajectory's extra fields.
    context = trajectory.extra.get("check_context") if isinstance(trajectory.extra, dict) else None
    return dict(context) if isinstance(context, dict) else {}


def _check_inputs(trajectory: Trajectory) -> tuple[str, dict[str, Any]]:
    """(completion, check context): the context carries the prompt (a check may read it as the
    code prefix) under the inputs the product sent."""
    prompt, completion = _texts(trajectory)
    return completion, {"prompt": prompt, **_check_context(trajectory)}


def checks_run_many(checks: Sequence[dict[str, Any]], items: Sequence[tuple[str, dict[str, Any]]]
                    ) -> list[dict[str, CheckResult]]:
    """Every check over every (completion, context), each check batched (fewer sandboxes)."""
    out: list[dict[str, CheckResult]] = [{} for _ in items]
    for check in checks:
        for row, result in zip(out, check_from_config(check).run_many(list(items)), strict=True):
            row[check["name"]] = result
    return out


def checks_try_many(checks: Sequence[dict[str, Any]], items: Sequence[tuple[str, dict[str, Any]]]
                    ) -> tuple[list[dict[str, CheckResult]], dict[int, str]]:
    """`checks_run_many`, except that an item a check raises on costs only that item: returns the
    results and {item index: error}. A batch that raises is rerun item by item to find the culprit.
    A missing sandbox still raises: that is the deployment's fault, not any item's."""
    out: list[dict[str, CheckResult]] = [{} for _ in items]
    errors: dict[int, str] = {}
    for check in checks:
        runner = check_from_config(check)
        try:
            results: list[CheckResult | Exception] = list(runner.run_many(list(items)))
        except SandboxUnavailable:
            raise
        except Exception:  # noqa: BLE001 - one item's inputs broke the batch; find which
            results = [_check_one(runner, item) for item in items]
        for i, result in enumerate(results):
            if isinstance(result, Exception):
                errors.setdefault(i, f"check {check['name']!r} raised {type(result).__name__}: {result}")
            else:
                out[i][check["name"]] = result
    return out, errors


def _check_one(runner: Any, item: tuple[str, dict[str, Any]]) -> CheckResult | Exception:
    try:
        return runner.run_many([item])[0]
    except SandboxUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - returned, and the item is quarantined by the caller
        return exc


@dataclass(frozen=True)
class _Scored:
    trajectory: Trajectory
    total: float
    components: dict[str, float]
    judge_id: str
    aspects: dict[str, AspectScore]


def _score_one(trajectory: Trajectory, data: RewardSpecData, judge: Judge | None,
               checks: dict[str, CheckResult]) -> _Scored:
    prompt, completion = _texts(trajectory)
    aspect_scores: dict[str, AspectScore] = {}
    judge_id = ""
    if judge is not None:
        result = judge.judge(prompt, completion, _check_context(trajectory))
        judge_id, aspect_scores = result.judge_id, result.scores
    signals = [{"signal": e.signal, "value": e.value} for e in trajectory.feedback_events.all()]
    total, components = compute_reward(data, signals, checks, aspect_scores)
    return _Scored(trajectory, total, components, judge_id, aspect_scores)


def _rewards_write(spec: RewardSpec, scored: Sequence[_Scored]) -> list[Reward]:
    """The pass's Reward and RubricScore rows, each table in one upsert (a recomputed reward's
    computed_at moves on; a rescored aspect keeps its created_at)."""
    RubricScore.objects.bulk_create(
        [RubricScore(trajectory=s.trajectory, aspect=aspect, judge=s.judge_id, score=a.score,
                     rationale="" if a.failed else a.rationale, error=a.rationale if a.failed else "")
         for s in scored for aspect, a in s.aspects.items()],
        update_conflicts=True, unique_fields=["trajectory", "aspect", "judge"],
        update_fields=["score", "rationale", "error"],
    )
    return Reward.objects.bulk_create(
        [Reward(trajectory=s.trajectory, spec=spec, total=s.total, components=s.components) for s in scored],
        update_conflicts=True, unique_fields=["trajectory", "spec"], update_fields=["total", "components", "computed_at"],
    )


def rewards_compute(trajectory_ids: Iterable[int], spec: RewardSpec) -> list[Reward]:
    """Reward (total + components) and RubricScore rows for each trajectory under `spec`.

    A trajectory whose checks, judge or reward raise is quarantined (kind "reward": not offered
    again until its Quarantine row is deleted) and the others are scored.
    A failed judge aspect is stored with score NULL and its error and left out of the total.
    Recomputing replaces the trajectory's Reward for this spec (computed_at moves on).
    The rows are written in one transaction (one commit, not one a trajectory: at 1,000
    trajectories a pass spent most of its time waiting on the disk); when the database refuses
    it (a trajectory erased meanwhile), each trajectory is written alone and a refused one is
    quarantined."""
    data = RewardSpecData.from_json(spec.signal_rewards, spec.checks, spec.aspects)
    judge = _judge_for(spec.judge, spec.aspects) if spec.judge else None
    # Only the columns a reward reads: a step's token ids and log-probs (JSON arrays of every
    # token) are the bulk of its row, and decoding them was most of a pass's time.
    trajectories = Trajectory.objects.filter(pk__in=list(trajectory_ids)).only(
        "project_id", "external_id", "prompt", "extra").prefetch_related(
        Prefetch("steps", queryset=Step.objects.only("trajectory_id", "index", "role", "content").order_by("index")),
        Prefetch("feedback_events", queryset=FeedbackEvent.objects.only(
            "trajectory_id", "signal", "value", "occurred_at").order_by("occurred_at", "id")),
    )
    trajectories = list(trajectories)
    results, failed = checks_try_many(spec.checks, [_check_inputs(t) for t in trajectories])
    scored = []
    for i, (trajectory, checks) in enumerate(zip(trajectories, results, strict=True)):
        try:
            if i in failed:
                raise CheckConfigError(failed[i])
            scored.append(_score_one(trajectory, data, judge, checks))
        except SandboxUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - a poison pill costs its trajectory, never the queue
            _quarantine(trajectory, spec, exc)
    try:
        with transaction.atomic():
            return _rewards_write(spec, scored)
    except (DataError, IntegrityError):
        rewards = []
        for one in scored:
            try:
                with transaction.atomic():
                    rewards += _rewards_write(spec, [one])
            except (DataError, IntegrityError) as exc:
                _quarantine(one.trajectory, spec, exc)
        return rewards


def _quarantine(trajectory: Trajectory, spec: RewardSpec, exc: Exception) -> None:
    error = str(exc) if isinstance(exc, CheckConfigError) else f"{type(exc).__name__}: {exc}"
    quarantine_record(trajectory.project_id, "reward", f"trajectory {trajectory.external_id}", error,
                      trajectory_id=trajectory.pk, detail={"spec": spec.version})


# How often the reward queue also goes over the whole project (the due rows see every write made
# through Flywheel or the ORM; this is the net under rows changed by hand in the database).
FULL_PASS_EVERY = timedelta(hours=24)
# A pass reads due rows until they name this many trajectories per trajectory it may score.
DUE_READ_FACTOR = 4


def rewards_compute_pending(project: Project, limit: int = 1000, now: datetime | None = None) -> int:
    """Scores up to `limit` trajectories whose feedback settled (and those with late feedback);
    returns the count.

    A pass reads the due rows (training.models.RewardDue) whose activity has settled and scores
    what is pending among their trajectories, then deletes them: its cost is the project's new
    work, not its history (at 200,000 trajectories the whole-project query costs about a second
    of database time, every 30 s, with nothing to score: bench/reward_queue.py). A due row names
    every trajectory a statement touched; one whose activity has not settled yet has a later due
    row of its own, read when that settles.

    Beside them, while the spec has no complete full pass (a new or edited spec has everything to
    score) and again every FULL_PASS_EVERY, a pass goes over the next window of the project's
    trajectories (FULL_WINDOW_FACTOR x `limit`, in the order of their ids, from where the last
    pass stopped: `RewardSpec.full_pass_cursor`), so that even that pass's cost is bounded by
    the limit, not by the project: a new spec on 200,000 trajectories is scored 1,000 at a time
    without reading them all each time. Trajectories stored after a full pass started have due
    rows of their own."""
    return _pass(project, limit, now or timezone.now())[0]


def rewards_drain(project: Project, budget_s: float = 20.0, limit: int = 1000) -> int:
    """Passes one after another while the last one found work and `budget_s` lasts (beat's
    task: one pass of `limit` every 30 s would cap a project at limit/30 rewards a second, far
    below what ingest stores); returns the count scored."""
    start, total = time.monotonic(), 0
    while True:
        scored, worked = _pass(project, limit, timezone.now())
        total += scored
        if not worked or time.monotonic() - start >= budget_s:
            return total


FULL_WINDOW_FACTOR = 4


def _pass(project: Project, limit: int, now: datetime) -> tuple[int, bool]:
    """(trajectories scored, whether there was anything to do: scored, due rows consumed or a
    full pass's window gone over)."""
    spec = reward_spec_current(project)
    settled_before = now - timedelta(seconds=spec.settle_seconds)
    rows: list[int] = []
    ids: list[int] = []
    leftover: list[int] = []
    due = selectors.reward_due_rows(project, settled_before, DUE_READ_FACTOR * limit)
    if due:
        rows = [row_id for row_id, _, _ in due]
        among = sorted({t for _, ts, _ in due for t in ts})
        rescore = sorted({t for _, ts, again in due if again for t in ts})
        found = list(selectors.trajectories_reward_pending(project, spec, now, among, rescore)
                     .values_list("pk", flat=True))
        ids, leftover = found[:limit], found[limit:]
    full = spec.full_pass_at is None or spec.full_pass_at <= now - FULL_PASS_EVERY
    cursor, complete = spec.full_pass_cursor, False  # the due rows took the whole limit: it stays
    if full and len(ids) < limit:
        ids, cursor, complete = _full_window(project, spec, now, ids, leftover, limit)
    if ids:
        rewards_compute(ids, spec)
        project_event(project.pk, {"type": "rewards_computed", "spec": spec.version, "count": len(ids)})
    _due_done(project, rows, leftover, settled_before)
    if full:  # where the full pass has reached, unless the spec was edited since (it starts again)
        RewardSpec.objects.filter(pk=spec.pk, full_pass_at=spec.full_pass_at, full_pass_cursor=spec.full_pass_cursor).update(
            full_pass_at=now if complete else spec.full_pass_at, full_pass_cursor=None if complete else cursor)
    return len(ids), bool(ids or rows or (full and not complete))


def _full_window(project: Project, spec: RewardSpec, now: datetime, ids: list[int], leftover: list[int],
                 limit: int) -> tuple[list[int], str | None, bool]:
    """The full pass's next window: `ids` with what is pending in it added up to `limit`, where
    the next window starts (the last trajectory id gone past) and whether this was the last."""
    size = FULL_WINDOW_FACTOR * limit
    window = selectors.trajectory_window(project, spec.full_pass_cursor, size)
    if not window:
        return ids, None, True
    order = {pk: k for k, (pk, _) in enumerate(window)}
    taken = set(ids) | set(leftover)
    pending = sorted((pk for pk in selectors.trajectories_reward_pending(project, spec, now, list(order))
                      .values_list("pk", flat=True) if pk not in taken), key=order.__getitem__)
    room = limit - len(ids)
    if len(pending) > room:  # the window goes on after the last one scored
        pending = pending[:room]
        return ids + pending, window[order[pending[-1]]][1], False
    return ids + pending, window[-1][1], len(window) < size


def _due_done(project: Project, rows: list[int], leftover: list[int], settled_before: datetime) -> None:
    """After a pass scored: its due rows deleted, and what it left for the limit due again first
    (`at` = settled_before)."""
    if not rows and not leftover:
        return
    with transaction.atomic():
        RewardDue.objects.filter(pk__in=rows).delete()
        if leftover:  # found to score: scored next time whatever their reward says then
            RewardDue.objects.create(project=project, trajectory_ids=leftover, at=settled_before, rescore=True)


def suggestions_reward(
    spec: RewardSpec, items: Sequence[tuple[str, str, Sequence[int]] | tuple[str, str, Sequence[int], Sequence[int]]],
    model: UsersModel | None,
) -> list[tuple[float, dict[str, float]]]:
    """Rewards of suggestions no user saw (group rollouts), on the spec's scale: the signal part is
    what the users would give in expectation (`model`'s accept probability through the spec's
    accept/reject values; a suggestion not shown gets `silent`), plus the spec's checks and judged
    aspects like any trajectory. Nothing is stored. items: (prompt, completion, completion ids[,
    prompt ids]): the prompt ids the completion was sampled after, read by a context model."""
    data = RewardSpecData.from_json(spec.signal_rewards, spec.checks, spec.aspects)
    judge = _judge_for(spec.judge, spec.aspects) if spec.judge else None
    checks = checks_run_many(spec.checks, [(item[1], {"prompt": item[0]}) for item in items])
    labelled = [Labelled(item[0], item[1], {k: r.score for k, r in row.items()}, item[2],
                         prompt_ids=item[3] if len(item) > 3 else ())  # type: ignore[misc]
                for item, row in zip(items, checks, strict=True)]
    accept = model.predict(labelled).tolist() if model is not None else [None] * len(items)
    out = []
    for (prompt, completion, *_), row, p in zip(items, checks, accept, strict=True):
        shown = completion.strip() != ""
        aspects = judge.judge(prompt, completion, {}).scores if judge is not None else {}
        _, components = compute_reward(data, ["silent"], row, aspects)
        del components["feedback:silent"]
        if p is not None:
            components["model:expected_signal"] = expected_signal_reward(p, shown, data.signal_rewards)
        out.append((sum(components.values()), components))
    return out


def accept_predicted(
    project: Project, sides: dict[str, Sequence[tuple[str, str, Sequence[int]]]],
) -> dict[str, Any] | None:
    """How often the users would accept each side's suggestions, by the reward model fitted to their
    clicks so far (refitted here on every click, as a run fits it). sides: name -> (prompt,
    completion, completion ids). An empty suggestion is not shown, so it is never accepted.
    Returns {"<side>": mean accept probability, ..., "samples": per side, "reward_model": summary},
    or None while the users have not clicked enough to fit one (MIN_LABELS)."""
    spec = reward_spec_current(project)
    model = fit_reward_model(selectors.labelled_suggestions(project, spec), [c["name"] for c in spec.checks])
    if model is None:
        return None
    out: dict[str, Any] = {}
    for side, items in sides.items():
        checks = checks_run_many(spec.checks, [(c, {"prompt": p}) for p, c, _ in items])
        labelled = [Labelled(p, c, {k: r.score for k, r in row.items()}, ids)
                    for (p, c, ids), row in zip(items, checks, strict=True)]
        accept = model.predict(labelled).tolist() if labelled else []
        shown = [p * (c.strip() != "") for p, (_, c, _) in zip(accept, items, strict=True)]
        out[side] = round(sum(shown) / len(shown), 4) if shown else None
        out["samples"] = len(shown)
    out["reward_model"] = model.summary()
    return out


# --------------------------------------------------------------------------------- agent tasks

MAX_AGENT_TASK_CHARS = 100_000
AGENT_TASK_HELP = ("An agent task is a folder of plain files: the code to fix, a tests file of `assert` lines "
                   "(test_task.py unless named) and optionally INSTRUCTION.txt; see docs/agents.md.")


def agent_task_add(project: Project, name: str, files: dict[str, str], *, instruction: str = "",
                   tests: str = "test_task.py") -> AgentTask:
    """Registers (or replaces) the project's agent task `name`: `files` by plain name, the asserts
    in `files[tests]`. The instruction defaults to "Make the tests in TESTS pass."."""
    if not name or len(name) > 64 or not all(c.isalnum() or c in "-_" for c in name):
        raise BadRequest(f"agent task name {name!r} is not a slug", "Use letters, digits, - and _ (at most 64).")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise BadRequest("an agent task's files must map plain file names to text", AGENT_TASK_HELP)
    bad = sorted(k for k in files if not k or "/" in k or k.startswith("."))
    if bad:
        raise BadRequest(f"agent task {name!r}: file names {bad} are not plain names", AGENT_TASK_HELP)
    asserts = [ln for ln in files.get(tests, "").splitlines() if ln.strip().startswith("assert")]
    if not asserts:
        raise BadRequest(f"agent task {name!r}: no `assert` line in its tests file {tests!r}", AGENT_TASK_HELP)
    if not any(k.endswith(".py") and k != tests for k in files):
        raise BadRequest(f"agent task {name!r} has no Python file to fix beside {tests!r}", AGENT_TASK_HELP)
    size = sum(len(v) for v in files.values())
    if size > MAX_AGENT_TASK_CHARS:
        raise BadRequest(f"agent task {name!r} is {size} characters; at most {MAX_AGENT_TASK_CHARS}",
                         "Keep a task to the few small files it needs.")
    task, _ = AgentTask.objects.update_or_create(
        project=project, name=name,
        defaults={"files": files, "tests": tests, "instruction": instruction.strip() or f"Make the tests in {tests} pass."},
    )
    project_event(project.pk, {"type": "agent_task_added", "name": name})
    return task


def agent_task_remove(project: Project, name: str) -> bool:
    return bool(AgentTask.objects.filter(project=project, name=name).delete()[0])


def agent_reward_of(spec: RewardSpec, tests_weight: float = 1.0) -> AgentReward:
    """The reward of agent rollouts under the project's spec: `tests_weight` x the tests' pass share
    plus the spec's judge on each of its aspects (aspect weight x score), as live trajectories
    get them (training.rewards.agents.AgentReward)."""
    from training.rewards.agents import AgentReward  # imported here: the rollouts' tools import torch

    judge = _judge_for(spec.judge, spec.aspects) if spec.judge else None
    aspects = tuple((str(a["name"]), float(a.get("weight", 1.0))) for a in spec.aspects)
    return AgentReward(tests_weight=float(tests_weight), judge=judge, aspects=aspects)
