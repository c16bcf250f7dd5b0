"""Many serving replicas kept in sync by delta broadcast: time and bytes of one promotion.

    .venv/bin/python bench/broadcast.py [--replicas 4] [--changed 0.01] [--engine torch|vllm]
        [--hidden 512] [--layers 4] [--vocab 4096] [--json]
    .venv/bin/python bench/broadcast.py --quick    # one replica of a 64-wide policy, 20 canary requests

On a database of its own (loopback): registers a policy v1 in production and a candidate v2 whose
weights differ from v1's in `--changed` of the elements of every tensor (a small RL step), starts
`--replicas` real `manage.py serve_policy` processes (each registers itself), keeps every replica
busy with greedy one-token completions from one client thread each, and approves v2 as a person
does (`candidate_promote`, the dashboard's path). The HTTP deploy transport pushes each live
replica the delta chain it lacks; each verifies against the manifest, swaps and acks.

Measured:
- broadcast_s: from the approval until every replica serves v2 (all acks in, and each replica's
  /healthz says v2);
- bytes_delta: bytes pushed to all replicas (the replicas' rows record each push);
  bytes_full: what sending the full checkpoint (model.safetensors) to each would have cost;
- stale_responses: completions whose request was *sent after* its replica acked v2 but that were
  answered by another version (the Flywheel-Policy-Version header). Must be 0. checked_after_ack
  says how many such requests were looked at.

Then (unless --canary-share 0) the gate policy gets a canary share and a v3 is approved: it goes
to every replica as a canary (the delta from v2 each holds), and `--canary-requests` completions
spread evenly over the replicas measure the share of traffic it got (canary_share_observed).

With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._django import bench_database_url, create_database  # noqa: E402

DB = "flywheel_bench_broadcast"
VAR = ROOT / "var" / "bench-broadcast"
TOKEN = f"bench-broadcast-{os.getpid()}"


def main() -> int:
    args = _args()
    shutil.rmtree(VAR, ignore_errors=True)
    VAR.mkdir(parents=True)
    env = _environment()
    os.environ.update(env)
    create_database(DB, fresh=True)
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    state = _prepare(args)
    procs, urls = _start_replicas(args, env)
    try:
        result = _measure(args, state, urls)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    _report(args, result)
    failed = _failed(args, result)
    for reason in failed:
        print(f"FAILED: {reason}")
    if failed and args.json:
        print(json.dumps(result))  # the JSON line stays last
    return 1 if failed else 0


def _failed(args: argparse.Namespace, r: dict) -> list[str]:
    """What makes this run's figures wrong or empty, one line each."""
    out = []
    if r["stale_responses"]:
        out.append(f"{r['stale_responses']} requests sent after their replica's ack were answered by another version")
    if not r["checked_after_ack"]:
        out.append("no request was sent after a replica's ack: nothing checked for staleness")
    if r["replicas_on_new"] != args.replicas:
        out.append(f"{r['replicas_on_new']} of {args.replicas} replicas' rows say they serve the new version")
    if r["load_errors"]:
        out.append(f"{r['load_errors']} load requests failed: {r['load_error']}")
    if "canary_share" in r:
        if r["replicas_with_canary"] != args.replicas:
            out.append(f"{r['replicas_with_canary']} of {args.replicas} replicas' rows hold the canary")
        if r["canary_responses"] != args.canary_requests // args.replicas * args.replicas:
            out.append(f"{r['canary_responses']} canary requests answered: {r.get('canary_error', '')}")
    return out


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--changed", type=float, default=0.01, help="fraction of each tensor's elements changed")
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--canary-share", type=float, default=0.25)
    parser.add_argument("--canary-requests", type=int, default=400)
    parser.add_argument("--quick", action="store_true",
                        help="one replica of a one-layer 64-wide policy, 20 canary requests: that the bench runs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.hidden, args.layers, args.vocab, args.canary_requests = 1, 64, 1, 512, 20
    return args


def _environment() -> dict[str, str]:
    from core import embedded

    return {
        "DATABASE_URL": bench_database_url(DB), "REDIS_URL": os.environ.get("REDIS_URL") or embedded.redis_url(),
        "DJANGO_SETTINGS_MODULE": "webapp.settings", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        "FLYWHEEL_INTERNAL_TOKEN": TOKEN, "FLYWHEEL_DEPLOY_TRANSPORT": "http",
        "FLYWHEEL_CHECKPOINT_DIR": str(VAR / "checkpoints"), "FLYWHEEL_REPLICA_HEARTBEAT_S": "1",
        "CELERY_KEY_PREFIX": f"bench-broadcast-{os.getpid()}:", "OMP_NUM_THREADS": "1",
        # The load threads send as fast as the replicas answer: serving's per-minute rate limits
        # (600 a key) would answer most of them 429 and leave nothing to check after the acks.
        "FLYWHEEL_SERVE_RATE_PER_KEY": "10000000", "FLYWHEEL_SERVE_RATE_PER_PROJECT": "10000000",
    }


def sparse_child(parent: Path, out: Path, fraction: float, seed: int) -> float:
    """`parent`'s folder with `fraction` of every tensor's elements nudged; returns the fraction
    of all elements that changed."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(parent, out)
    state = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    changed = total = 0
    for name, tensor in state.items():
        flat = tensor.reshape(-1).clone()
        idx = torch.randperm(flat.numel(), generator=gen)[: max(1, int(flat.numel() * fraction))]
        flat[idx] += 0.01 * (flat[idx].abs() + 1e-3)
        changed += int((flat != tensor.reshape(-1)).sum())
        total += flat.numel()
        state[name] = flat.reshape(tensor.shape)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return changed / total


def _prepare(args: argparse.Namespace) -> dict:
    from django.contrib.auth.models import User

    from feedback.services import api_key_create, membership_set, project_create
    from training.pretrain import PolicyConfig, build_policy, stdlib_corpus
    from training.versions.services import policy_register

    creds = project_create("Bench broadcast", "broadcast")
    cfg = PolicyConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                       num_heads=max(args.hidden // 64, 1), num_kv_heads=max(args.hidden // 128, 1),
                       intermediate_size=3 * args.hidden, seed=args.seed, tokenizer_lines=20_000)
    v1_dir = build_policy(VAR / "v1", cfg, stdlib_corpus(2_000 if args.quick else 20_000))
    changed = sparse_child(v1_dir, VAR / "v2", args.changed, args.seed + 1)
    v1 = policy_register(creds.project, v1_dir, state="production")
    v2 = policy_register(creds.project, VAR / "v2", parent=v1, state="awaiting_approval")
    approver = User.objects.create_user("bench-approver", password="bench-approver-password-1")
    membership_set(creds.project, approver, "approver")  # approvals are per project
    return {"project": creds.project, "v2": v2, "v2_dir": VAR / "v2", "changed": changed, "approver": User.objects.get(id=approver.id),
            "serve_key": api_key_create(creds.project, ["serve"], "bench"),
            "full_bytes": (VAR / "v2" / "model.safetensors").stat().st_size}


def _start_replicas(args: argparse.Namespace, env: dict[str, str]):
    from tests.processes import free_port, wait_http

    procs, urls = [], {}  # public URL -> internal address (what the replica registers)
    for i in range(args.replicas):
        port, internal = free_port(), free_port()
        log = open(VAR / f"replica-{i}.log", "wb")
        procs.append(subprocess.Popen(
            [sys.executable, "manage.py", "serve_policy", "--project", "broadcast", "--port", str(port),
             "--internal-port", str(internal), "--engine", args.engine, "--no-record"],
            cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT))
        urls[f"http://127.0.0.1:{port}"] = f"http://127.0.0.1:{internal}"
    for proc, url in zip(procs, urls, strict=True):
        wait_http(url + "/healthz", proc, 900)
    return procs, urls


def _load(url: str, key: str, stop: threading.Event, out: list[tuple[float, float, int]], errors: list[str]) -> None:
    import httpx

    body = {"model": "broadcast", "prompt": "def add(a, b):", "max_tokens": 1, "temperature": 0}
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {key}"}) as http:
        while not stop.is_set():
            sent = time.time()
            response = http.post(url + "/v1/completions", json=body)
            if response.status_code == 200:
                out.append((sent, time.time(), int(response.headers["flywheel-policy-version"])))
            else:
                errors.append(f"{response.status_code}: {response.text[:300]}")


def _measure(args: argparse.Namespace, state: dict, urls: dict[str, str]) -> dict:
    import httpx

    from training.models import ServingReplica
    from training.promotion.services import candidate_promote

    deadline = time.monotonic() + 120
    while ServingReplica.objects.filter(project=state["project"], state="serving").count() < args.replicas:
        if time.monotonic() > deadline:
            raise RuntimeError("the replicas did not all register")
        time.sleep(0.2)
    stop = threading.Event()
    answers: dict[str, list[tuple[float, float, int]]] = {url: [] for url in urls}
    errors: list[str] = []
    threads = [threading.Thread(target=_load, args=(u, state["serve_key"], stop, answers[u], errors), daemon=True)
               for u in urls]
    for t in threads:
        t.start()
    time.sleep(2)
    number = state["v2"].number
    start = time.time()
    candidate_promote(state["v2"], state["approver"], "approve", "bench: broadcast")
    acked = time.time()
    pending = set(urls)
    while pending:  # every replica says it serves v2
        pending = {u for u in pending if httpx.get(u + "/healthz", timeout=30).json()["version"] != number}
    done = time.time()
    time.sleep(2)  # traffic after the acks: any stale answer would show here
    stop.set()
    for t in threads:
        t.join(130)
    rows = {r.address: r for r in ServingReplica.objects.filter(project=state["project"])}
    result = _figures(args, state, urls, answers, rows, start, max(acked, done), number)
    result.update(load_errors=len(errors), load_error=errors[0] if errors else "")
    if args.canary_share > 0:
        result.update(_canary(args, state, urls))
    return result


def _canary(args: argparse.Namespace, state: dict, urls: dict[str, str]) -> dict:
    """A canary of v3 at --canary-share on every replica; the share of answers it gave."""
    import httpx

    from training.models import ServingReplica
    from training.promotion.services import candidate_promote, gate_policy_update
    from training.versions.services import policy_register

    gate_policy_update(state["project"], state["approver"], "bench: canary", canary_share=args.canary_share)
    sparse_child(state["v2_dir"], VAR / "v3", args.changed, args.seed + 2)
    v3 = policy_register(state["project"], VAR / "v3", parent=state["v2"], state="awaiting_approval")
    start = time.time()
    candidate_promote(v3, state["approver"], "approve", "bench: canary")
    took = time.time() - start
    rows = list(ServingReplica.objects.filter(project=state["project"]))
    versions: list[int] = []
    errors: list[str] = []
    body = {"model": "broadcast", "prompt": "x = 1", "max_tokens": 1, "temperature": 0}

    def ask(url: str, n: int) -> None:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {state['serve_key']}"}) as http:
            for _ in range(n):
                response = http.post(url + "/v1/completions", json=body)
                if response.status_code != 200:
                    errors.append(f"{response.status_code}: {response.text[:300]}")
                    continue
                versions.append(int(response.headers["flywheel-policy-version"]))

    threads = [threading.Thread(target=ask, args=(u, args.canary_requests // len(urls))) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"canary_share": args.canary_share, "canary_broadcast_s": round(took, 3),
            "canary_bytes": sum(r.pushed_bytes for r in rows),
            "replicas_with_canary": sum(1 for r in rows if r.canary == v3.number),
            "canary_share_observed": round(sum(v == v3.number for v in versions) / max(len(versions), 1), 3),
            "canary_responses": len(versions), "canary_error": errors[0] if errors else ""}


def _figures(args, state, urls, answers, rows, start, done, number) -> dict:
    ordered = [rows[address] for address in urls.values() if address in rows]
    stale = checked = 0
    for url, address in urls.items():
        row = rows.get(address)
        ack = row.acked_at.timestamp() if row is not None and row.acked_at else None
        for sent, _, version in answers[url]:
            if ack is not None and sent > ack:
                checked += 1
                stale += version != number
    bytes_delta = sum(r.pushed_bytes for r in rows.values())
    bytes_full = state["full_bytes"] * args.replicas
    return {
        "replicas": args.replicas, "engine": args.engine, "quick": args.quick, "changed_fraction": round(state["changed"], 5),
        "broadcast_s": round(done - start, 3), "bytes_delta": bytes_delta, "bytes_full": bytes_full,
        "ratio": round(bytes_full / max(bytes_delta, 1), 1), "stale_responses": stale,
        "checked_after_ack": checked, "responses": sum(len(a) for a in answers.values()),
        "replicas_on_new": sum(1 for r in rows.values() if r.version == number),
        "per_replica": [{"address": r.address, "version": r.version, "pushed_bytes": r.pushed_bytes,
                         "ack_after_s": round(r.acked_at.timestamp() - start, 3) if r.acked_at else None}
                        for r in ordered],
    }


def _report(args: argparse.Namespace, r: dict) -> None:
    print(f"broadcast of one promotion to {r['replicas']} replicas ({r['engine']} engine), "
          f"{100 * r['changed_fraction']:.2f}% of the weights changed")
    print(f"{'replica':<28}{'version':>8}{'pushed bytes':>14}{'ack after s':>13}")
    for p in r["per_replica"]:
        print(f"{p['address']:<28}{p['version']!s:>8}{p['pushed_bytes']:>14,}{p['ack_after_s']!s:>13}")
    print(f"broadcast_s {r['broadcast_s']}  bytes_delta {r['bytes_delta']:,}  bytes_full {r['bytes_full']:,}  "
          f"ratio {r['ratio']}x (goal >= 20x)")
    print(f"stale_responses {r['stale_responses']} of {r['checked_after_ack']} requests sent after their "
          f"replica's ack ({r['responses']} responses in all)")
    if "canary_share" in r:
        print(f"canary v3 at share {r['canary_share']}: on {r['replicas_with_canary']} of {r['replicas']} replicas "
              f"{r['canary_broadcast_s']} s after the approval, {r['canary_bytes']:,} bytes pushed; it answered "
              f"{r['canary_share_observed']:.3f} of {r['canary_responses']} requests spread over the replicas")
    if args.json:
        print(json.dumps(r))


if __name__ == "__main__":
    sys.exit(main())
