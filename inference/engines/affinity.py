"""vLLM's CPU engine: its scheduler and the thread serving its requests off the worker's cores.

vLLM's CPU worker binds its OpenMP threads to the allowed cores but the reserved ones
(`VLLM_CPU_NUM_OF_RESERVED_CPU`; by default one per worker on x86, kept "for the scheduler
process"), and leaves that scheduler (the engine core process) and the process serving requests
unbound. Both are busy every step: the engine core spins (`sched_yield`) on the worker's answer for
a second after each, and the frontend turns outputs into responses. On 2 cores the worker computes
on core 0 alone, and the other two land on it about half the time, each time stalling a step.

`pin_off_worker` binds the engine core's threads and the calling thread (the engine's own loop:
its output handler and, in a serving process, the HTTP listeners) to the reserved cores, as vLLM's
reservation intends. Measured on 2 cores (the tiny dense policy, one engine, in-process clients,
4 interleaved rounds of 5 s, the same engine re-bound between rounds): at 16 clients 2,025 ->
2,194 and 2,347 -> 2,428 tokens/s in two runs (7.46 -> 6.83 and 6.39 -> 6.19 ms a step of 15
tokens), at 4 clients unchanged (993 -> 1,011). Other threads of the process keep their cores (a
replica's background sampler, which waits while users are served, uses them all when they are
idle). Nothing is bound where the worker is not bound to fewer cores than the process may use
(`VLLM_CPU_OMP_THREADS_BIND=nobind`, one core) or where `FLYWHEEL_ENGINE_PIN=off`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _threads(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _bind(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (threads it starts later inherit their creator's)."""
    for tid in _threads(pid):
        with contextlib.suppress(OSError):  # a thread that exited meanwhile
            os.sched_setaffinity(tid, cpus)


def enabled() -> bool:
    """FLYWHEEL_ENGINE_PIN: "on" (the default) or "off"."""
    chosen = os.environ.get("FLYWHEEL_ENGINE_PIN", "on").strip().lower()
    if chosen not in ("on", "off"):
        raise ValueError(f"FLYWHEEL_ENGINE_PIN={chosen!r}: set 'on' (the default: the engine's scheduler "
                         "and serving thread off its worker's cores) or 'off'")
    return chosen == "on"


def process_cpus() -> set[int]:
    """The cores the process may use: its main thread's (a bound thread's own are fewer)."""
    return os.sched_getaffinity(os.getpid())


def unbind_thread() -> None:
    """The calling thread back on the process's cores. A thread inherits the binding of the one
    that started it: an engine started from another engine's loop (a canary or a new base loaded
    while serving) would start its engine core and worker on the reserved cores alone."""
    os.sched_setaffinity(threading.get_native_id(), process_cpus())


def reserved_cpus(core_pids: list[int]) -> set[int]:
    """The cores this process may use that no worker of these engine cores is bound to; empty
    where the workers may use them all."""
    allowed = process_cpus()
    workers = [w for pid in core_pids for w in _children(pid)]
    if not workers:
        return set()
    used: set[int] = set()
    for worker in workers:
        try:
            used |= os.sched_getaffinity(worker)
        except OSError:
            return set()
    return allowed - used


def pin_off_worker(core_pids: list[int]) -> set[int]:
    """Binds the engine core processes `core_pids` and the calling thread to the cores their
    workers left (module docstring); returns them (empty: nothing bound)."""
    if not enabled():
        return set()
    cpus = reserved_cpus(core_pids)
    if not cpus:
        return set()
    for pid in core_pids:
        _bind(pid, cpus)
    os.sched_setaffinity(threading.get_native_id(), cpus)
    log.info("engine scheduler %s and serving thread bound to cores %s", core_pids, sorted(cpus))
    return cpus
