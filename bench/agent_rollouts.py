"""Agent rollouts/s: "make these tests pass" tasks with tools read_file / write_file / run_tests,
every tool call in a fresh bubblewrap sandbox, G rollouts per task in lockstep through one torch
engine (training/rewards/agents.py).

Two rows: the scripted policy (the tests' deterministic agent: four turns, three tool calls, the
tests pass; token ids and log-probs from the real tiny policy), and the tiny policy itself (a
poor agent: it rarely writes a tool call; the volume row), both on the same tiny dense policy
built offline under var/bench-agent-policy. Rollouts/s counts whole rollouts, final test run
included; a test never asserts these times.

With --judge the reward is the one a training run gives under the default reward spec
(training.rewards.agents.AgentReward: the tests' pass share + the rule judge's style and
concision, weighted 0.1 each, on the code the rollout changed); without it, the tests alone.
`tests_pass_mean` is the tests' share either way.

    .venv/bin/python bench/agent_rollouts.py            # table
    .venv/bin/python bench/agent_rollouts.py --json     # table, then one JSON line last
    .venv/bin/python bench/agent_rollouts.py --judge --json
    .venv/bin/python bench/agent_rollouts.py --quick   # G 1, short turns, a policy on 2,000 lines: that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build(folder: Path, lines: int = 20_000) -> Path:
    from training.pretrain import PolicyConfig, build_policy, stdlib_corpus

    if not (folder / "config.json").exists():
        build_policy(folder, PolicyConfig(kind="dense", max_position=1024), stdlib_corpus(lines))
    return folder


def measure(engine: Any, G: int, max_tokens: int, budget: int, reward: Any = None) -> dict[str, Any]:
    from training.rewards.agents import SAMPLE_TASKS, run_agent_rollouts

    start = time.perf_counter()
    events = run_agent_rollouts(engine, SAMPLE_TASKS, G=G, max_turns=6, max_tokens=max_tokens, summary_budget=budget,
                                reward=reward)
    elapsed = time.perf_counter() - start
    agent = [e["agent"] for e in events]
    finish = [s.get("finish_reason") for e in events for s in e["steps"] if s["role"] == "assistant"]
    return {"rollouts": len(events), "seconds": round(elapsed, 2), "rollouts_per_s": round(len(events) / elapsed, 3),
            "turns": sum(a["turns"] for a in agent), "tool_calls": sum(a["tool_calls"] for a in agent),
            "summaries": sum(a["summaries"] for a in agent), "invalid_tool_calls": finish.count("invalid_tool_call"),
            "reward_mean": round(sum(a["reward"] for a in agent) / len(agent), 3),
            "tests_pass_mean": round(sum(a["tests_share"] for a in agent) / len(agent), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--G", type=int, default=4)
    parser.add_argument("--judge", action="store_true", help="reward: the tests + the default spec's rule judge")
    parser.add_argument("--quick", action="store_true", help="G 1, 16-token turns, a policy on 2,000 lines: that it runs")
    args = parser.parse_args()
    if args.quick:
        args.G = 1
    import torch

    torch.set_num_threads(1)
    from inference.engines import make_engine
    from inference.scripted import ScriptedEngine
    from training.rewards.agents import AgentReward, scripted_agent
    from training.rewards.judges import make_judge

    reward = AgentReward(judge=make_judge({"kind": "rule", "aspects": ["style", "concision"]}),
                         aspects=(("style", 0.1), ("concision", 0.1))) if args.judge else None
    folder = build(ROOT / "var" / ("bench-agent-policy-quick" if args.quick else "bench-agent-policy"),
                   2_000 if args.quick else 20_000)
    tiny = make_engine("torch", folder, version=1, max_model_len=1024, seed=0)
    rows = {"scripted": measure(ScriptedEngine(tiny, scripted_agent), args.G, 96, 4096, reward),
            "tiny policy": measure(tiny, args.G, 16 if args.quick else 48, 768, reward)}
    tiny.close()
    keys = list(next(iter(rows.values())))
    print(f"{'policy':<12} " + " ".join(f"{k:>18}" for k in keys))
    for name, row in rows.items():
        print(f"{name:<12} " + " ".join(f"{row[k]!s:>18}" for k in keys))
    if args.json:
        print(json.dumps({"bench": "agent_rollouts", "G": args.G, "tasks": 2, "judge": args.judge, "quick": args.quick,
                          **{name.replace(" ", "_"): row for name, row in rows.items()}}))


if __name__ == "__main__":
    main()
