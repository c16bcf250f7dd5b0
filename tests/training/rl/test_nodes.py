"""A run's torchrun jobs over several nodes (training/rl/nodes.py): the settings refused with what
to set, and two "nodes" on this machine (node 0 launched as the train worker launches it, node 1 by
the follower) giving the one-process losses and weights.

    .venv/bin/python -m pytest tests/training/rl/test_nodes.py -q
"""

from __future__ import annotations

import threading

import pytest
import torch

from tests.processes import free_port
from tests.training.rl.test_distributed import _batches, _job, _one_process
from training.rl.distributed import launch, torchrun_command
from training.rl.nodes import Nodes, follow


@pytest.mark.parametrize("nodes, says", [
    (Nodes(nnodes=0), "FLYWHEEL_TRAIN_NNODES must be a whole number >= 1"),
    (Nodes(nnodes=2), "FLYWHEEL_TRAIN_MASTER_ADDR must be node 0's host name"),
    (Nodes(nnodes=2, master_addr="train 0"), "FLYWHEEL_TRAIN_MASTER_ADDR"),
    (Nodes(nnodes=2, master_addr="train-0:29500"), "FLYWHEEL_TRAIN_MASTER_ADDR"),  # the port goes on its own
    (Nodes(nnodes=2, node_rank=2, master_addr="train-0"), "FLYWHEEL_TRAIN_NODE_RANK must be 0 .. 1"),
    (Nodes(nnodes=2, master_addr="train-0", master_port=70000), "FLYWHEEL_TRAIN_MASTER_PORT must be a TCP port"),
])
def test_bad_node_settings_are_refused_saying_what_to_set(nodes, says):
    with pytest.raises(ValueError, match=says) as refused:
        nodes.check()
    assert "docs/deployment.md" in str(refused.value)


def test_the_settings_read_from_the_environment_and_a_non_number_is_refused():
    env = {"FLYWHEEL_TRAIN_NNODES": "3", "FLYWHEEL_TRAIN_NODE_RANK": "2", "FLYWHEEL_TRAIN_MASTER_ADDR": "10.0.0.5"}
    nodes = Nodes.from_env(env)
    assert nodes == Nodes(3, 2, "10.0.0.5", 29500)
    assert nodes.args() == ["--nnodes=3", "--node-rank=2", "--master-addr=10.0.0.5", "--master-port=29500"]
    assert "--standalone" in torchrun_command(__import__("pathlib").Path("job"), 2)
    with pytest.raises(ValueError, match="whole numbers"):
        Nodes.from_env({"FLYWHEEL_TRAIN_NNODES": "two"})


def test_two_nodes_give_the_one_process_losses_and_weights(tmp_path, tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    batches = _batches(steps=2, rows=6, vocab=384)
    losses, weights = _one_process(tiny_policy_dir, batches)
    root = tmp_path / "torchrun"
    folder = _job(root / "run-1", tiny_policy_dir, batches, "take-0")
    port = free_port()
    follower = threading.Thread(target=follow, args=(root, 1, Nodes(2, 1, "127.0.0.1", port)),
                                kwargs={"every_s": 0.05, "once": True}, daemon=True)
    follower.start()
    result = launch(folder, nproc=1, timeout_s=300, nodes=Nodes(2, 0, "127.0.0.1", port))
    follower.join(60)
    assert (folder / "node-1.joined").exists() and (folder / "rank-1.json").exists()  # rank 1 ran on node 1
    assert [m["loss"] for m in result.metrics] == pytest.approx(losses, abs=1e-5)
    trained = AutoModelForCausalLM.from_pretrained(result.policy, dtype=torch.float32).state_dict()
    assert max(float((trained[k] - weights[k]).abs().max()) for k in weights) < 1e-5
