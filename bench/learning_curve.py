"""Does the loop make the model better for its users? The demo deployment, headless, for a budget.

    .venv/bin/python bench/learning_curve.py [--minutes 10] [--seed 0] [--taste intent]
        [--corpus DIR] [--pretrain-steps 1000] [--midtrain-minutes 5] [--held-out 200] [--quick] [--json]

Runs the processes `make demo AUTO_APPROVE=1` runs (uvicorn, a Celery worker, beat, the serving
process, simulated users who approve what passes the gate) on a database of its own, then every
minute reads which version is in production and measures each version once on **held-out prompts
the users never sent** (the code base's held-out files, by path hash, minus the gate's suite):
one completion per prompt, the same seeds for every version, judged by the population's taste
without click noise (webapp/demo/simulator.py `population_metrics`).

The population (`--taste`): `intent` (default) types real lines of a code base the base never saw
(django's source, or --corpus) and accepts what it was about to type, partly when only a prefix is
right; `compiles`, `one-statement` and the gameable `short-compiles` judge statement starts of the
standard library (or --corpus).

`--midtrain-minutes M` onboards as the README says a new project does, before the clock starts:
the code base registered as a corpus (its held-out slice is the files the users never send, by the
same path rule), `manage.py midtrain` for M minutes in this process, its candidate gated; the
users' approver approves it when the stack starts if it passed (the report says what the gate did).

Per version: accepted characters per request (the utility), accept rate, silence, the share of
shown suggestions that invent a name (against the code base's names and Python's), the share of
the most common suggestion, and the characters matching what the user was about to type against
the base's. Per minute: the production version's figures and the live accepted characters per
request and accept rate of that minute's feedback. `--quick`: the minute-0 reading only, on an
untrained tiny base (built on 2,000 standard-library lines) served by the torch engine (no vLLM),
20 held-out prompts: the processes start, the serving process answers, a version is measured and
the report is written (proves the bench runs; measures nothing). With --json the last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._django import bench_database_url, create_database  # noqa: E402

MAX_TOKENS = 16
EVAL_SEED = 1234


def main() -> int:
    args = _args()
    db = f"flywheel_bench_learning_{'quick' if args.quick else args.seed}"
    env = _environment(db, args)
    os.environ.update(env)
    create_database(db, fresh=True)
    import django

    django.setup()
    state = _prepare(args)
    held_out = _held_out_prompts(args)  # (requests, the code base's names)
    from webapp.demo import demo_processes

    logs = ROOT / "var" / "bench-learning" / _run_name(args) / "log"
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, cmd in demo_processes(int(env["BENCH_WEB_PORT"]), state, simulate=True):
        if name == "users":  # AUTO_APPROVE=1 in the environment adds --approve
            cmd = [*cmd, "--seed", str(args.seed), "--taste", args.taste, "--corpus", str(_corpus(args))]
        log = open(logs / f"{name}.log", "wb")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ}, stdout=log, stderr=subprocess.STDOUT))
    try:
        _wait_serving(os.environ["FLYWHEEL_INFERENCE_URL"])
        if args.quick:
            print("quick: an untrained base served by the torch engine (vLLM left out), minute 0 only", flush=True)
        rows, evaluations = _observe(args, held_out)
        loop = _loop_record()
        if args.screenshot:
            _screenshot(int(env["BENCH_WEB_PORT"]), args.screenshot)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
    return _report(args, rows, evaluations, loop, state)


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from webapp.demo.simulator import INTENT, POPULATIONS

    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--taste", choices=POPULATIONS, default=INTENT)
    parser.add_argument("--corpus", default=None,
                        help="the users' code base (*.py under DIR); default django's source (intent) or the stdlib")
    parser.add_argument("--pretrain-steps", type=int, default=1000)
    parser.add_argument("--midtrain-minutes", type=float, default=0,
                        help="mid-train on the code base this long before the clock starts (0: none)")
    parser.add_argument("--held-out", type=int, default=200, help="held-out prompts per version")
    parser.add_argument("--quick", action="store_true",
                        help="minute 0 only, an untrained tiny base served by the torch engine, 20 held-out "
                             "prompts: the bench runs end to end")
    parser.add_argument("--screenshot", default=None, metavar="PNG",
                        help="at the end, the dashboard's overview in chromium (Playwright), saved here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.pretrain_steps, args.held_out = 0, 0, 20
    elif args.minutes < 1:
        parser.error("--minutes must be at least 1 (--quick reads minute 0 only)")
    return args


def _run_name(args: argparse.Namespace) -> str:
    """The run's database and var/ folder: a quick run (the suite's) never drops a long run's."""
    return "quick" if args.quick else f"seed-{args.seed}"


def _environment(db: str, args: argparse.Namespace) -> dict[str, str]:
    from core import embedded
    from webapp.demo import _port

    # quick (the suite's run): any free ports, never a long run's fixed ones that its servers may not
    # have bound yet (the quick run would then measure that run's serving process)
    web, serving, internal = ((_free_port(), _free_port(), _free_port()) if args.quick else
                              (_port(18000 + args.seed), _port(18500 + args.seed), _port(18600 + args.seed)))
    var = ROOT / "var" / "bench-learning" / _run_name(args)
    return {
        "DATABASE_URL": bench_database_url(db), "REDIS_URL": os.environ.get("REDIS_URL") or embedded.redis_url(),
        "DJANGO_SETTINGS_MODULE": "webapp.settings", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "FLYWHEEL_INFERENCE_URL": f"http://127.0.0.1:{serving}", "FLYWHEEL_INTERNAL_TOKEN": f"bench-{os.getpid()}",
        "FLYWHEEL_INFERENCE_INTERNAL_URL": f"http://127.0.0.1:{internal}",
        "FLYWHEEL_CHECKPOINT_DIR": str(var / "checkpoints"), "CELERY_KEY_PREFIX": f"bench-learning-{os.getpid()}:",
        "AUTO_APPROVE": "1", "FLYWHEEL_PRETRAIN_STEPS": str(args.pretrain_steps),
        "BENCH_WEB_PORT": str(web),
        # quick: the serving process on the torch engine (vLLM takes minutes to start on a busy machine)
        **({"FLYWHEEL_ENGINE": "torch"} if args.quick else {}),
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(url: str, seconds: float = 900) -> None:
    """The clock starts when the serving process answers (vLLM takes minutes to start on a busy
    machine: a minute counted before it is a minute nobody was served)."""
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < seconds:
        try:
            if httpx.get(url + "/healthz", timeout=5).status_code == 200:
                print(f"serving answered after {time.monotonic() - started:.0f} s", flush=True)
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the serving process at {url} did not answer in {seconds:.0f} s: see its log")


def _prepare(args: argparse.Namespace) -> dict:
    from django.core.management import call_command

    from feedback.models import Project
    from feedback.services import api_key_create, project_create, service_account_get
    from training.promotion.services import membership_grant
    from webapp.demo import _demo_loop_config, simulated_user_keys

    call_command("migrate", verbosity=0)
    creds = project_create("Bench coding assistant", "demo")
    # As `make demo AUTO_APPROVE=1`: an approver service account decides through a key bound to it
    # (a key bound to nobody decides nothing); beat's runs are started by service:scheduler.
    approver = service_account_get("auto-approver")
    membership_grant(creds.project, approver, "approver", "system:bench", "the learning bench's auto-approval")
    state = {"project": "demo", "webhook_secret": creds.webhook_secret,
             "approver_key": api_key_create(creds.project, ["admin", "read"], "auto-approver", owner=approver),
             "serve_keys": simulated_user_keys(creds.project)}
    os.environ["FLYWHEEL_DEMO_SECRET"] = state["webhook_secret"]
    os.environ["FLYWHEEL_SERVE_KEY"] = ",".join(state["serve_keys"])
    os.environ["FLYWHEEL_APPROVER_KEY"] = state["approver_key"]
    _demo_loop_config(Project.objects.get(slug="demo"), taste=args.taste, corpus=str(_corpus(args)))
    source = ["--from", str(_quick_base())] if args.quick else ["--steps", str(args.pretrain_steps)]
    call_command("bootstrap_policy", "--project", "demo", *source)
    if args.midtrain_minutes:
        state["midtrain"] = _midtrain(args)
    return state


def _quick_base() -> Path:
    """An untrained tiny base whose tokenizer read the standard library's first 2,000 lines
    (pretraining reads the whole standard library, which the quick mode has no time for)."""
    from training.pretrain import PolicyConfig, build_policy, stdlib_corpus

    folder = ROOT / "var" / "bench-learning" / "quick-base"
    if not (folder / "config.json").exists():
        build_policy(folder, PolicyConfig(), stdlib_corpus(2_000))
    return folder


def _midtrain(args: argparse.Namespace) -> dict:
    """The code base's *.py files as a corpus, mid-trained on for `--midtrain-minutes`, gated here
    (webapp/demo `demo_onboard`, what `make demo` does once)."""
    from feedback.models import Project
    from webapp.demo import demo_onboard

    out = demo_onboard(Project.objects.get(slug="demo"), _corpus(args), minutes=args.midtrain_minutes)
    print(f"mid-training: v{out['version']} {out['steps']} steps in {out['seconds']:.0f} s, loss {out['loss_first']:.2f} -> "
          f"{out['loss_last']:.2f}; gate {'passed' if out['gate_passed'] else 'refused: ' + ', '.join(out['gate_failed'])}",
          flush=True)
    return out


def _corpus(args: argparse.Namespace):
    from webapp.demo.simulator import INTENT, django_source, stdlib_source

    return args.corpus or (django_source() if args.taste == INTENT else stdlib_source())


def _held_out_prompts(args: argparse.Namespace):
    """Requests from the files the users never send, none the gate's suite holds (same seed for
    every run); and the code base (its names)."""
    from webapp.demo import _demo_suite_prompts
    from webapp.demo.simulator import code_base, held_out_prompts

    code = code_base(_corpus(args))
    gate = {p["prompt"] for p in _demo_suite_prompts(args.taste, str(_corpus(args)))}
    requests = [r for r in held_out_prompts(code, args.taste, args.held_out + 50)
                if r.prompt not in gate and r.prompt[:20] not in gate]
    return requests[: args.held_out], code.known


def _observe(args: argparse.Namespace, held_out: tuple) -> tuple[list[dict], dict[int, dict]]:
    from django.utils import timezone

    from feedback.models import Project
    from training.models import PolicyVersion
    from training.versions.selectors import policy_production

    project = Project.objects.get(slug="demo")
    # the base first: a mid-trained candidate may be production before the first minute's reading
    evaluations: dict[int, dict] = {1: _evaluate(PolicyVersion.objects.get(project=project, number=1), held_out,
                                                 args.taste)}
    rows: list[dict] = []
    start, started_at = time.monotonic(), timezone.now()
    minutes = int(round(args.minutes))  # 0: the quick mode's one reading
    for minute in range(minutes + 1):
        while time.monotonic() - start < minute * 60:
            time.sleep(1)
        production = policy_production(project)
        if production is not None and production.number not in evaluations:
            evaluations[production.number] = _evaluate(production, held_out, args.taste)
        rows.append({"minute": minute, "production": production.number if production else None,
                     **_live(project), **_promotions(project, started_at)})
        _print_row(rows[-1], evaluations)
    return rows, evaluations


def _evaluate(version, held_out: tuple, taste: str) -> dict:
    """One completion per held-out request from `version`'s weights, fixed seeds; the population's
    figures (webapp.demo.simulator.population_metrics) and ten suggestions as they came."""
    from inference.engines import SamplingParams, make_engine
    from training.versions.services import policy_folder
    from webapp.demo.simulator import population_metrics, shown

    requests, known = held_out
    engine = make_engine("torch", policy_folder(version), version=version.number, seed=EVAL_SEED)
    try:
        out = engine.generate([r.prompt for r in requests], n=1,
                              sampling=SamplingParams(max_tokens=MAX_TOKENS, seed=EVAL_SEED))
    finally:
        engine.close()
    texts = [c.text for c in sorted(out, key=lambda c: c.prompt_index)]
    visible = [t for t in texts if shown(t)]
    return {**population_metrics(taste, requests, texts, known),
            "median_chars": statistics.median(len(t.strip()) for t in visible) if visible else 0,
            "samples": [{"typed": r.prompt.rsplit("\n", 1)[-1], "intended": r.intended, "suggestion": t}
                        for r, t in zip(requests[:10], texts[:10], strict=True)]}


def _live(project) -> dict:
    """That minute's feedback: clicks, accept rate, and accepted characters per request served
    (an accept's `value` is the characters kept; a line taste's accept carries none)."""
    from django.db.models import Count, Q, Sum
    from django.utils import timezone

    from feedback.models import FeedbackEvent, Trajectory

    since = timezone.now() - timedelta(seconds=60)
    clicks = FeedbackEvent.objects.filter(project=project, received_at__gte=since, signal__in=("accept", "reject"))
    agg = clicks.aggregate(n=Count("id"), accepts=Count("id", filter=Q(signal="accept")),
                           chars=Sum("value", filter=Q(signal="accept")))
    served = Trajectory.objects.filter(project=project, received_at__gte=since, source="live").count()
    return {"live_accept_rate": agg["accepts"] / agg["n"] if agg["n"] else None, "live_clicks": agg["n"],
            "live_accepted_chars": (agg["chars"] or 0) / served if served else None, "live_served": served}


def _promotions(project, started_at) -> dict:
    from training.models import AuditLog

    rows = AuditLog.objects.filter(project=project, action="approve").order_by("at")
    return {"promoted": [r.after["number"] for r in rows],
            "promoted_minutes": [round((r.at - started_at).total_seconds() / 60, 2) for r in rows]}


def _loop_record() -> dict:
    """What the loop did, to read the curve by: each run (data, rollouts, the reward model's
    held-out AUC, mean clip fraction, fresh mismatch KL), each gate verdict (the improvement,
    its interval and width, the checks that failed) and the users' aspect labels."""
    from django.db.models import Avg

    from training.models import GateReport, TrainingRun

    runs = []
    for run in TrainingRun.objects.filter(project__slug="demo").order_by("pk"):
        c, model = run.result, run.result.get("reward_model") or {}
        runs.append({"run": run.pk, "state": run.state, "base": run.base_version.number,
                     "candidate": run.candidate.number if run.candidate_id else None, "samples": c.get("samples"),
                     "rollouts": c.get("rollouts"), "reward_model_auc": model.get("heldout_auc"),
                     "clip_fraction": run.steps.aggregate(v=Avg("clip_fraction"))["v"],
                     "fresh_mismatch_kl": c.get("fresh_mismatch_kl"),
                     # the trust region (rl.kl_stop, rl.length_stop): the last round's measured KL and
                     # length ratio to production, and the round at which the run stopped and why
                     # (None: it took every round)
                     "kl_last_round": list((c.get("kl_by_round") or {None: None}).values())[-1],
                     "length_last_round": list((c.get("length_ratio_by_round") or {None: None}).values())[-1],
                     "stopped_after_round": c.get("stopped_after_round"), "stopped_by": c.get("stopped_by")})
    gates = []
    for report in GateReport.objects.filter(version__project__slug="demo").order_by("pk"):
        rows = {c["name"]: c for c in report.checks}
        gain = rows.get("reward_improvement", {})
        interval = gain.get("interval") or [None, None]
        gates.append({"version": report.version.number, "passed": report.passed, "improvement": gain.get("value"),
                      "interval": interval,
                      "width": (interval[1] - interval[0]) if None not in interval else None,
                      "failed": [n for n, c in rows.items() if not c.get("passed")],
                      "kl": rows.get("kl", {}).get("value"), "length_drift": rows.get("length_drift", {}).get("value"),
                      "intended_logprob": rows.get("intended_logprob", {}).get("value"),
                      "intended_interval": rows.get("intended_logprob", {}).get("interval")})
    return {"runs": runs, "gates": gates, **_labels_record()}


def _labels_record() -> dict:
    """The users' aspect labels and the judge-vs-human pairs the rubric page shows for them (after
    a last rollup refresh)."""
    from django.db.models import Sum

    from feedback.models import FeedbackEvent
    from webapp.models import AgreementRollup
    from webapp.rollups import rollups_refresh

    rollups_refresh()
    labels = FeedbackEvent.objects.filter(project__slug="demo", aspect_labels__isnull=False).count()
    pairs = AgreementRollup.objects.filter(project__slug="demo", tag="").aggregate(n=Sum("pairs"))["n"] or 0
    return {"aspect_labels": labels, "agreement_pairs": pairs}


def _screenshot(port: int, path: str) -> None:
    """The overview as a person sees it after the run: a viewer logs in through the login page."""
    import secrets

    from django.contrib.auth import get_user_model
    from playwright.sync_api import sync_playwright

    from feedback.models import Project

    password = secrets.token_urlsafe(12)
    users = get_user_model()
    user = users.objects.filter(username="bench-viewer").first() or users.objects.create_user("bench-viewer")
    user.set_password(password)
    user.is_staff = True  # sees every project's pages (read-only: no approval permission)
    user.save()
    assert Project.objects.filter(slug="demo").exists()
    base = f"http://127.0.0.1:{port}"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True,
                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        page.set_default_timeout(60_000)
        page.goto(base + "/p/demo/")
        page.fill("input[name=username]", "bench-viewer")
        page.fill("input[name=password]", password)
        page.click("button[type=submit]")
        page.wait_for_url(base + "/p/demo/")
        page.wait_for_selector("#chart-rate .main-svg")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=path, full_page=True)
        browser.close()


COLUMNS = (("accepted_chars", "chars/req", ".3f"), ("accept_rate", "accept", ".3f"), ("silent_rate", "silent", ".3f"),
           ("invented_share", "invented", ".3f"), ("top_suggestion_share", "top sugg", ".3f"),
           ("matched_chars", "matched", ".2f"), ("median_chars", "median", ".1f"))


def _print_row(row: dict, evaluations: dict[int, dict]) -> None:
    if row["minute"] == 0:
        print(f"{'min':>4} {'prod':>5} " + " ".join(f"{h:>9}" for _, h, _ in COLUMNS)
              + f" {'live c/req':>10} {'live acc':>9} {'clicks':>7}  promoted", flush=True)
    e = evaluations.get(row["production"] or -1, {})
    promoted = ", ".join(f"v{n}" for n in row["promoted"]) or "-"
    print(f"{row['minute']:>4} {'v' + str(row['production']):>5} "
          + " ".join(f"{_fmt(e.get(k), spec):>9}" for k, _, spec in COLUMNS)
          + f" {_fmt(row['live_accepted_chars']):>10} {_fmt(row['live_accept_rate']):>9} {row['live_clicks']:>7}  {promoted}",
          flush=True)


def _report(args: argparse.Namespace, rows: list[dict], evaluations: dict[int, dict], loop: dict,
            state: dict) -> int:
    base = evaluations.get(1, {})
    final = evaluations.get(rows[-1]["production"] or -1, {})
    promoted = rows[-1]["promoted"]
    print(f"\n{'version':<8}" + " ".join(f"{h:>9}" for _, h, _ in COLUMNS) + f" {'matched vs base':>16}")
    for number, e in sorted(evaluations.items()):
        delta = e["matched_chars"] - base.get("matched_chars", 0)
        print(f"v{number:<7}" + " ".join(f"{_fmt(e.get(k), spec):>9}" for k, _, spec in COLUMNS) + f" {delta:>+16.2f}")
    print(f"\nfinal version's suggestions (v{rows[-1]['production']}), as served:")
    for sample in final.get("samples", []):
        print(f"  {sample['typed']!r} -> {sample['suggestion']!r}   (about to type {sample['intended']!r})")
    _print_loop(loop)
    first = rows[-1]["promoted_minutes"][0] if rows[-1]["promoted_minutes"] else None
    result = {
        "baseline_accepted_chars": base.get("accepted_chars"), "final_accepted_chars": final.get("accepted_chars"),
        "baseline_accept_rate": base.get("accept_rate"), "final_accept_rate": final.get("accept_rate"),
        "gain_points": round(100 * (final.get("accept_rate", 0) - base.get("accept_rate", 0)), 1),
        "baseline_invented_share": base.get("invented_share"), "final_invented_share": final.get("invented_share"),
        "final_top_suggestion_share": final.get("top_suggestion_share"),
        "matched_chars_vs_base": (final.get("matched_chars", 0) - base.get("matched_chars", 0)) if base else None,
        "minutes": args.minutes, "versions_promoted": promoted, "first_promotion_minutes": first,
        "silent_rate": final.get("silent_rate"), "median_suggestion_chars": final.get("median_chars"),
        "seed": args.seed, "taste": args.taste, "corpus": str(_corpus(args)), "held_out_prompts": args.held_out,
        "pretrain_steps": args.pretrain_steps, "quick": args.quick, "midtrain": state.get("midtrain"),
        "per_minute": [{k: r[k] for k in ("minute", "production", "live_accept_rate", "live_accepted_chars")}
                       for r in rows],
        "per_version": {f"v{n}": e for n, e in sorted(evaluations.items())}, **loop,
    }
    if args.json:
        print(json.dumps(result))
    return 0


def _print_loop(loop: dict) -> None:
    print("\nrun  base  cand  samples  rollouts  RM AUC  clip   mismatch KL  KL to prod  len/prod  stopped")
    for r in loop["runs"]:
        stopped = "-" if r["stopped_after_round"] is None else f"round {r['stopped_after_round']} ({r['stopped_by']})"
        print(f"{r['run']:<4} v{r['base']:<4} v{r['candidate'] or '-':<4} {r['samples'] or 0:>7} {r['rollouts'] or 0:>9} "
              f"{_fmt(r['reward_model_auc']):>7} {_fmt(r['clip_fraction']):>5}  {_fmt(r['fresh_mismatch_kl'], '.1e'):>11}"
              f"  {_fmt(r['kl_last_round']):>10}  {_fmt(r['length_last_round']):>8}  {stopped}")
    print("\ngate  passed  improvement  interval            width   KL     length  failed")
    for g in loop["gates"]:
        lo, hi = g["interval"]
        print(f"v{g['version']:<4} {str(g['passed']):<7} {_fmt(g['improvement']):>11}  [{_fmt(lo)}, {_fmt(hi)}]"
              f"{'':>4}{_fmt(g['width']):>6}  {_fmt(g['kl'])}  {_fmt(g['length_drift'])}  {', '.join(g['failed']) or '-'}")
    print(f"\naspect labels sent by the users: {loop.get('aspect_labels', 0)}; judge-vs-human pairs on the rubric page: "
          f"{loop.get('agreement_pairs', 0)}")


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    raise SystemExit(main())
