"""inference/engines/openmp.py: a thread's OpenMP team freed once its torch work is done, so a
process whose torch work moves between threads keeps no idle workers beside the busy team.

    .venv/bin/python -m pytest tests/inference/test_openmp.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.processes import ROOT

# In a process of its own: counting a process's threads is exact only where no other test's
# threads come and go. Teams of two whatever the machine's cores (one worker thread each).
PROBE = """
import json, threading
from pathlib import Path
import torch
from inference.engines.openmp import release_team

torch.set_num_threads(2)
import time

def threads():
    return len(list(Path("/proc/self/task").iterdir()))

def settled():
    # the count once no thread is still exiting (a finished thread's team leaves after it)
    last, same = threads(), 0
    while same < 10:
        time.sleep(0.02)
        now = threads()
        same, last = (same + 1 if now == last else 0), now
    return last

def work():
    a = torch.randn(256, 256)
    for _ in range(3):
        a = torch.tanh(a @ a / 256)

def worker(release, seen, done, go_on):
    seen["start"] = settled()
    work()
    seen["team"] = settled()
    if release:
        seen["released"] = release_team()
    seen["after"] = settled()
    if release:
        work()  # the thread computes on: a new team
        seen["again"] = settled()
        release_team()
    done.set()
    go_on.wait(10)  # the thread itself lives on: only its team's workers go

rows = []
for release in (False, True):
    seen, done, go_on = {}, threading.Event(), threading.Event()
    thread = threading.Thread(target=worker, args=(release, seen, done, go_on))
    thread.start()
    done.wait(60)
    rows.append(dict(seen))
    go_on.set()
    thread.join()
print(json.dumps(rows))
"""


def test_a_thread_that_releases_its_team_leaves_no_workers_behind():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kept, released = json.loads(out.stdout.strip().splitlines()[-1])
    assert kept["team"] > kept["start"], kept  # a parallel region on a new thread: a team of its own
    assert kept["after"] == kept["team"], kept  # kept for the thread's life otherwise
    assert released["team"] > released["start"], released
    assert released["released"] is True and released["after"] == released["start"], released
    assert released["again"] == released["team"], released  # the next region starts a new team
