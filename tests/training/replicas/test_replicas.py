"""Serving replicas: registration and heartbeat, delta pushes to every live replica, catch-up of
a replica that was down, and a corrupted push refused.

Real parts: PostgreSQL, the checkpoint store, the torch engine; `manage.py serve_policy` runs as
its own processes (two replicas) for the broadcast. The in-process tests drive one replica's
agent directly (the same code /internal/push calls).

    .venv/bin/python -m pytest tests/training/replicas/test_replicas.py -q
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
import torch
from django.utils import timezone

from inference.engines import SamplingParams, make_engine
from inference.serving import PolicyServer, ServingError
from tests.processes import ROOT, free_port, subprocess_env, wait_http
from training.models import CanaryRun, PolicyVersion, ServingReplica
from training.promotion.services import candidate_promote
from training.replicas import push
from training.replicas.agent import ReplicaAgent
from training.replicas.selectors import replica_rows, replicas_live
from training.replicas.services import PushPlanner
from training.versions.selectors import serving_target
from training.versions.services import checkpoint_store, policy_folder, policy_register, version_transition

TOKEN = "replica-test-token"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
pytestmark = pytest.mark.django_db(transaction=True)  # the agent closes stale connections, as serve_policy does


def _sparse_child(parent: Path, out: Path, fraction: float = 0.01, seed: int = 1) -> Path:
    """`parent`'s folder with `fraction` of every tensor's elements changed (a small RL step)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(parent, out)
    state = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in state.items():
        flat = tensor.reshape(-1).clone()
        idx = torch.randperm(flat.numel(), generator=gen)[: max(1, int(flat.numel() * fraction))]
        flat[idx] += 0.01 * (flat[idx].abs() + 1e-3)
        state[name] = flat.reshape(tensor.shape)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _child(project, parent: PolicyVersion, tmp_path: Path, seed: int) -> PolicyVersion:
    folder = _sparse_child(policy_folder(parent), tmp_path / f"child-{seed}", seed=seed)
    return policy_register(project, folder, parent=parent, state="awaiting_approval")


def _agent(project, version: PolicyVersion, tmp_path: Path) -> ReplicaAgent:
    folder = policy_folder(version)
    server = PolicyServer(project.slug, make_engine("torch", folder, version=version.number), None,
                          engines=lambda f, n: make_engine("torch", f, version=n))
    agent = ReplicaAgent(project, server, "http://127.0.0.1:9", lambda n, role: policy_folder(
        PolicyVersion.objects.get(project=project, number=n)), tmp_path / "replica")
    agent.adopt(version, folder)
    server.resolve = agent.resolve
    return agent


def _production_push(base: PolicyVersion, target: PolicyVersion) -> bytes:
    store = checkpoint_store()
    header = {"role": "production", "version": target.number, "share": None, "base": base.manifest_hash,
              "manifest": store.storage.get(target.manifest_hash).decode()}
    return push.push_encode(header, push.push_plan(store, base.manifest_hash, target.manifest_hash),
                            push.files_plan(store, base.manifest_hash, target.manifest_hash))


def _make_production(version: PolicyVersion) -> None:
    version.refresh_from_db()  # the row's state, not this object's (a helper holds stale ones)
    for old in PolicyVersion.objects.filter(project=version.project, state="production").exclude(pk=version.pk):
        version_transition(old, "retired", "test", "retire")
    if version.state != "production":
        version_transition(version, "production", "test", "approve", "test")


def test_a_replica_registers_beats_and_counts_as_down_once_silent(creds, production, tmp_path, settings):
    agent = _agent(creds.project, production, tmp_path)
    agent.register()
    row = ServingReplica.objects.get(id=agent.replica_id)
    assert (row.address, row.version, row.canary, row.state) == ("http://127.0.0.1:9", 1, None, "serving")
    assert list(replicas_live(creds.project.id)) == [row]

    ServingReplica.objects.filter(id=row.id).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    assert not replicas_live(creds.project.id).exists()
    assert replica_rows(creds.project)[0]["status"] == "down"
    agent.beat()  # a heartbeat brings it back
    assert list(replicas_live(creds.project.id)) == [row]

    ServingReplica.objects.filter(id=row.id).update(
        heartbeat_at=timezone.now() - timedelta(seconds=settings.FLYWHEEL_REPLICA_STALE_S + 1))
    assert not replicas_live(creds.project.id).exists()
    agent.beat()
    agent.stop()  # a clean stop counts as down at once
    assert not replicas_live(creds.project.id).exists()
    assert replica_rows(creds.project)[0]["status"] == "stopped"
    agent.server.close()


def test_a_heartbeat_racing_a_push_never_writes_the_old_version_over_the_push_ack(creds, production, tmp_path):
    """The beat reads what is served; a push swaps and its ack is recorded; the beat's write must
    not land after that with what it read before (the row would say v1 while v2 is served)."""
    import threading

    from training.replicas.services import PushOutcome, _record

    v2 = _child(creds.project, production, tmp_path, seed=8)
    agent = _agent(creds.project, production, tmp_path)
    agent.register()
    _make_production(v2)
    body = _production_push(production, v2)
    acks: list[dict] = []

    def push_and_record() -> None:  # what the broadcaster does: POST, then record the ack
        acks.append(agent.receive(body))
        _record(PushOutcome(agent.replica_id, agent.address, ok=True, served=acks[-1], acked_at=timezone.now()))

    read = agent.served
    pusher = threading.Thread(target=push_and_record)

    def served_then_push():  # the push arrives right after the beat read what is served
        out = read()
        if not pusher.is_alive() and not acks:
            pusher.start()
            pusher.join(3)  # it may have to wait for the beat
        return out

    agent.served = served_then_push
    agent.beat()
    agent.served = read
    pusher.join(30)
    assert acks and acks[0]["version"] == 2 and agent.server.engine.version == 2
    assert ServingReplica.objects.get(id=agent.replica_id).version == 2
    agent.server.close()


def test_a_live_replica_that_missed_a_push_catches_up_from_the_store(creds, production, tmp_path):
    v2 = _child(creds.project, production, tmp_path, seed=6)
    agent = _agent(creds.project, production, tmp_path)
    _make_production(v2)  # committed, but no push reached this replica
    assert not agent.catch_up(patience_s=3600)  # a push may still be on its way: wait
    assert agent.server.engine.version == 1
    assert agent.catch_up(patience_s=0)
    assert agent.server.engine.version == 2 and set(agent.held) == {v2.manifest_hash}
    assert not agent.catch_up(patience_s=0)  # in step now
    agent.server.close()


def test_a_corrupted_delta_is_refused_and_the_replica_keeps_serving_its_version(creds, production, tmp_path):
    v2 = _child(creds.project, production, tmp_path, seed=2)
    agent = _agent(creds.project, production, tmp_path)
    _make_production(v2)
    body = bytearray(_production_push(production, v2))
    header, blobs, _ = push.push_decode(bytes(body))
    assert len(blobs) == 1 and push.read_manifest(blobs[0])["kind"] == "delta"
    prompt = agent.server.engine.encode("def add(a, b):")
    before = agent.server.engine.generate([prompt], sampling=GREEDY)[0].token_ids

    corrupt = bytearray(body)
    corrupt[len(body) - len(blobs[0]) // 2 - 200] ^= 0x01  # one bit inside the delta's payload
    with pytest.raises(ServingError) as refused:
        agent.receive(bytes(corrupt))
    assert refused.value.status == 409 and "refused" in refused.value.message
    assert "still serves v1" in refused.value.fix
    assert agent.server.engine.version == 1
    assert agent.server.engine.generate([prompt], sampling=GREEDY)[0].token_ids == before

    forged = push.push_encode({**header, "manifest": header["manifest"].replace('"version"', '"version" ')},
                              *push.push_decode(bytes(body))[1:])
    with pytest.raises(ServingError, match="not .* the one the registry names"):
        agent.receive(forged)
    assert agent.server.engine.version == 1

    acked = agent.receive(bytes(body))
    assert acked["version"] == 2 and agent.server.engine.version == 2
    assert set(agent.held) == {v2.manifest_hash}  # v1's weights are let go once nothing serves them
    agent.server.close()


def test_a_canary_is_pushed_with_its_share_to_every_replica_and_its_promotion_sends_no_weights(
        creds, production, tmp_path):
    v2 = _child(creds.project, production, tmp_path, seed=3)
    now = timezone.now()
    rows = [ServingReplica.objects.create(project=creds.project, address=f"http://10.0.0.{i}:8002", version=1,
                                          registered_at=now, heartbeat_at=now) for i in range(3)]
    CanaryRun.objects.create(version=v2, baseline=production, share=0.25)
    path = ["candidate", "gated", "awaiting_approval", "canary"]  # a canary starts from an approval
    for state in path[path.index(v2.state) + 1:]:
        version_transition(v2, state, "test", "test")
    target = serving_target(creds.project.id)
    planner = PushPlanner(target, rows)
    plans = [planner.bodies(r) for r in rows]
    assert all(len(p) == 1 for p in plans) and len({p[0] for p in plans}) == 1  # built once, same for all
    header, blobs, _ = push.push_decode(plans[0][0])
    assert (header["role"], header["version"], header["share"], header["base"]) == ("canary", 2, 0.25,
                                                                                    production.manifest_hash)
    assert sum(map(len, blobs)) == v2.delta_bytes  # only v2's stored delta travels

    agent = _agent(creds.project, production, tmp_path)
    acked = agent.receive(plans[0][0])
    assert (acked["version"], acked["canary"], acked["canary_share"]) == (1, 2, 0.25)

    CanaryRun.objects.filter(version=v2).update(decided_at=timezone.now(), outcome="promote")
    _make_production(v2)
    for row in rows:
        row.canary, row.canary_share = 2, 0.25
    bodies = PushPlanner(serving_target(creds.project.id), rows).bodies(rows[0])
    promote, drop = (push.push_decode(b) for b in bodies)
    assert promote[0]["base"] == v2.manifest_hash and promote[1] == [] and promote[2] == {}
    assert drop[0] == {"role": "canary", "version": None, "blobs": [], "files": {}}
    for body in bodies:
        acked = agent.receive(body)
    assert (acked["version"], acked["canary"]) == (2, None)
    agent.server.close()


def test_a_push_with_a_canary_share_the_database_does_not_hold_is_refused(creds, production, tmp_path):
    v2 = _child(creds.project, production, tmp_path, seed=5)
    CanaryRun.objects.create(version=v2, baseline=production, share=0.25)
    version_transition(v2, "canary", "test", "canary_start", "test")
    now = timezone.now()
    row = ServingReplica.objects.create(project=creds.project, address="http://10.0.0.7:8002", version=1,
                                        registered_at=now, heartbeat_at=now)
    (body,) = PushPlanner(serving_target(creds.project.id), [row]).bodies(row)
    header, blobs, files = push.push_decode(body)
    forged = push.push_encode({**header, "share": 0.99}, blobs, files)
    agent = _agent(creds.project, production, tmp_path)
    with pytest.raises(ServingError) as refused:
        agent.receive(forged)
    assert refused.value.status == 409 and "0.25" in refused.value.message and refused.value.fix
    assert agent.server.canary is None
    with pytest.raises(ServingError):  # /internal/load goes through the same check
        agent.server.load({"canary": 2, "share": 0.5})
    assert agent.receive(body)["canary_share"] == 0.25
    agent.server.close()


def test_a_rollback_sends_one_delta_computed_between_the_two_versions(creds, production, tmp_path):
    v2 = _child(creds.project, production, tmp_path, seed=7)
    agent = _agent(creds.project, production, tmp_path)
    _make_production(v2)
    agent.receive(_production_push(production, v2))
    assert set(agent.held) == {v2.manifest_hash}  # it no longer holds v1
    now = timezone.now()
    row = ServingReplica.objects.create(project=creds.project, address="http://10.0.0.9:8002", version=2,
                                        registered_at=now, heartbeat_at=now)
    _make_production(production)  # back to v1, a parent: no stored delta leads there
    (body,) = PushPlanner(serving_target(creds.project.id), [row]).bodies(row)
    header, blobs, files = push.push_decode(body)
    assert header["base"] == v2.manifest_hash and len(blobs) == 1 and files == {}
    assert push.read_manifest(blobs[0])["kind"] == "delta"
    assert len(blobs[0]) < checkpoint_store().manifest(production.manifest_hash)["blob_bytes"]
    assert agent.receive(body)["version"] == 1
    assert agent.held[production.manifest_hash].checkpoint == checkpoint_store().manifest(
        production.manifest_hash)["checkpoint_hash"]
    agent.server.close()


def test_a_push_needs_the_internal_token_a_registered_replica_and_a_whole_body(settings, rf):
    from inference import replica as replica_view

    settings.FLYWHEEL_INTERNAL_TOKEN = TOKEN

    def post(token: str):
        return replica_view.push(rf.post("/internal/push", data=b"FWPUSH1\n", content_type="application/octet-stream",
                                         HTTP_AUTHORIZATION=f"Bearer {token}"))

    assert post("wrong").status_code == 401
    refused = post(TOKEN)
    assert refused.status_code == 409 and b"serve_policy" in refused.content
    body = push.push_encode({"role": "canary", "version": None}, [b"abc"], {"config.json": b"{}"})
    assert push.push_decode(body)[1:] == ([b"abc"], {"config.json": b"{}"})
    for broken in (body[:-1], body + b"x", b"FWPUSH1\n" + body[8:12]):
        with pytest.raises(push.PushMalformed):
            push.push_decode(broken)


# --- real serving processes -----------------------------------------------------------------------


def _serve(slug: str, checkpoints: Path, name: str) -> tuple[subprocess.Popen, str]:
    port, internal = free_port(), free_port()
    log = open(ROOT / "var" / f"test-replica-{name}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "serve_policy", "--project", slug, "--port", str(port),
         "--internal-port", str(internal), "--engine", "torch", "--no-record"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env=subprocess_env(FLYWHEEL_INTERNAL_TOKEN=TOKEN, FLYWHEEL_CHECKPOINT_DIR=str(checkpoints),
                           FLYWHEEL_REPLICA_HEARTBEAT_S="0.5"))
    return proc, f"http://127.0.0.1:{port}"


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _served(url: str) -> int:
    return httpx.get(url + "/healthz", timeout=10).json()["version"]


def test_a_promotion_pushes_deltas_to_every_live_replica_and_one_that_was_down_catches_up(
        creds, production, alice, tmp_path, settings, checkpoint_root):
    settings.FLYWHEEL_INTERNAL_TOKEN, settings.FLYWHEEL_DEPLOY_TRANSPORT = TOKEN, "http"
    v2 = _child(creds.project, production, tmp_path, seed=4)
    procs = [_serve(creds.project.slug, checkpoint_root, name) for name in ("a", "b")]
    try:
        for proc, url in procs:
            wait_http(url + "/healthz", proc, 600)
        assert ServingReplica.objects.filter(project=creds.project, version=1).count() == 2

        candidate_promote(v2, alice, "approve", "better on the gate")
        rows = list(ServingReplica.objects.filter(project=creds.project))
        assert [(r.version, r.error) for r in rows] == [(2, ""), (2, "")]
        assert all(_served(url) == 2 for _, url in procs)
        # Only v2's delta travelled (plus its manifest and the push header), far below the weights.
        raw = checkpoint_store().manifest(v2.manifest_hash)["raw_bytes"]
        assert all(v2.delta_bytes < r.pushed_bytes < v2.delta_bytes + 8192 for r in rows)
        assert all(r.pushed_bytes < raw / 5 for r in rows)

        (down, down_url), (up, up_url) = procs
        _stop(down)  # a clean stop: down at once
        v3 = _child(creds.project, v2, tmp_path, seed=5)
        candidate_promote(v3, alice, "approve", "better again")
        assert _served(up_url) == 3
        address = {r.address: r for r in ServingReplica.objects.filter(project=creds.project)}
        assert sorted((r.state, r.version) for r in address.values()) == [("serving", 3), ("stopped", 2)]

        back, back_url = _serve(creds.project.slug, checkpoint_root, "a-again")
        procs[0] = (back, back_url)
        wait_http(back_url + "/healthz", back, 600)
        assert _served(back_url) == 3  # loaded from the store what the database says
        assert sorted(r.version for r in ServingReplica.objects.filter(project=creds.project, state="serving")) == [3, 3]
    finally:
        for proc, _ in procs:
            _stop(proc)


def test_the_registry_page_shows_each_replica_its_versions_and_heartbeat_age(creds, production, client, bob):
    now = timezone.now()
    ServingReplica.objects.create(project=creds.project, address="http://10.0.0.7:8002", hostname="gpu-7",
                                  engine="vllm", version=1, canary=None, registered_at=now,
                                  heartbeat_at=now - timedelta(seconds=4))
    ServingReplica.objects.create(project=creds.project, address="http://10.0.0.8:8002", version=1, canary=1,
                                  canary_share=0.1, registered_at=now, heartbeat_at=now - timedelta(hours=2),
                                  error="409: the push of v2 is refused")
    client.force_login(bob)
    page = client.get(f"/p/{creds.project.slug}/registry/").content.decode()
    table = page[page.index('id="replicas"'):]
    live, down = table.index("http://10.0.0.7:8002"), table.index("http://10.0.0.8:8002")
    assert live < down  # live replicas first
    ages = [int(a) for a in re.findall(r'data-heartbeat-age="(\d+)"', table)]
    assert 4 <= ages[0] < 60 and ages[1] >= 7200  # seconds since each one's last heartbeat
    assert "gpu-7" in table and ">live<" in table and ">down<" in table
    assert "v1 · 10%" in table and "push failed" in table
