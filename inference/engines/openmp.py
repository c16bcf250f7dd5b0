"""One OpenMP team at a time in a process whose torch work moves between threads.

torch's CPU kernels run on GNU OpenMP (libgomp), which keeps a team of worker threads for every
thread that ever ran a parallel region, for that thread's life. Once the teams' threads outnumber
the cores, libgomp "throttles" every team: its idle workers spin about 1,000 times instead of
GOMP_SPINCOUNT before they sleep, so nearly every operator of a decoder wakes its workers through
the kernel. A serving replica has such threads: the one that loaded the engines at startup, the
live engine's own, the background sampler's. Measured on 2 cores (the bench's 256x4 policy, 64
rollouts of 16 tokens): 0.13 s on one thread alone, 0.185-0.19 s once a second thread had run one
operator, 0.105-0.11 s when the idle threads first released their teams with `release_team`.

`release_team` is OpenMP 5's `omp_pause_resource_all(omp_pause_soft)`: it frees the calling
thread's workers (outside a parallel region), and its next region starts a new team (tens of
microseconds). A thread calls it when its torch work is done for now: an engine's own thread after
a call, the background sampler before it waits for users or for work, a server's main thread once
its engines are loaded. Where torch does not run on libgomp (another OpenMP, or none) it does
nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1


@functools.cache
def _pause() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """libgomp's `omp_pause_resource_all`, from the copy this process loaded (torch's own, not a
    second one from the system's path); None where none is loaded."""
    import torch  # noqa: F401 - loads the libgomp torch was built with

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "/libgomp" in line}
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def release_team() -> bool:
    """Frees the calling thread's OpenMP worker threads; False where there is nothing to call or
    the thread is inside a parallel region."""
    pause = _pause()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
