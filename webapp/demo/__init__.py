"""`make demo`: the whole loop on one machine, in the foreground, until Ctrl-C.

    .venv/bin/python -m webapp.demo [--port 8000] [--no-simulate]

Starts (or reuses) the embedded PostgreSQL and Redis, migrates, creates the demo project and an
admin login (kept in var/demo.json), then runs the web server (uvicorn, ASGI), a Celery worker
and beat, and every extra process listed by `demo_processes()` (inference server, simulated
users) once those parts are installed. Prints the dashboard URL and the login.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository (this is webapp/demo/__init__.py)
DEMO_FILE = ROOT / "var" / "demo.json"


def _port(preferred: int) -> int:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


def _environment() -> dict[str, str]:
    # Imported here, like every project import below: `python -m webapp.demo` runs before Django
    # is set up (`_prepare` does it), and models cannot be imported until then.
    from core import devsecrets, embedded
    from core.env import ConfigError

    if embedded.undurable_requested():
        raise ConfigError(f"{embedded.UNDURABLE_SWITCH} turns off PostgreSQL's fsync for the test suite only; "
                          "the demo keeps acknowledged events through a crash: unset it")
    env = dict(os.environ)
    if not env.get("DATABASE_URL"):
        # The demo's processes connect as the application's role; only this process migrates,
        # as the owner (`_prepare`; webapp/db_roles.py), so the owner's URL is not passed on.
        owner_url = embedded.postgres_url()
        env["DATABASE_URL"] = embedded.postgres_app_url()
        os.environ.setdefault("DATABASE_OWNER_URL", owner_url)
    if not env.get("REDIS_URL"):
        env["REDIS_URL"] = embedded.redis_url()
    env["DJANGO_SETTINGS_MODULE"] = "webapp.settings"
    # The demo runs with development secrets (SECRET_KEY, the Fernet key of secrets at rest, the
    # user-id pepper): random values kept in var/dev-secrets.json, never for production.
    if devsecrets.setdefault_environ(env):
        print("Using development secrets from var/dev-secrets.json (set SECRET_KEY, FLYWHEEL_SECRETS_KEY and "
              "FLYWHEEL_USER_PEPPER in production).", flush=True)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The web app tells the serving process to hot-swap on promotion through this endpoint.
    env.setdefault("FLYWHEEL_INFERENCE_URL", f"http://127.0.0.1:{_port(8001)}")
    # ... at its loopback-only listener (serve_policy --internal-port).
    env.setdefault("FLYWHEEL_INFERENCE_INTERNAL_URL", f"http://127.0.0.1:{_port(8101)}")
    env.setdefault("FLYWHEEL_INTERNAL_TOKEN", _internal_token())
    return env


def _internal_token() -> str:
    path = ROOT / "var" / "internal-token"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(24))
        path.chmod(0o600)
    return path.read_text().strip()


def _prepare(env: dict[str, str]) -> dict:
    os.environ.update(env)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    state = _demo_state()
    # The base policy: pretrained once on the stdlib sources (a fixed number of optimiser steps,
    # so every machine gets the same base), then reused from var/policies/pretrained/.
    call_command("bootstrap_policy", "--project", state["project"], "--steps",
                 os.environ.get("FLYWHEEL_PRETRAIN_STEPS", "1000"))
    _demo_onboard_once(state["project"])
    return state


DEMO_MIDTRAIN_MINUTES = 3.0  # FLYWHEEL_DEMO_MIDTRAIN_MINUTES; 0 leaves the base as pretrained


def _demo_onboard_once(slug: str) -> None:
    """The README's "point Flywheel at your repository", done once for the demo: the intent users'
    code base registered as a corpus and the base mid-trained on it; the candidate waits for a
    person's approval on the dashboard (or the auto-approver's). The line tastes type the standard
    library the base was pretrained on: nothing to onboard."""
    # after django.setup() (see _environment)
    from feedback.models import Project
    from training.models import Corpus
    from webapp.demo.simulator import INTENT, django_source

    minutes = float(os.environ.get("FLYWHEEL_DEMO_MIDTRAIN_MINUTES", DEMO_MIDTRAIN_MINUTES))
    taste, corpus = demo_population()
    project = Project.objects.get(slug=slug)
    if minutes <= 0 or taste != INTENT or Corpus.objects.filter(project=project).exists():
        return
    print(f"Onboarding the users' code base: mid-training the base on it for {minutes:g} minutes "
          f"(FLYWHEEL_DEMO_MIDTRAIN_MINUTES=0 skips it) ...", flush=True)
    out = demo_onboard(project, corpus or django_source(), minutes=minutes)
    print(f"v{out['version']}: {out['steps']} steps, held-out loss {out['loss_first']:.2f} -> {out['loss_last']:.2f}; "
          f"the gate {'passed it: approve it on the Registry page' if out['gate_passed'] else 'refused it: ' + ', '.join(out['gate_failed'])}",
          flush=True)


def demo_onboard(project, folder: str | Path, *, minutes: float | None = None, steps: int | None = None,
                 **options) -> dict:
    """The code base's *.py files under `folder` as a corpus, the production policy mid-trained on
    them (in this process), its candidate gated (on a suite of the corpus's held-out lines when the
    project has none); what happened, as a dict. The files are copied out
    first: a code base inside a git-ignored folder (a virtualenv's site-packages) would otherwise
    hold no file, as a corpus leaves ignored files out (as it should in a user's repository)."""
    # after django.setup() (see _environment)
    from training.corpora.services import corpus_add_paths, eval_suite_from_corpus
    from training.gate.services import gate_run
    from training.models import EvalSuite
    from training.runs.services import midtrain_start, train_policy

    root, copy = Path(folder), Path(tempfile.mkdtemp(prefix="flywheel-codebase-"))
    try:
        for path in root.rglob("*.py"):
            (copy / path.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, copy / path.relative_to(root))
        corpus = corpus_add_paths(project, [str(copy / "**" / "*.py")], name="the users' code base")
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    if not EvalSuite.objects.filter(project=project).exists():  # the gate needs one: the held-out lines
        eval_suite_from_corpus(corpus)
    _demo_schedule(project)  # from now on the runs replay the corpus too
    started = time.monotonic()
    run, _ = midtrain_start(project, corpus=corpus.pk, minutes=minutes, steps=steps, enqueue=False, **options)
    run = train_policy(run.pk)
    took = time.monotonic() - started
    if run.state != "succeeded":
        raise RuntimeError(f"mid-training run {run.pk} {run.state}: {run.error}")
    report = gate_run(run.candidate.id, actor="system:demo")
    return {"version": run.candidate.number, "seconds": round(took, 1), "steps": run.result["steps"],
            "loss_first": run.result["midtrain_loss_first"], "loss_last": run.result["midtrain_loss_last"],
            "tokens_per_s": run.result["midtrain_tokens_per_s"], "corpus_files": corpus.files_count,
            "gate_passed": report.passed, "gate_failed": [c["name"] for c in report.checks if not c.get("passed")]}


def auto_approval() -> bool:
    """`make demo AUTO_APPROVE=1`: what passes the gate is approved by a service account."""
    return os.environ.get("AUTO_APPROVE", "").strip().lower() in ("1", "true", "yes", "on")


def _bound_key(raw: str | None) -> bool:
    """Whether `raw` is a live key bound to a person or service account (a var/demo.json from
    before keys were bound holds one that may decide nothing: it is replaced)."""
    # after django.setup() (see _environment)
    from feedback.models import ApiKey

    return bool(raw) and ApiKey.objects.filter(key_hash=ApiKey.hash_key(raw), owner__isnull=False,
                                               revoked_at__isnull=True).exists()


def _demo_state() -> dict:
    from django.contrib.auth import get_user_model

    # after django.setup() (see _environment)
    from feedback.models import Project
    from feedback.services import project_create

    state = json.loads(DEMO_FILE.read_text()) if DEMO_FILE.exists() else {}
    if not Project.objects.filter(slug="demo").exists():
        creds = project_create("Demo coding assistant", "demo")
        state.update(project=creds.project.slug, api_key=creds.api_key, webhook_secret=creds.webhook_secret)
    if len(state.get("serve_keys", [])) < DEMO_USERS:  # the simulated users ask the serving process with them
        state["serve_keys"] = simulated_user_keys(Project.objects.get(slug="demo"))
    if "webhook_secret" not in state:  # var/demo.json was lost: issue a fresh secret
        # after django.setup() (see _environment)
        from feedback.services import webhook_secret_rotate

        state.update(project="demo", webhook_secret=webhook_secret_rotate(Project.objects.get(slug="demo")).secret)
    # after django.setup() (see _environment)
    from training.promotion.services import membership_grant

    demo = Project.objects.get(slug="demo")
    users = get_user_model()
    if not users.objects.filter(username="admin").exists():
        state["admin_password"] = secrets.token_urlsafe(12)
        users.objects.create_superuser("admin", "admin@localhost", state["admin_password"])
    # The person who signs in: an admin of the demo project (sees it, approves, manages members).
    membership_grant(demo, users.objects.get(username="admin"), "admin", "system:demo", "the demo's operator")
    if auto_approval() and not _bound_key(state.get("approver_key")):
        # A service account approves what passes the gate, through the same audited service as a
        # person: an approver of the project, acting through a key bound to it; the audit log
        # names it ("service:auto-approver via api_key:demo:auto-approver"). The runs are started
        # by another one (service:scheduler), so the two-person rule lets it approve them.
        # after django.setup() (see _environment)
        from feedback.services import api_key_create, service_account_get

        approver = service_account_get("auto-approver")
        membership_grant(demo, approver, "approver", "system:demo", "make demo AUTO_APPROVE=1")
        state["approver_key"] = api_key_create(demo, ["admin", "read"], "auto-approver", owner=approver)
    _demo_loop_config(Project.objects.get(slug="demo"))
    DEMO_FILE.parent.mkdir(parents=True, exist_ok=True)
    DEMO_FILE.write_text(json.dumps(state, indent=2))
    DEMO_FILE.chmod(0o600)
    return state


# The demo's learning settings: the "demo" preset of training/runs/settings.py (PRESETS), measured
# with bench/learning_curve.py (docs/learning.md, "The demo's recipe"). The train check runs
# every 20 s, so a run starts as soon as the last one ended and data came.
DEMO_TRAIN_CHECK_EVERY_S = 20
DEMO_REPLAY_SHARE = 0.5  # of a run's rollout prompts cut from the onboarded code base (docs/learning.md)
DEMO_ONBOARDED_LR = 5e-4  # RL on a policy mid-trained on the users' code (docs/learning.md)
# The gate's drift bounds (KL budget, length ratio, median floor, log-prob tolerance) are not set
# here: they are derived from the project's own base at the gate's first run (training/gate/
# defaults.py), as for any new project. docs/learning.md keeps the hand-opened bounds this demo
# once had and why they were dropped.
# The demo's reward spec: a tab completion is code, so "prefix + completion compiles" is a
# verifiable check next to the users' clicks and the judged aspects.
DEMO_CHECKS = [{"name": "python_compiles", "weight": 0.25, "prompt_is_prefix": True}]
# Silence costs what a rejection costs (the user waited and got nothing). With the default map
# (silent 0 > reject -0.25) a suggestion the users accept with p < 0.25 is worth less than none, and
# a weak policy learns to go quiet: measured, candidates whose suggestions shrank to half their
# length, mostly empty (the gate's concision aspect and length drift refused all six).
DEMO_SIGNAL_REWARDS = {"silent": -0.25}
# Held-out suite: enough prompts and samples that a real change shows in the gate's paired
# interval (12 prompts x 4 samples could not tell one apart from noise).
DEMO_SUITE_PROMPTS = 160
DEMO_SUITE_SAMPLES = 4
DEMO_SUITE_SEED = 7  # the suite's draw from the held-out files (the learning bench draws with 11)


def demo_population() -> tuple[str, str | None]:
    """The simulated users' taste and code base, as `simulate_users` reads them (environment)."""
    # after django.setup() (see _environment)
    from webapp.demo.simulator import INTENT

    return os.environ.get("FLYWHEEL_DEMO_TASTE") or INTENT, os.environ.get("FLYWHEEL_DEMO_CORPUS") or None


def _demo_suite_prompts(taste: str | None = None, corpus: str | None = None) -> list[dict]:
    """The gate's suite is made of the users' own kind of request, on files they never send:
    for the intent population (the default), lines of the held-out files of their code base in
    their file's context, with what was written next (`rest`, scored by `intent_match`); for the
    line tastes, statement starts of held-out stdlib lines, indentation dropped. Every prompt
    carries `rest`, so the gate's matched-characters row reads what people were about to type."""
    # after django.setup() (see _environment)
    from webapp.demo.simulator import INTENT, code_base, django_source, held_out_prompts, stdlib_source

    env_taste, env_corpus = demo_population()
    taste, corpus = taste or env_taste, corpus or env_corpus
    if taste == INTENT:
        code = code_base(corpus or django_source())
        requests = held_out_prompts(code, INTENT, DEMO_SUITE_PROMPTS, seed=DEMO_SUITE_SEED)
        return [{"id": f"intent-{i}", "prompt": r.prompt, "context": {"rest": r.intended}}
                for i, r in enumerate(requests)]
    lines = _line_taste_lines(corpus or stdlib_source())
    return [{"id": f"stdlib-{i}", "prompt": line[:20],
             "context": {"prefix": line[:20], **({"rest": line[20:]} if line[20:] else {})}}
            for i, line in enumerate(lines)]


def _line_taste_lines(corpus: str | Path) -> list[str]:
    """Statement starts for the line tastes: the tail of the standard library's lines (which the
    users never see), or the held-out files of another code base."""
    # after django.setup() (see _environment)
    from training.pretrain import sample_lines, stdlib_corpus
    from webapp.demo.simulator import code_base, stdlib_source

    if Path(corpus) == Path(stdlib_source()):
        lines = [line.strip() for line in stdlib_corpus()[-20_000:]]
    else:
        lines = [line.strip() for f in code_base(corpus).held_out_files() for line in f.lines]
    return sample_lines([line for line in lines if len(line) >= 12], DEMO_SUITE_PROMPTS, seed=DEMO_SUITE_SEED)


def _demo_suite_checks(taste: str) -> list[dict]:
    """The intent suite is scored by what the user kept; the line tastes' by compiling (their
    taste), next to which the gate's matched-characters row guards what people type."""
    # after django.setup() (see _environment)
    from webapp.demo.simulator import INTENT

    return [{"name": "intent_match" if taste == INTENT else "python_compiles", "weight": 1.0}]


def _demo_loop_config(project, taste: str | None = None, corpus: str | None = None) -> None:
    """The demo's held-out suite, reward spec and beat schedule (idempotent); `taste` and
    `corpus`: the simulated users' (default: the environment `simulate_users` reads)."""
    # after django.setup() (see _environment)
    from training.models import EvalSuite
    from training.promotion.selectors import gate_policy_active
    from training.promotion.services import gate_policy_update
    from training.rewards.services import reward_spec_current, reward_spec_update

    taste = taste or demo_population()[0]
    prompts, checks = _demo_suite_prompts(taste, corpus), _demo_suite_checks(taste)
    current = EvalSuite.objects.filter(project=project, name="default").order_by("-version").first()
    if (current is None or current.prompts != prompts or current.checks != checks
            or current.n_samples != DEMO_SUITE_SAMPLES):
        EvalSuite.objects.create(project=project, version=(current.version + 1) if current else 1, prompts=prompts,
                                 checks=checks,
                                 judge={"kind": "rule_rubric", "aspects": ["style", "concision"]},
                                 aspects=[{"name": "style", "weight": 0.1}, {"name": "concision", "weight": 0.1}],
                                 n_samples=DEMO_SUITE_SAMPLES, max_tokens=16)
    spec = reward_spec_current(project)
    signals = {**spec.signal_rewards, **DEMO_SIGNAL_REWARDS}
    if spec.settle_seconds != 10 or spec.checks != DEMO_CHECKS or spec.signal_rewards != signals:
        reward_spec_update(project, settle_seconds=10, checks=DEMO_CHECKS, signal_rewards=signals)
    _demo_schedule(project)
    gate = gate_policy_active(project)
    # a demo set up before the bounds were derived holds the ones it opened by hand: give them back
    thresholds = {k: v for k, v in gate.thresholds.items() if _HAND_OPENED.get(k) != v}
    if not gate.two_person_rule or thresholds != gate.thresholds:
        # Two people: the scheduler's service account starts the runs, a person (or the
        # auto-approver's service account) approves them.
        gate_policy_update(project, "system:demo", "the two-person rule; drift bounds derived from the base",
                           thresholds=thresholds, two_person_rule=True)


def _demo_schedule(project) -> None:
    """The demo's runs: the "demo" preset, and once the project has a corpus (the users' code base,
    onboarded), `DEMO_REPLAY_SHARE` of each round's rollout prompts cut from its training lines,
    rewarded by what was actually written next (verifiable, where the users' side has only the
    reward model's guess). Idempotent."""
    # after django.setup() (see _environment)
    from dataclasses import replace

    from training.models import Corpus
    from training.runs.settings import PRESETS
    from training.schedule import training_schedule_install

    schedule = PRESETS["demo"]
    if Corpus.objects.filter(project=project).exists():
        schedule = replace(schedule, run=replace(schedule.run, replay={"share": DEMO_REPLAY_SHARE},
                                                 rl=replace(schedule.run.rl, lr=DEMO_ONBOARDED_LR)))
    training_schedule_install([project], schedule, train_check_every_s=DEMO_TRAIN_CHECK_EVERY_S)


_HAND_OPENED = {"kl_budget": 4.0, "length_ratio_max": 2.0, "min_median_chars": 6}  # the demo's bounds until 2026-12


# Simulated users, each asking with a key of its own: serving limits each key's rate (600
# completions a minute by default, FLYWHEEL_SERVE_RATE_PER_KEY), and six users pausing 0.25 s
# between requests ask ~1,000 a minute; on one shared key 40% were answered 429.
DEMO_USERS = 6


def simulated_user_keys(project: Any, users: int = DEMO_USERS) -> list[str]:
    """A `serve` key per simulated user (what the 429's fix says to a product: a key per client)."""
    from feedback.services import api_key_create

    return [api_key_create(project, ["serve"], f"simulated-user-{i + 1}") for i in range(users)]


def demo_processes(port: int, state: dict, simulate: bool) -> list[tuple[str, list[str]]]:
    py = sys.executable
    procs = [
        ("web", [py, "-m", "uvicorn", "webapp.asgi:application", "--host", "127.0.0.1", "--port", str(port),
                 "--log-level", "warning"]),
        ("worker", [py, "-m", "celery", "-A", "webapp", "worker", "-l", "warning", "--concurrency", "2",
                    "-Q", "celery,ingest,rewards,train,rollouts,gate"]),
        ("beat", [py, "-m", "celery", "-A", "webapp", "beat", "-l", "warning",
                  "-s", str(ROOT / "var" / "celerybeat-schedule")]),
    ]
    return procs + _loop_processes(port, state, simulate)


def _loop_processes(port: int, state: dict, simulate: bool) -> list[tuple[str, list[str]]]:
    """The inference server and the simulated users (their webhook secret and serve key come by
    environment)."""
    py, manage = sys.executable, str(ROOT / "manage.py")
    serving = os.environ["FLYWHEEL_INFERENCE_URL"]
    internal = os.environ.get("FLYWHEEL_INFERENCE_INTERNAL_URL") or f"http://127.0.0.1:{int(serving.rsplit(':', 1)[1]) + 1}"
    procs = [("inference", [py, manage, "serve_policy", "--project", state["project"],
                            "--port", serving.rsplit(":", 1)[1], "--internal-port", internal.rsplit(":", 1)[1]])]
    if simulate:
        users = [py, manage, "simulate_users", "--project", state["project"],
                 "--web", f"http://127.0.0.1:{port}", "--serving", serving, "--users", str(DEMO_USERS),
                 "--pause", "0.25"]
        if auto_approval():
            users.append("--approve")
        procs.append(("users", users))
    return procs


def main() -> int:
    parser = argparse.ArgumentParser(description="Run Flywheel's whole loop on this machine.")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--no-simulate", action="store_true", help="do not start simulated users")
    args = parser.parse_args()
    env = _environment()
    state = _prepare(env)
    env["FLYWHEEL_DEMO_SECRET"] = state["webhook_secret"]
    env["FLYWHEEL_SERVE_KEY"] = ",".join(state["serve_keys"])
    if state.get("approver_key"):
        env["FLYWHEEL_APPROVER_KEY"] = state["approver_key"]
    port = _port(args.port)
    logs = ROOT / "var" / "log"
    logs.mkdir(parents=True, exist_ok=True)
    running: list[tuple[str, subprocess.Popen]] = []
    for name, cmd in demo_processes(port, state, not args.no_simulate):
        log = open(logs / f"{name}.log", "ab")
        running.append((name, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)))
    _announce(port, state, [n for n, _ in running], logs)
    return _supervise(running)


def _announce(port: int, state: dict, names: list[str], logs: Path) -> None:
    print(f"""
Flywheel is running: {', '.join(names)} (logs in {logs}/)

  Dashboard   http://127.0.0.1:{port}/
  Login       admin / {state.get('admin_password', '(as set before; see var/demo.json)')}
  Admin       http://127.0.0.1:{port}/admin/
  API docs    http://127.0.0.1:{port}/api/docs/

  Send feedback:  project={state.get('project')}  webhook secret and API key in var/demo.json

Ctrl-C stops everything (PostgreSQL and Redis keep running: make services-down).
""", flush=True)


def _supervise(running: list[tuple[str, subprocess.Popen]]) -> int:
    stop = False

    def on_signal(signum, frame) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    while not stop:
        for name, proc in running:
            if proc.poll() is not None:
                print(f"{name} exited with {proc.returncode}; see var/log/{name}.log", file=sys.stderr)
                stop, code = True, 1
        time.sleep(0.5)
    for _, proc in running:
        proc.terminate()
    for _, proc in running:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    return code

