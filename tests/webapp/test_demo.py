"""The demo's process list points at this checkout (a moved module once pointed it elsewhere)."""

from __future__ import annotations

from pathlib import Path

from webapp import demo


def test_every_demo_process_runs_a_file_or_module_of_this_checkout(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_INFERENCE_URL", "http://127.0.0.1:8001")
    monkeypatch.setenv("AUTO_APPROVE", "1")
    assert (demo.ROOT / "manage.py").is_file()
    procs = dict(demo.demo_processes(8000, {"project": "demo"}, simulate=True))
    assert set(procs) == {"web", "worker", "beat", "inference", "users"}
    for name in ("inference", "users"):
        assert Path(procs[name][1]).is_file(), procs[name]
    assert "--approve" in procs["users"]
