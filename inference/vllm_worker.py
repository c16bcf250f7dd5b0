"""The sampled token's log-prob, gathered without a compiled kernel call: loaded into each vLLM worker
of a Flywheel engine (`worker_extension_cls`, so vLLM imports this module in every worker process).

Every completion Flywheel serves or rolls out is recorded with the log-prob of each token it
sampled (`logprobs=0`: the sampled token's alone). vLLM's sampler gathers it in `gather_logprobs`,
which also ranks the token against the whole vocabulary through a `torch.compile`d function
(`batched_count_greater_than`).
On CPU each call of that function pays TorchDynamo's guard checks and the symbolic-shape marking
of its inputs, once per engine step, whatever the batch: on the tiny policy served to 16
concurrent clients it was the largest part of what asking for log-probs cost an engine step.

`gather_logprobs` here is vLLM's, step for step, when only the sampled token's log-prob is asked
for on CPU: the same gather, the same rank (tokens at least as likely, the token itself included),
the same dtypes, computed by plain tensor ops. Any other call (top-k log-probs, another device)
goes to vLLM's own.

A seeded request whose prompt is prefilled in chunks (longer than a step's token budget, or many
prompts at once) samples a token after each partial step that vLLM discards, rewinding the
request's generator with `Generator.set_offset`. A CPU generator has no offset: on the CPU build
that call raised "CPU Generator does not use offset" and killed the engine with every request in
flight. Here the runner keeps such a generator's state before it samples and restores it instead,
so the request samples what it would have after a prefill in one step
(tests/inference/test_vllm_chunked_seeds.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.outputs import LogprobsLists, LogprobsTensors
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from inference import vllm_lora_ops
from inference.vllm_lists import SentLogprobsLists

_vllms_sample_tokens = GPUModelRunner.sample_tokens
_vllms_bookkeeping_sync = GPUModelRunner._bookkeeping_sync

_vllms_gather_logprobs = Sampler.gather_logprobs


class _SampledTokenLogprobs(LogprobsTensors):
    """vLLM's tensors of the sampled tokens' log-probs, with the lists vLLM's runner asks for
    (`tolists`: numpy views of the same CPU tensors, sent to the engine core) made once, here:
    vLLM's own makes them with a `.cpu()` and a `.numpy()` per field. They are sent pickled as
    raw bytes (inference/vllm_lists.py)."""

    _lists: tuple[np.ndarray, np.ndarray, np.ndarray]

    def tolists(self, cu_num_generated_tokens: list[int] | None = None) -> LogprobsLists:
        if cu_num_generated_tokens is None:
            cu_num_generated_tokens = self.cu_num_generated_tokens
        return SentLogprobsLists(*self._lists, cu_num_generated_tokens)


# Up to this many values (rows x vocabulary) the rank is a bool sum, above it a float count.
BOOL_RANK_MAX = 8_192


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    if num_logprobs != 0 or logprobs.device.type != "cpu":
        return _vllms_gather_logprobs(logprobs, num_logprobs, token_ids)
    assert token_ids.dtype == torch.int64
    token_ids = token_ids.unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    # Each tensor call here costs 5-10 µs in an engine step (cold caches after the model's forward;
    # measured in place, 1 request in flight), so the small case takes the fewest calls.
    if logprobs.numel() <= BOOL_RANK_MAX:
        ranks = (logprobs >= token_logprobs).sum(-1)  # a bool sum is int64 already
    else:
        # The rank counted as a sum of floats: `(logprobs >= token_logprobs).sum(-1)` sums a bool
        # tensor, slower on CPU from about 8,000 values (16 x 2,048: 23 against 12 µs; 1 x 32,768:
        # 23 against 12; 16 x 32,768: 327 against 104; below, 2 µs faster at 1 x 2,048). The same
        # count: x - t >= 0 exactly when x >= t for a finite t (a float difference is 0 only between
        # equal floats), and the sampled token's log-prob is finite (a token of probability 0 is
        # never drawn).
        ranks = (logprobs - token_logprobs).ge_(0).sum(-1).long()
    out = _SampledTokenLogprobs(token_ids.to(torch.int32), token_logprobs, ranks)
    out._lists = (out.logprob_token_ids.numpy(), token_logprobs.numpy(), ranks.numpy())
    return out


def _partial(runner: Any) -> list[int]:
    """Rows of this step's batch whose prefill is not finished (their sampled token is discarded)."""
    return [int(i) for i in np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]]


def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's, with each partially prefilled request's CPU generator state kept before it samples."""
    self._flywheel_rewind = {}
    if self.execute_model_state is not None:
        for i in _partial(self):
            gen = self.input_batch.generators.get(i)
            if gen is not None and gen.device.type == "cpu":
                self._flywheel_rewind[i] = (gen, gen.get_state())
    try:
        return _vllms_sample_tokens(self, *args, **kwargs)
    finally:
        self._flywheel_rewind = {}


def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
    """vLLM's, rewinding a partially prefilled request's CPU generator by its state (vLLM rewinds
    by `set_offset`, which a CPU generator refuses): the generator is held out of the batch while
    vLLM's rewind loop runs and put back as it was before the discarded draw."""
    rewind = getattr(self, "_flywheel_rewind", {})
    generators = self.input_batch.generators
    for i, (gen, state) in rewind.items():
        if generators.get(i) is gen:
            gen.set_state(state)
            del generators[i]
    try:
        return _vllms_bookkeeping_sync(self, *args, **kwargs)
    finally:
        for i, (gen, _) in rewind.items():
            generators.setdefault(i, gen)


class SampledLogprobs:
    """The worker extension vLLM mixes into its worker class: it adds no calls, its import
    installs `gather_logprobs`, the CPU LoRA ops (inference/vllm_lora_ops.py) and the CPU
    generators' rewind after a partial prefill in this worker process."""


Sampler.gather_logprobs = staticmethod(gather_logprobs)
vllm_lora_ops.install()
GPUModelRunner.sample_tokens = sample_tokens
GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
