"""A scripted policy: deterministic answers with real token ids and behaviour log-probs.

The tiny policy is a poor agent (it rarely writes a well-formed tool call), so the agent
plumbing (tool calls through the serving endpoint, conversations, sandboxed rollouts) is tested
with a script that decides *what* is answered, while the wrapped torch engine scores it: the
token ids are the tokenizer's, the log-probs are the policy's own for those tokens in that
context, bit for bit what the trainer recomputes. Everything after the answer's text is real.

    .venv/bin/python -m pytest tests/inference/test_tools.py -q
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inference.engines import Completion, Engine, SamplingParams, TorchEngine, WeightsSource

Script = Callable[[str], str]  # the decoded prompt -> the answer's text


class ScriptedEngine(Engine):
    def __init__(self, inner: TorchEngine, script: Script) -> None:
        super().__init__(inner.model_dir, inner.version)
        self.inner, self.script = inner, script

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def version(self) -> int:
        return self.inner.version

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[Completion]:
        out = []
        for i, prompt in enumerate(prompts):
            text = self.script(self.tokenizer.decode(prompt))
            toks = self.encode(text) + [min(self.inner.eos_ids)]  # the turn ends as the policy's would
            logprobs, routing = self.inner.score(prompt, toks, sampling)
            out += [Completion(i, list(prompt), toks, logprobs, "stop", text, self.version, routing) for _ in range(n)]
        return out

    def load_weights(self, source: WeightsSource, version: int) -> None:
        self.inner.load_weights(source, version)

    def _load_weights(self, source: WeightsSource) -> None:
        self.inner.load_weights(source, self.inner.version)

    def _close(self) -> None:
        self.inner.close()
