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
"""

from __future__ import annotations

import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.sampler import Sampler

_vllms_gather_logprobs = Sampler.gather_logprobs


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    if num_logprobs != 0 or logprobs.device.type != "cpu":
        return _vllms_gather_logprobs(logprobs, num_logprobs, token_ids)
    assert token_ids.dtype == torch.int64
    token_ids = token_ids.unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(-1)
    return LogprobsTensors(token_ids.to(torch.int32), token_logprobs, ranks)


class SampledLogprobs:
    """The worker extension vLLM mixes into its worker class: it adds no calls, its import
    installs `gather_logprobs` in this worker process."""


Sampler.gather_logprobs = staticmethod(gather_logprobs)
