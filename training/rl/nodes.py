"""A run's torchrun jobs over several nodes: the launch each node runs, and what it is validated with.

The `train` worker is node 0: it writes each round's job folder on the checkpoint volume (shared
by every node) and runs its part, `torchrun --nnodes M --node-rank 0 --master-addr A
--master-port P` (torch's static rendezvous: node i hosts global ranks i*N .. i*N+N-1, so global
rank 0, the one that writes metrics and the gathered weights, is always on the worker's node).
Every other node runs a follower that starts the same command with its own node rank for each job
folder the worker writes:

    FLYWHEEL_TRAIN_NNODES=2 FLYWHEEL_TRAIN_NODE_RANK=1 FLYWHEEL_TRAIN_MASTER_ADDR=train-0 \\
        .venv/bin/python -m training.rl.nodes /data/checkpoints/torchrun

Settings (the same on every node but the node rank): FLYWHEEL_TRAIN_NPROC (processes per node),
FLYWHEEL_TRAIN_NNODES, FLYWHEEL_TRAIN_MASTER_ADDR (node 0's address the others reach),
FLYWHEEL_TRAIN_MASTER_PORT (default 29500), FLYWHEEL_TRAIN_NODE_RANK (0 on the worker's node).
`Nodes.check` refuses bad values with what to set. No Django here.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Nodes:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = ""
    master_port: int = 29500

    def check(self) -> Nodes:
        """Self, or ValueError naming every bad value and the fix."""
        problems = []
        if type(self.nnodes) is not int or self.nnodes < 1:
            problems.append(f"FLYWHEEL_TRAIN_NNODES must be a whole number >= 1 (got {self.nnodes!r})")
        elif self.nnodes > 1:
            if not self.master_addr or any(c.isspace() for c in self.master_addr) or ":" in self.master_addr:
                problems.append(f"FLYWHEEL_TRAIN_MASTER_ADDR must be node 0's host name or IPv4 address, which every "
                                f"node reaches (got {self.master_addr!r})")
            if type(self.node_rank) is not int or not 0 <= self.node_rank < self.nnodes:
                problems.append(f"FLYWHEEL_TRAIN_NODE_RANK must be 0 .. {self.nnodes - 1} (0 on the train worker's "
                                f"node; got {self.node_rank!r})")
        if type(self.master_port) is not int or not 0 < self.master_port < 65536:
            problems.append(f"FLYWHEEL_TRAIN_MASTER_PORT must be a TCP port 1 .. 65535 (got {self.master_port!r})")
        if problems:
            raise ValueError("; ".join(problems) + ". See docs/deployment.md, training past one node")
        return self

    def args(self) -> list[str]:
        """torchrun's node arguments: --standalone on one node (a free local port)."""
        if self.nnodes == 1:
            return ["--standalone"]
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}"]

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Nodes:
        env = dict(os.environ if env is None else env)
        try:
            return cls(int(env.get("FLYWHEEL_TRAIN_NNODES", "1")), int(env.get("FLYWHEEL_TRAIN_NODE_RANK", "0")),
                       env.get("FLYWHEEL_TRAIN_MASTER_ADDR", ""),
                       int(env.get("FLYWHEEL_TRAIN_MASTER_PORT", "29500"))).check()
        except ValueError as exc:
            if "FLYWHEEL_TRAIN" in str(exc):
                raise
            raise ValueError(f"FLYWHEEL_TRAIN_NNODES, _NODE_RANK and _MASTER_PORT must be whole numbers: {exc}") from None


def follow(root: Path, nproc: int, nodes: Nodes, every_s: float = 0.5, once: bool = False) -> None:
    """A node past the first: runs its part of every job folder the worker writes under `root`
    (`run-*/take-*/spec.json`), one at a time, each once (a `node-<rank>.joined` marker)."""
    from training.rl.distributed import torchrun_command

    while True:
        for spec in sorted(root.glob("run-*/take-*/spec.json"), key=lambda p: p.stat().st_mtime):
            folder, marker = spec.parent, spec.parent / f"node-{nodes.node_rank}.joined"
            if marker.exists() or (folder / "policy").exists():
                continue
            marker.write_text(str(os.getpid()))
            with open(folder / f"node-{nodes.node_rank}.log", "wb") as log:
                subprocess.run(torchrun_command(folder, nproc, nodes), stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
            if once:
                return
        time.sleep(every_s)


if __name__ == "__main__":
    follow(Path(sys.argv[1]), int(os.environ.get("FLYWHEEL_TRAIN_NPROC", "1")), Nodes.from_env())
