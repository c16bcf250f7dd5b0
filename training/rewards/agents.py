"""Sandboxed agent rollouts: "make these tests pass" tasks played by the policy with the tools
read_file, write_file and run_tests, G rollouts per task through one engine, rewarded by the tests.

Each rollout has its own throwaway work dir (a host temp dir mirroring its files); every tool call
runs inside a fresh bubblewrap sandbox (training/rewards/sandbox.py) that is handed the rollout's
files, does the one operation and hands the files back: the policy's code never runs outside it.
The G rollouts of a task step in lockstep, one `engine.generate` per turn for all still running.

Self-summarization: when a rollout's context exceeds `summary_budget` tokens, the policy is asked
for a summary (a user step asking for it, then the summary as an assistant step marked
`summary: true`), and the summary replaces the earlier turns in its context: the task prompt,
then the summary, then what follows. The summary is a trained turn like any other, so the outcome
reinforces summaries that kept what mattered.

The outcome is sent as the last assistant turn's step `reward`, so reward-to-go gives it to every
turn (docs/agents.md). It is `AgentReward.score`: the tests' weight times the share of the task's
tests that pass on the final files, plus the judge's aspects (the project's reward spec: each
aspect's weight times its score) on the code the rollout changed. `AgentReward()` is the tests
alone.

    .venv/bin/python bench/agent_rollouts.py --json
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inference.tools import SUMMARY_REQUEST, answer_of
from training.rewards.judges import Judge
from training.rewards.sandbox import SandboxLimits, run_script

if TYPE_CHECKING:
    from inference.engines import Engine

MAX_FILE_CHARS = 20_000
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the work dir.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write a file of the work dir.",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string"}, "content": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run the task's tests.",
                                      "parameters": {"type": "object", "properties": {}}}},
]

# Runs inside the sandbox: the rollout's files into the work dir, one operation, files back out.
_TOOL_SCRIPT = r'''
import json
files, op, args, tests = json.loads({payload!r})
for name, text in files.items():
    with open(name, "w") as f:
        f.write(text)
def run_tests():
    passed, failed, notes = 0, 0, []
    source = files.get(tests, "")
    scope = {{}}
    for name in sorted(files):
        if name.endswith(".py") and name != tests:
            try:
                exec(compile(files[name], name, "exec"), scope)
            except BaseException as exc:
                notes.append(f"{{name}}: {{type(exc).__name__}}: {{exc}}")
    for line in [l for l in source.splitlines() if l.strip().startswith("assert")]:
        try:
            exec(line.strip(), dict(scope))
            passed += 1
        except BaseException as exc:
            failed += 1
            notes.append(f"FAILED {{line.strip()}}: {{type(exc).__name__}}")
    return passed, failed, notes
result = ""
if op == "read_file":
    path = str(args.get("path", ""))
    result = open(path).read() if path in files else f"no such file: {{path}}"
elif op == "write_file":
    path, text = str(args.get("path", "")), str(args.get("content", ""))
    if "/" in path or path.startswith(".") or not path:
        result = "refused: write a file of the work dir by its plain name"
    else:
        files[path] = text
        result = f"wrote {{len(text)}} characters to {{path}}"
elif op == "run_tests":
    p, f, notes = run_tests()
    result = json.dumps({{"passed": p, "failed": f, "notes": notes[:5]}})
else:
    result = f"unknown tool {{op}}"
print(json.dumps({{"files": files, "result": result}}))
'''


@dataclass(frozen=True)
class AgentTask:
    """Files to fix and a tests file of `assert` lines that should pass."""

    name: str
    instruction: str
    files: dict[str, str]
    tests: str = "test_task.py"


SAMPLE_TASKS = [
    AgentTask("add", "Make the tests in test_task.py pass by fixing calc.py.",
              {"calc.py": "def add(a, b):\n    return a - b\n",
               "test_task.py": "assert add(1, 2) == 3\nassert add(0, 0) == 0\nassert add(-1, 1) == 0\n"}),
    AgentTask("double", "Make the tests in test_task.py pass by fixing twice.py.",
              {"twice.py": "def double(x):\n    return x\n",
               "test_task.py": "assert double(2) == 4\nassert double(0) == 0\n"}),
]


@dataclass(frozen=True)
class AgentReward:
    """A rollout's reward: `tests_weight` x (share of the tests passing on its final files) + for
    each judged aspect, its weight x its score in [0, 1] (an aspect the judge could not score is
    left out, as for live trajectories). The judge reads the code the rollout changed (the final
    text of every file that differs from the task's, by name), or its last answer when it changed
    nothing. Without a judge or aspects it is the tests' share alone (times `tests_weight`)."""

    tests_weight: float = 1.0
    judge: Judge | None = None
    aspects: tuple[tuple[str, float], ...] = ()  # (aspect name, weight), as in the reward spec

    def score(self, share: float, judged: str, instruction: str) -> tuple[float, dict[str, float]]:
        scores = {}
        if self.judge is not None and self.aspects:
            scores = self.judge.judge(instruction, judged, {}).values()
        return agent_reward(share, self.tests_weight, scores, self.aspects)


def agent_reward(share: float, tests_weight: float, scores: Mapping[str, float | None],
                 aspects: Sequence[tuple[str, float]]) -> tuple[float, dict[str, float]]:
    """(total, components): {"tests": tests_weight * share, "aspect:NAME": weight * score, ...}."""
    components = {"tests": tests_weight * share}
    for name, weight in aspects:
        if scores.get(name) is not None:
            components[f"aspect:{name}"] = weight * float(scores[name])  # type: ignore[arg-type]
    return sum(components.values()), components


def judged_text(task: AgentTask, files: Mapping[str, str], answer: str) -> str:
    """What the judge reads: the final text of the files the rollout changed, else its answer."""
    changed = [files[name] for name in sorted(files) if files[name] != task.files.get(name)]
    return "\n".join(changed) if changed else answer


@dataclass
class Rollout:
    task: AgentTask
    index: int
    workdir: Path
    files: dict[str, str]
    messages: list[dict[str, Any]]
    steps: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    summaries: int = 0
    tool_calls: int = 0
    version: int | None = None
    prompt_token_ids: list[int] | None = None

    def call(self, name: str, arguments: dict[str, Any], limits: SandboxLimits) -> str:
        """One tool call inside a fresh sandbox; the rollout's files come back out."""
        payload = json.dumps([self.files, name, arguments, self.task.tests])
        run = run_script(_TOOL_SCRIPT.format(payload=payload), limits)
        try:
            out = json.loads(run.output.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return f"the tool failed (exit code {run.exit_code}): {run.output[-500:]}"
        self.files = {k: str(v)[:MAX_FILE_CHARS] for k, v in out["files"].items()}
        for path, text in self.files.items():  # the throwaway mirror, for a person to look into
            (self.workdir / path).write_text(text)
        return str(out["result"])[:MAX_FILE_CHARS]


def run_agent_rollouts(engine: Engine, tasks: Sequence[AgentTask], G: int, *, max_turns: int = 8,
                       max_tokens: int = 96, summary_budget: int = 384, seed: int = 0,
                       limits: SandboxLimits | None = None, reward: AgentReward | None = None
                       ) -> list[dict[str, Any]]:
    """G rollouts per task; returns them as trajectory events (feedback_ingest's contract), each
    with `extra.agent` = {reward, tests_share, components, passed, failed, turns, tool_calls,
    summaries}. Same engine weights and seed: same rollouts (the gate's common random numbers)."""
    limits = limits or SandboxLimits(wall_s=10.0, cpu_s=5)
    reward = reward or AgentReward()
    batch = uuid.uuid4().hex[:12]
    events = []
    for t, task in enumerate(tasks):
        rollouts = [_start(task, k) for k in range(G)]
        try:
            for turn in range(max_turns):
                live = [r for r in rollouts if not r.done]
                if not live:
                    break
                _compact(engine, live, summary_budget, max_tokens, seed + 7919 * turn + 104729 * t)
                _turn(engine, live, max_tokens, seed + 7919 * turn + 104729 * t + 1, limits)
            events += [_event(r, batch, limits, reward) for r in rollouts]
        finally:
            for r in rollouts:
                shutil.rmtree(r.workdir, ignore_errors=True)
    return events


def _start(task: AgentTask, index: int) -> Rollout:
    workdir = Path(tempfile.mkdtemp(prefix=f"flywheel-agent-{task.name}-"))
    return Rollout(task, index, workdir, dict(task.files), [{"role": "user", "content": _prompt(task)}])


def _ids(engine: Engine, messages: list[dict[str, Any]]) -> list[int]:
    return list(engine.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))


def _generate(engine: Engine, prompts: list[list[int]], max_tokens: int, seed: int) -> list[Any]:
    from inference.engines import SamplingParams  # imported here: it imports torch

    return engine.generate(prompts, n=1, sampling=SamplingParams(max_tokens=max_tokens, seed=seed))


def _assistant_step(completion: Any, **more: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": completion.text, "token_ids": completion.token_ids,
            "logprobs": completion.logprobs, "prompt_token_ids": completion.prompt_token_ids,
            "policy_version": completion.version, **more}


def _compact(engine: Engine, live: list[Rollout], budget: int, max_tokens: int, seed: int) -> None:
    """Rollouts whose next context is over `budget` tokens summarize first (one generate call)."""
    over = [r for r in live if len(_ids(engine, r.messages)) + max_tokens > budget and len(r.messages) > 1]
    if not over:
        return
    asks = [[*r.messages, {"role": "user", "content": SUMMARY_REQUEST}] for r in over]
    for r, ask, c in zip(over, asks, _generate(engine, [_ids(engine, a) for a in asks], max_tokens, seed),
                         strict=True):
        r.steps += [{"role": "user", "content": SUMMARY_REQUEST},
                    _assistant_step(c, content=c.text, summary=True)]
        r.messages = [ask[0], {"role": "assistant", "content": c.text}]  # the task, then the summary
        r.summaries += 1


def _turn(engine: Engine, live: list[Rollout], max_tokens: int, seed: int, limits: SandboxLimits) -> None:
    prompts = [_ids(engine, r.messages) for r in live]
    for r, c in zip(live, _generate(engine, prompts, max_tokens, seed), strict=True):
        trajectory_id = f"traj_{uuid.uuid4().hex}"
        answer = answer_of(TOOLS, c.text, c.finish_reason, trajectory_id)
        message: dict[str, Any] = {"role": "assistant", "content": answer.content}
        step = _assistant_step(c, content=answer.content, finish_reason=answer.finish_reason)
        if answer.tool_calls:
            message["tool_calls"] = step["tool_calls"] = answer.tool_calls
        r.messages.append(message)
        r.steps.append(step)
        r.version = c.version
        if not answer.tool_calls:
            r.done = True
            continue
        for call in answer.tool_calls:
            result = r.call(call["function"]["name"], json.loads(call["function"]["arguments"]), limits)
            r.tool_calls += 1
            r.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
            r.steps.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def _event(r: Rollout, batch: str, limits: SandboxLimits, scorer: AgentReward) -> dict[str, Any]:
    tests = json.loads(r.call("run_tests", {}, limits) or "{}") if r.steps else {"passed": 0, "failed": 0}
    total = tests.get("passed", 0) + tests.get("failed", 0)
    share = tests.get("passed", 0) / total if total else 0.0
    last = max((i for i, s in enumerate(r.steps) if s["role"] == "assistant"), default=None)
    answer = r.steps[last]["content"] if last is not None else ""
    reward, components = scorer.score(share, judged_text(r.task, r.files, answer), r.task.instruction)
    if last is not None:
        r.steps[last]["reward"] = reward
    turns = sum(s["role"] == "assistant" for s in r.steps)
    return {
        "type": "trajectory", "id": f"agent-{batch}-{r.task.name}-{r.index}", "policy_version": r.version,
        "source": "simulated", "task": f"agent:{r.task.name}", "group": f"agent-{batch}-{r.task.name}",
        "prompt": [{"role": "user", "content": _prompt(r.task)}],
        "steps": r.steps,
        "agent": {"reward": reward, "tests_share": share, "components": components,
                  "passed": tests.get("passed", 0), "failed": tests.get("failed", 0), "turns": turns, "tool_calls": r.tool_calls, "summaries": r.summaries},
    }


def _prompt(task: AgentTask) -> str:
    return f"{task.instruction}\nFiles: {', '.join(sorted(task.files))}."


# --------------------------------------------------------------------------------- the scripted agent

FIXES = {"calc.py": "def add(a, b):\n    return a + b\n", "twice.py": "def double(x):\n    return 2 * x\n"}


def _tool_call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def scripted_agent(prompt: str) -> str:
    """The deterministic agent of the plumbing tests and the bench (inference/scripted.py): read
    the file, write the fix, run the tests, say so; summarize when asked."""
    if prompt.endswith(SUMMARY_REQUEST + "<|im_end|>\n<|im_start|>assistant\n"):
        return "Summary: I read the file."
    if "Summary:" in prompt:
        return "Stopping here."
    target = next(name for name in FIXES if re.search(rf"\b{re.escape(name)}\b", prompt))
    step = prompt.count("<|im_start|>tool")
    return [_tool_call("read_file", path=target), _tool_call("write_file", path=target, content=FIXES[target]),
            _tool_call("run_tests"), "All tests pass."][min(step, 3)]
