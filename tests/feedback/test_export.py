"""Dataset export: `manage.py export_dataset` and GET /api/v1/export write the three formats, and
each file loads with `datasets` and trains one step under the matching TRL trainer."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from django.core.management import call_command

from feedback.services import feedback_ingest
from tests.factories import feedback, trajectory

pytestmark = pytest.mark.django_db

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def _served(ident: str, prompt: str, answer: str, *, version: int = 1, minute: int = 0, **extra) -> dict:
    return trajectory(ident, policy_version=version, prompt=[{"role": "user", "content": prompt}],
                      steps=[{"role": "assistant", "content": answer}],
                      occurred_at=f"2026-11-29T08:{minute:02d}:00Z", **extra)


def _seed(project) -> None:
    events = [
        # A sampled group of three answers to one prompt: two accepted, one rejected.
        _served("g-a", "def add(a, b):", " return a + b", group="grp-1", minute=1),
        _served("g-b", "def add(a, b):", " return a - b", group="grp-1", minute=2),
        _served("g-c", "def add(a, b):", " return b + a", group="grp-1", minute=3),
        # Live traffic, no group: the same prompt answered twice, one happy and one sad.
        _served("l-a", "def mul(a, b):", " return a * b", version=2, minute=4),
        _served("l-b", "def mul(a, b):", " return a ** b", version=2, minute=5),
        # A prompt with only a rejection (no pair), and one nobody judged (no label).
        _served("r-a", "def sub(a, b):", " return 0", version=2, minute=6),
        _served("n-a", "def div(a, b):", " return a / b", version=2, minute=7),
    ]
    events += [
        feedback("f1", "g-a", signal="accept"), feedback("f2", "g-b", signal="reject"),
        feedback("f3", "g-c", signal="accept"), feedback("f4", "l-a", signal="happy"),
        feedback("f5", "l-b", signal="sad"), feedback("f6", "r-a", signal="reject"),
        # The latest verdict wins: g-c was accepted, then the user changed their mind... and back.
        feedback("f7", "g-c", signal="reject", occurred_at="2026-11-29T09:00:00Z"),
        feedback("f8", "g-c", signal="edit_kept", occurred_at="2026-11-29T09:01:00Z"),
    ]
    results = feedback_ingest(project, events)
    assert {r.status for r in results} == {"accepted"}


def _export(project, fmt: str, out: Path, *args: str) -> list[dict]:
    call_command("export_dataset", "--project", project.slug, "--format", fmt, "--out", str(out), *args)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_messages_are_the_prompt_then_the_turns_as_served(creds, tmp_path):
    _seed(creds.project)
    rows = _export(creds.project, "messages", tmp_path / "m.jsonl")
    assert len(rows) == 7
    assert rows[0] == {"messages": [{"role": "user", "content": "def add(a, b):"},
                                    {"role": "assistant", "content": " return a + b"}]}


def test_kto_labels_come_from_the_latest_verdict_and_unjudged_ones_are_left_out(creds, tmp_path):
    _seed(creds.project)
    rows = _export(creds.project, "kto", tmp_path / "k.jsonl")
    labels = [(r["completion"][0]["content"], r["label"]) for r in rows]
    assert labels == [(" return a + b", True), (" return a - b", False), (" return b + a", True),
                      (" return a * b", True), (" return a ** b", False), (" return 0", False)]
    assert rows[0]["prompt"] == [{"role": "user", "content": "def add(a, b):"}]


def test_preference_pairs_come_only_from_groups_with_mixed_outcomes(creds, tmp_path):
    _seed(creds.project)
    rows = _export(creds.project, "preference", tmp_path / "p.jsonl")
    pairs = [(r["prompt"][0]["content"], r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows]
    assert pairs == [("def add(a, b):", " return a + b", " return a - b"),
                     ("def add(a, b):", " return b + a", " return a - b"),
                     ("def mul(a, b):", " return a * b", " return a ** b")]


def test_filters_narrow_the_export(creds, tmp_path):
    _seed(creds.project)
    assert len(_export(creds.project, "kto", tmp_path / "v.jsonl", "--version", "2")) == 3
    assert len(_export(creds.project, "kto", tmp_path / "s.jsonl", "--signal", "sad")) == 1
    window = _export(creds.project, "messages", tmp_path / "w.jsonl",
                     "--since", "2026-11-29T08:02:00Z", "--until", "2026-11-29T08:04:00Z")
    assert [r["messages"][1]["content"] for r in window] == [" return a - b", " return b + a"]


def test_the_api_streams_the_same_rows_as_the_command(client, creds, tmp_path):
    _seed(creds.project)
    for fmt in ("messages", "kto", "preference"):
        response = client.get(f"/api/v1/export?format={fmt}&policy_version=2",
                              HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
        assert response.status_code == 200 and response.streaming
        assert response["Content-Type"].startswith("application/jsonl")
        body = b"".join(response.streaming_content).decode()
        assert [json.loads(line) for line in body.splitlines()] == _export(
            creds.project, fmt, tmp_path / f"{fmt}.jsonl", "--version", "2")


def test_the_api_says_which_format_is_wrong_and_needs_the_read_scope(client, creds, other_creds):
    _seed(creds.project)
    bad = client.get("/api/v1/export?format=sft", HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
    assert bad.status_code == 400 and "format" in bad.json()["error"]["fields"]
    missing = client.get("/api/v1/export", HTTP_AUTHORIZATION=f"Bearer {creds.api_key}")
    assert missing.status_code == 400 and "format" in missing.json()["error"]["fields"]
    assert client.get("/api/v1/export?format=kto").status_code == 401
    other = client.get("/api/v1/export?format=kto", HTTP_AUTHORIZATION=f"Bearer {other_creds.api_key}")
    assert other.status_code == 200 and b"".join(other.streaming_content) == b""


def test_each_format_loads_with_datasets_and_trains_one_trl_step(creds, tmp_path, dense_dir):
    """In the bench's TRL venv (bench/rl_step.py builds it once): `datasets.load_dataset("json")`,
    TRL's conversational-format check, then one optimiser step of SFT, KTO and DPO."""
    from bench.rl_step import trl_python

    _seed(creds.project)
    files = {fmt: str(tmp_path / f"{fmt}.jsonl") for fmt in ("messages", "kto", "preference")}
    for fmt, path in files.items():
        _export(creds.project, fmt, Path(path))
    proc = subprocess.run([str(trl_python()), str(HERE / "_trl_check.py"), str(dense_dir), json.dumps(files)],
                          capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                               "CUDA_VISIBLE_DEVICES": "", "HF_DATASETS_CACHE": str(tmp_path / "hf"),
                               "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {
        "messages": {"rows": 7, "conversational": True, "steps": 1},
        "kto": {"rows": 6, "conversational": True, "steps": 1},
        "preference": {"rows": 3, "conversational": True, "steps": 1},
    }


@pytest.mark.django_db(transaction=True)
def test_the_export_streams_over_the_asgi_server(asgi_server, creds, tmp_path):
    import httpx

    _seed(creds.project)
    with httpx.stream("GET", f"{asgi_server}/api/v1/export", params={"format": "kto"},
                      headers={"Authorization": f"Bearer {creds.api_key}"}, timeout=60) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    assert [json.loads(line) for line in lines if line] == _export(creds.project, "kto", tmp_path / "k.jsonl")
