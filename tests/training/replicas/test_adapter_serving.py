"""Adapter versions served as adapters over one engine holding their base: a promotion hot-loads
the new adapter under a new name and unloads the old, the canary is a second adapter on the same
engine (rollback unloads it), several projects over one base share the engine and each key
reaches only its own project's adapters, and the probe after every swap refuses a planted stale
or wrong adapter (the old version keeps serving, the replica row and the alert metric show it).

Real parts: PostgreSQL, the checkpoint store, the torch engine (PEFT adapters), serve_policy's own
wiring (`Command._server`, `_agent`) in this process. The vLLM side: tests/inference/test_vllm_lora.py.

    .venv/bin/python -m pytest tests/training/replicas/test_adapter_serving.py -q
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from django.test import override_settings
from prometheus_client import REGISTRY

from feedback.services import api_key_create, project_create
from inference import serving
from inference.engines import AdapterView, SamplingParams, TorchEngine
from inference.serving import ServingError
from tests.inference.test_vllm_lora import _adapter
from training.management.commands import serve_policy
from training.models import CanaryRun, PolicyVersion, ServingReplica
from training.replicas.adapters import AdapterHosts
from training.replicas.probe import probe_verify
from training.replicas.selectors import replicas_probe_refused
from training.versions.services import policy_adapter_folder, policy_register, version_transition

pytestmark = pytest.mark.django_db(transaction=True)  # the agent closes stale connections, as serve_policy does
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def _adapter_version(project, base: PolicyVersion, tmp_path: Path, seed: int, state: str = "awaiting_approval"):
    adapter, merged = _adapter(Path(base.checkpoint_path or _base_dir(base)), tmp_path / f"{project.slug}-{seed}", seed)
    version = policy_register(project, adapter, parent=base, state=state, adapter_base=base)
    return version, merged


def _base_dir(base: PolicyVersion) -> Path:
    from training.versions.services import policy_folder

    return policy_folder(base)


def _promote(version: PolicyVersion) -> None:
    version.refresh_from_db()
    for old in PolicyVersion.objects.filter(project=version.project, state="production").exclude(pk=version.pk):
        version_transition(old, "retired", "test", "retire")
    version_transition(version, "production", "test", "approve", "test")


def _start(slugs: list[str], tmp_path: Path, settings) -> tuple[dict, AdapterHosts, dict]:
    """serve_policy's servers and replica agents for `slugs`, in this process (torch engine)."""
    settings.VAR_DIR = tmp_path / "var"
    opts = {"model_dir": None, "policy_version": None, "no_record": True, "max_model_len": 256,
            "summary_budget": 0, "engine": "torch", "port": 0}
    hosts = AdapterHosts(serve_policy.EngineFactory("torch", {"max_model_len": 256}))
    servers = {slug: serve_policy.Command()._server(slug, opts, hosts) for slug in slugs}
    agents = {slug: serve_policy._agent(s, {**opts, "project": slug}, "http://127.0.0.1:9") for slug, s in servers.items()}
    return servers, hosts, agents


def _stop(servers: dict, hosts: AdapterHosts, agents: dict) -> None:
    for agent in agents.values():
        agent.stop()
    for server in servers.values():
        server.close()
    hosts.close()


def _reference(folder: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    engine = TorchEngine(folder)
    try:
        return torch.tensor(engine.score_many([(prompt, tokens)])[0][0])
    finally:
        engine.close()


def test_a_promotion_hot_loads_the_new_adapter_and_the_canary_is_a_second_one_on_the_same_engine(
        creds, production, tmp_path, settings):
    v2, merged2 = _adapter_version(creds.project, production, tmp_path, seed=1, state="production")
    version_transition(production, "retired", "test", "retire")
    v3, merged3 = _adapter_version(creds.project, production, tmp_path, seed=2)
    servers, hosts, agents = _start(["acme"], tmp_path, settings)
    server, agent = servers["acme"], agents["acme"]
    try:
        host = server.host
        assert isinstance(server.engine, AdapterView) and server.engine.host is host and len(hosts.by_key) == 1
        first = server.engine.adapter
        assert host.adapters_held() == [first]
        out = server.engine.generate(["def add(a, b):"], sampling=GREEDY)[0]
        assert out.version == 2
        assert (torch.tensor(out.logprobs) - _reference(merged2, out.prompt_token_ids, out.token_ids)).abs().max() < 1e-4
        assert agent.probe["ok"] and agent.probe["version"] == 2 and agent.probe["expected_hash"] == agent.probe["loaded_hash"]

        _promote(v3)
        server.load({"version": 3})  # hot-load: the same engine, a new adapter name, the old unloaded
        assert server.host is host and server.engine.version == 3 and server.engine.adapter not in (None, first)
        assert host.adapters_held() == [server.engine.adapter]
        out = server.pick_engine("acme").generate(["def add(a, b):"], sampling=GREEDY)[0]
        assert out.version == 3
        assert (torch.tensor(out.logprobs) - _reference(merged3, out.prompt_token_ids, out.token_ids)).abs().max() < 1e-4

        v4, _ = _adapter_version(creds.project, production, tmp_path, seed=3)
        CanaryRun.objects.create(version=v4, baseline=v3, share=0.25)
        version_transition(v4, "canary", "test", "canary_start", "test")
        server.load({"canary": 4, "share": 0.25})
        assert isinstance(server.canary, AdapterView) and server.canary.host is host
        assert len(host.adapters_held()) == 2 and server.pick_engine("acme-v4").version == 4
        assert [a["role"] for a in agent.served()["adapters"]] == ["production", "canary"]
        server.load({"canary": None})  # rollback of the canary: its adapter unloaded
        assert host.adapters_held() == [server.engine.adapter]
        names = [first, server.engine.adapter]
        assert len(set(names)) == 2  # never a name used twice
    finally:
        _stop(servers, hosts, agents)


def test_a_planted_stale_or_wrong_adapter_is_refused_and_the_old_version_keeps_serving(
        creds, production, tmp_path, settings):
    v2, _ = _adapter_version(creds.project, production, tmp_path, seed=1, state="production")
    version_transition(production, "retired", "test", "retire")
    v3, _ = _adapter_version(creds.project, production, tmp_path, seed=2)
    stranger, _ = _adapter(Path(production.checkpoint_path or _base_dir(production)), tmp_path / "stranger", seed=9)
    servers, hosts, agents = _start(["acme"], tmp_path, settings)
    server, agent = servers["acme"], agents["acme"]
    try:
        before = server.engine.adapter
        folder3 = policy_adapter_folder(v3)
        refused = REGISTRY.get_sample_value("flywheel_serving_probe_total", {"project": "acme", "outcome": "refused"}) or 0
        _promote(v3)
        for planted in (policy_adapter_folder(v2), stranger):  # stale: v2's adapter; wrong: another one
            shutil.copy2(planted / "adapter_model.safetensors", folder3 / "adapter_model.safetensors")
            with pytest.raises(ServingError) as caught:
                server.load({"version": 3})
            assert caught.value.status == 409 and "failed the probe" in caught.value.message
            assert "still serves v2" in caught.value.fix
            assert server.engine.version == 2 and server.engine.adapter == before
            assert server.host.adapters_held() == [before]  # the staged adapter was unloaded
            row = ServingReplica.objects.get(id=agent.replica_id)
            assert row.probe["ok"] is False and row.probe["version"] == 3 and "other weights" in row.probe["problem"]
        assert replicas_probe_refused() == [("acme", "http://127.0.0.1:9", 3)]
        assert REGISTRY.get_sample_value("flywheel_serving_probe_total",
                                         {"project": "acme", "outcome": "refused"}) == refused + 2
    finally:
        _stop(servers, hosts, agents)


def test_the_probe_refuses_an_engine_serving_another_adapter_than_the_folder_it_was_given(
        creds, production, tmp_path, settings):
    """The folder is right (its hash is the manifest's) but the engine serves another adapter
    (vLLM's LoRA cache under a reused id; rollouts on the base): the log-probs give it away."""
    settings.VAR_DIR = tmp_path / "var"
    v2, _ = _adapter_version(creds.project, production, tmp_path, seed=1)
    v3, _ = _adapter_version(creds.project, production, tmp_path, seed=2)
    host = TorchEngine(_base_dir(production))
    try:
        right = AdapterView(host, policy_adapter_folder(v3), 3)
        assert probe_verify(v3, right, policy_adapter_folder(v3), "production", "torch").ok
        wrong = AdapterView(host, policy_adapter_folder(v2), 3)
        report = probe_verify(v3, wrong, policy_adapter_folder(v3), "production", "torch")
        assert not report.ok and report.loaded_hash == report.expected_hash
        assert "tokens" in report.problem or "log-probs differ" in report.problem
        base = probe_verify(v3, host, policy_adapter_folder(v3), "production", "torch")  # the base alone
        assert not base.ok
    finally:
        host.close()


def test_two_projects_over_one_base_share_the_engine_and_each_key_reaches_only_its_own(
        client, creds, production, tmp_path, settings, tiny_policy_dir):
    other = project_create("Other Product", "other").project
    other_base = policy_register(other, tiny_policy_dir, state="retired")  # the same weights, its own row
    _adapter_version(creds.project, production, tmp_path, seed=1, state="production")
    version_transition(production, "retired", "test", "retire")
    _adapter_version(other, other_base, tmp_path, seed=2, state="production")
    servers, hosts, agents = _start(["acme", "other"], tmp_path, settings)
    recorded: dict[str, list] = {"acme": [], "other": []}
    for slug, s in servers.items():
        s.recorder = serving.Recorder(write=recorded[slug].extend)
    serving.SERVER, serving.SERVERS = servers["acme"], servers
    acme_key, other_key = creds.api_key, api_key_create(other, ["serve"], name="client")
    outsider = project_create("Third", "third").project
    try:
        assert len(hosts.by_key) == 1 and len(servers["acme"].host.adapters_held()) == 2
        with override_settings(ROOT_URLCONF="inference.urls"):
            answers = {slug: _complete(client, key, slug) for slug, key in (("acme", acme_key), ("other", other_key))}
            assert answers["acme"].json()["model"] == "acme-v2" and answers["other"].json()["model"] == "other-v2"
            assert answers["acme"].json()["choices"][0]["logprobs"] != answers["other"].json()["choices"][0]["logprobs"]
            crossed = _complete(client, other_key, "acme-v2")  # B's key naming A's adapter
            assert crossed.status_code == 400 and "unknown model" in crossed.json()["error"]["message"]
            assert {m["id"] for m in client.get("/v1/models", headers=_auth(other_key)).json()["data"]} == {
                "other", "other-v2"}
            third = _complete(client, api_key_create(outsider, ["serve"], name="client"), "third")
            assert third.status_code == 403 and "than the ones this process serves" in third.json()["error"]["message"]
        for slug in ("acme", "other"):
            servers[slug].recorder.flush()
        assert [e["policy_version"] for e in recorded["acme"]] == [2] and len(recorded["other"]) == 1
        agents["acme"].beat()  # the registry's row: its own adapter, and one of another project on the engine
        row = ServingReplica.objects.get(id=agents["acme"].replica_id)
        assert [a["version"] for a in row.adapters] == [2] and row.adapters_other == 1
    finally:
        serving.SERVER, serving.SERVERS = None, {}
        _stop(servers, hosts, agents)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(client, key: str, model: str):
    body = {"model": model, "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    return client.post("/v1/completions", json.dumps(body), content_type="application/json", headers=_auth(key))
