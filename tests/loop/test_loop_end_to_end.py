"""The whole loop, end to end, on the real processes `make demo` runs: the web server (ASGI), a
Celery worker and beat, the serving process (vLLM engine), on the test database and Redis.

A small population of simulated users asks the serving endpoint for completions and sends its
clicks through the signed webhook → rewards → a training run (group rollouts scored by the
users' reward model) → the gate → approval through the versions API by a service account → the
serving process hot-swaps → the next completions name the new version. Then: lineage intact,
and the new version beats the old on held-out prompts the users never sent (one-sided test).

The run is the demo's (PRESETS["demo"]); only beat's cadence is quicker (rewards and the train
check every 5 s instead of 30 s and 20 s), and once the first run has taken its data the users stop
and beat starts no other run: the run, the gate and the held-out comparison have the machine's
cores (the later users and runs only competed with them; what is asserted is the first run's).

    .venv/bin/python -m pytest tests/loop -q
"""

from __future__ import annotations

import math
import os
import subprocess
import threading
import uuid

import httpx
import pytest
from django.conf import settings
from django.core.management import call_command

from feedback.client import FlywheelClient
from feedback.models import Trajectory
from feedback.services import api_key_create, service_account_get
from tests.factories import member
from tests.processes import ROOT, free_port, subprocess_env, wait_http, wait_until
from training.models import AuditLog, PolicyVersion, TrainingRun
from training.pretrain import sample_lines, stdlib_corpus
from training.versions.selectors import policy_production

pytestmark = pytest.mark.django_db(transaction=True)

PRETRAIN_STEPS = "1000"  # the demo's base (cached under var/policies/pretrained/, shared with it)
BEAT_EVERY_S = 5  # rewards and the train check: a run starts within seconds of its data, not a beat period
USERS, SEED, TASTE = 4, 3, "compiles"
DEADLINE_S = 900  # generous: a busy 2-core machine; the loop is measured by bench/learning_curve.py


@pytest.fixture
def loop(creds, tmp_path, monkeypatch):
    """The demo's loop settings on the test project, its base policy, and its processes."""
    from training.runs.settings import PRESETS
    from training.schedule import training_schedule_install
    from webapp.demo import _demo_loop_config, demo_processes

    call_command("bootstrap_policy", "--project", creds.project.slug, "--steps", PRETRAIN_STEPS)
    _demo_loop_config(creds.project, taste=TASTE)
    training_schedule_install([creds.project], PRESETS["demo"], rewards_every_s=BEAT_EVERY_S,
                              train_check_every_s=BEAT_EVERY_S)
    web, serving, internal = free_port(), free_port(), free_port()
    env = subprocess_env(
        FLYWHEEL_INFERENCE_URL=f"http://127.0.0.1:{serving}", FLYWHEEL_INTERNAL_TOKEN=uuid.uuid4().hex,
        FLYWHEEL_INFERENCE_INTERNAL_URL=f"http://127.0.0.1:{internal}",
        FLYWHEEL_CHECKPOINT_DIR=str(settings.FLYWHEEL_CHECKPOINT_DIR),
        # this test's own queues: no other test's worker takes its tasks
        CELERY_KEY_PREFIX=f"loop-{os.getpid()}-{uuid.uuid4().hex[:6]}:",
    )
    for name in ("FLYWHEEL_INFERENCE_URL", "FLYWHEEL_INFERENCE_INTERNAL_URL"):  # demo_processes reads them
        monkeypatch.setenv(name, env[name])
    procs = []
    logs = ROOT / "var" / "test-loop"
    logs.mkdir(parents=True, exist_ok=True)
    for name, cmd in demo_processes(web, {"project": creds.project.slug}, simulate=False):
        if name == "beat":
            cmd = [*cmd[:-1], str(tmp_path / "celerybeat-schedule")]
        log = open(logs / f"{name}.log", "wb")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        wait_http(f"http://127.0.0.1:{web}/healthz", procs[0], 120)
        wait_http(f"http://127.0.0.1:{serving}/healthz", procs[3], 300)
        yield {"web": f"http://127.0.0.1:{web}", "serving": f"http://127.0.0.1:{serving}"}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def _serve_key(creds) -> dict[str, str]:
    return {"Authorization": f"Bearer {creds.api_key}"}  # the project's default key has scope serve


def _users(loop: dict, creds, stop: threading.Event, users_stop: threading.Event) -> list[threading.Thread]:
    """The population (until `users_stop`) and the auto-approver (until `stop`)."""
    from webapp.demo import simulated_user_keys
    from webapp.demo.simulator import auto_approve, run_users

    lines = stdlib_corpus(max_lines=20_000)
    sender = FlywheelClient(loop["web"], creds.webhook_secret, project=creds.project.slug)
    model = httpx.get(loop["serving"] + "/v1/models", headers=_serve_key(creds)).json()["data"][0]["id"]

    keys = simulated_user_keys(creds.project, USERS)  # a key each, as the demo's users

    def population() -> None:
        seed = SEED
        while not users_stop.is_set():  # bounded rounds, so the stop is seen between them
            run_users(loop["serving"], sender, model, lines, serve_key=keys, requests=40, pause_s=0.1,
                      seed=seed, users=USERS, taste=TASTE)
            seed += 1

    approver = member(service_account_get("auto-approver"), creds.project, "approver")
    key = api_key_create(creds.project, ["admin", "read"], "auto-approver", owner=approver)
    return [threading.Thread(target=population, daemon=True),
            threading.Thread(target=auto_approve, args=(loop["web"], key, stop, 2.0), daemon=True)]


def test_users_feedback_trains_a_version_that_is_gated_approved_served_and_better(loop, creds):
    """Users → rewards → a run → a candidate → the gate. A candidate the gate passes is approved,
    served and better on held-out prompts (below); one it refuses is never served. (Since the gate's
    collapse rows, the `compiles` users' candidates within this budget are often refused: they
    answer a quarter to a third of the suite with one suggestion. Then the refusal is asserted.)"""
    from training.models import GateReport

    v1 = policy_production(creds.project)
    stop, users_stop = threading.Event(), threading.Event()
    threads = _users(loop, creds, stop, users_stop)
    for t in threads:
        t.start()

    def verdict() -> bool:
        if not users_stop.is_set() and TrainingRun.objects.filter(project=creds.project).exists():
            _one_run(creds.project)
            users_stop.set()  # the run's data window closed when it was created
        return (policy_production(creds.project).number != v1.number
                or GateReport.objects.filter(version__project=creds.project, passed=False).exists()
                or TrainingRun.objects.filter(project=creds.project, state="failed").exists())

    try:
        wait_until(verdict, timeout=DEADLINE_S, every=1, what="a promotion, a refusal or a failed run")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {_why_not(creds.project)}") from None
    finally:
        stop.set()
        users_stop.set()
        for t in threads:
            t.join(120)
    new = policy_production(creds.project)
    reports = GateReport.objects.filter(version__project=creds.project).select_related("version")
    assert reports.exists() or new.number != v1.number, _why_not(creds.project)
    if new.number == v1.number:
        refused = reports.filter(passed=False).first()
        assert refused is not None, _why_not(creds.project)
        names = {c["name"] for c in refused.checks}
        assert {"collapse_top_share", "naturalness_logprob", "invented_names"} <= names, names
        assert [c["name"] for c in refused.checks if not c["passed"]], "a refusal names the rows that failed"
        body = httpx.post(loop["serving"] + "/v1/completions", timeout=120, headers=_serve_key(creds),
                          json={"model": creds.project.slug, "prompt": "total = (a", "max_tokens": 8}).json()
        assert body["model"].endswith(f"v{v1.number}"), body["model"]  # the refused candidate is not served
        return

    # approved through the versions API by the service account, audited, after the gate passed it
    approve = AuditLog.objects.get(project=creds.project, action="approve", after__number=new.number)
    assert approve.actor == f"service:auto-approver via api_key:{creds.project.slug}:auto-approver"
    assert new.gate_reports.filter(passed=True).exists()
    # the serving process hot-swapped: the next completion names the new version
    body = httpx.post(loop["serving"] + "/v1/completions", timeout=120, headers=_serve_key(creds),
                      json={"model": creds.project.slug, "prompt": "total = (a", "max_tokens": 8}).json()
    assert body["model"].endswith(f"v{new.number}"), body["model"]
    served = _recorded(creds.project, body["choices"][0]["trajectory_id"])  # the recorder writes in batches
    assert served.policy_version == new.number
    # lineage: each version names its parent and the run that made it; each live trajectory the
    # version that served it (one the project has)
    chain, v = [], new
    while v.parent_id is not None:
        run = TrainingRun.objects.get(candidate=v)
        assert run.base_version_id == v.parent_id and run.state == "succeeded"
        chain.append(v.number)
        v = v.parent
    assert v.number == v1.number and chain
    numbers = set(PolicyVersion.objects.filter(project=creds.project).values_list("number", flat=True))
    assert set(Trajectory.objects.filter(project=creds.project, source="live")
               .values_list("policy_version", flat=True)) <= numbers
    # better for the users on held-out prompts they never sent: one-sided two-proportion z-test
    old_rate, new_rate, n = _held_out_accept(v1), _held_out_accept(new), HELD_OUT
    pooled = (old_rate + new_rate) / 2
    z = (new_rate - old_rate) / math.sqrt(2 * pooled * (1 - pooled) / n)
    assert z > 1.645, f"held-out accept v{v1.number} {old_rate:.3f} -> v{new.number} {new_rate:.3f} (z={z:.2f})"


HELD_OUT = 300


def _one_run(project) -> None:
    """Beat starts no further run for the project (its train check off, as in the admin)."""
    from django_celery_beat.models import PeriodicTask

    entry = PeriodicTask.objects.get(name=f"flywheel train {project.slug}")
    entry.enabled = False
    entry.save()  # save(), not update(): beat rereads its schedule when a saved entry changed it


def _recorded(project, trajectory_id: str, seconds: float = 60) -> Trajectory:
    return wait_until(lambda: Trajectory.objects.filter(project=project, external_id=trajectory_id).first(),
                      timeout=seconds, every=0.5, what=f"the served completion {trajectory_id} recorded")


def _held_out_accept(version: PolicyVersion) -> float:
    from inference.engines import SamplingParams, make_engine
    from training.versions.services import policy_folder
    from webapp.demo import _demo_suite_prompts
    from webapp.demo.simulator import likes

    gate = {p["prompt"] for p in _demo_suite_prompts(TASTE)}
    pool = [line.strip() for line in stdlib_corpus()[-20_000:] if len(line.strip()) >= 12]
    prompts = [line[: 8 + (i * 7) % 17] for i, line in
               enumerate(sample_lines([p for p in pool if p[:20] not in gate], HELD_OUT, seed=11))]
    engine = make_engine("torch", policy_folder(version), version=version.number, seed=1234)
    try:
        out = engine.generate(prompts, n=1, sampling=SamplingParams(max_tokens=16, seed=1234))
    finally:
        engine.close()
    return sum(likes(TASTE, prompts[c.prompt_index], c.text) for c in out) / len(prompts)


def _why_not(project) -> str:
    """What the loop did, for the failure message."""
    from training.models import GateReport

    runs = list(TrainingRun.objects.filter(project=project).values_list("id", "state", "error"))
    gates = [(r.version.number, r.passed, [c["name"] for c in r.checks if not c["passed"]])
             for r in GateReport.objects.filter(version__project=project).select_related("version")]
    return f"no new version in production: runs {runs}; gate reports {gates}"
