"""The engine's scheduler and serving thread off its worker's cores (inference/engines/affinity.py),
on real processes: a stand-in engine core whose child (the worker) is bound to some of the cores.

    .venv/bin/python -m pytest tests/inference/test_affinity.py -q
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from inference.engines import affinity

# A parent (the engine core) starting a child (the worker) bound to the cores in argv[1], then
# both waiting to be killed; the parent prints the child's pid once it is bound.
TREE = """
import os, subprocess, sys, time
cpus = {int(c) for c in sys.argv[1].split(",")}
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
os.sched_setaffinity(child.pid, cpus)
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture
def tree():
    started: list[subprocess.Popen] = []

    def start(cpus: set[int]) -> tuple[int, int]:
        proc = subprocess.Popen([sys.executable, "-c", TREE, ",".join(map(str, sorted(cpus)))],
                                stdout=subprocess.PIPE, text=True)
        started.append(proc)
        return proc.pid, int(proc.stdout.readline())

    yield start
    for proc in started:
        for pid in affinity._children(proc.pid):
            os.kill(pid, 9)
        proc.kill()
        proc.wait()


def _in_thread(fn):
    """fn() on a new thread (the engine's loop); its result and that thread's cores after."""
    out = {}

    def run():
        out["result"] = fn()
        out["cpus"] = os.sched_getaffinity(threading.get_native_id())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return out["result"], out["cpus"]


def test_the_scheduler_and_the_calling_thread_take_the_cores_the_worker_left(tree):
    allowed = os.sched_getaffinity(0)
    worker_cpus = {min(allowed)}
    left = allowed - worker_cpus  # empty on one core: then nothing is bound
    core, worker = tree(worker_cpus)
    assert affinity._children(core) == [worker]
    assert affinity.reserved_cpus([core]) == left
    pinned, thread_cpus = _in_thread(lambda: affinity.pin_off_worker([core]))
    assert pinned == left
    assert thread_cpus == (left or allowed)
    assert all(os.sched_getaffinity(tid) == (left or allowed) for tid in affinity._threads(core))
    assert os.sched_getaffinity(worker) == worker_cpus  # the worker keeps its own
    assert os.sched_getaffinity(0) == allowed  # the process's other threads keep theirs


def test_nothing_is_bound_where_the_worker_may_use_every_core_or_pinning_is_off(tree, monkeypatch):
    allowed = os.sched_getaffinity(0)
    core, _ = tree(allowed)
    pinned, thread_cpus = _in_thread(lambda: affinity.pin_off_worker([core]))
    assert pinned == set() and thread_cpus == allowed
    assert all(os.sched_getaffinity(tid) == allowed for tid in affinity._threads(core))
    assert affinity.reserved_cpus([os.getpid() + 10**7]) == set()  # no such engine core: no worker

    if len(allowed) >= 2:
        core, _ = tree({min(allowed)})
        monkeypatch.setenv("FLYWHEEL_ENGINE_PIN", "off")
        pinned, thread_cpus = _in_thread(lambda: affinity.pin_off_worker([core]))
        assert pinned == set() and thread_cpus == allowed
    monkeypatch.setenv("FLYWHEEL_ENGINE_PIN", "sometimes")
    with pytest.raises(ValueError, match="set 'on'.*or 'off'"):
        affinity.pin_off_worker([core])


def test_a_thread_started_by_a_bound_one_goes_back_to_the_process_cores():
    """An engine built from another engine's (bound) loop starts its processes on every core."""
    allowed = os.sched_getaffinity(0)

    def bound_then_child():
        os.sched_setaffinity(threading.get_native_id(), {max(allowed)})
        inherited = _in_thread(lambda: None)[1]
        unbound = _in_thread(affinity.unbind_thread)[1]
        return inherited, unbound

    (inherited, unbound), _ = _in_thread(bound_then_child)
    assert inherited == {max(allowed)}  # what happened before: the binding passed on
    assert unbound == allowed == affinity.process_cpus()


def test_a_bad_setting_is_refused_before_the_serving_engine_starts_anything(monkeypatch, tmp_path):
    from inference.engines.vllm_async import AsyncVLLMEngine

    monkeypatch.setenv("FLYWHEEL_ENGINE_PIN", "yes please")
    threads, children = threading.active_count(), affinity._children(os.getpid())
    with pytest.raises(ValueError, match="FLYWHEEL_ENGINE_PIN='yes please'.*or 'off'"):
        AsyncVLLMEngine(tmp_path)
    assert threading.active_count() == threads and affinity._children(os.getpid()) == children
