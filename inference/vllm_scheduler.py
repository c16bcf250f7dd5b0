"""vLLM's scheduler, holding back the per-token log-probs of a request that is read only at its end.

A served completion is recorded with the log-prob of every token it sampled (the behaviour policy
the trainer corrects for). vLLM ships those per engine step: each step, for each request in the
batch, the engine core slices its log-prob arrays, encodes them and sends them to the serving
process, which decodes them and folds them into the request's output, although a request asked
with `RequestOutputKind.FINAL_ONLY` is read once, when it has finished.

`HeldLogprobsScheduler` (the async engine's `scheduler_cls`; vLLM builds it in the engine core
process) keeps a marked request's log-probs there and sends them with its last token, as one
array: the serving process assembles the same per-token list, in the same order. Only requests
whose `SamplingParams.extra_args` carry `HOLD_LOGPROBS` are held, and the engine marks only those
this process cannot end itself (no stop string, whose match the serving process finds); every
other request is untouched. A request that is aborted drops what was held for it.

It is used on CPU only (`inference.engines.vllm_async._scheduler`), where vLLM runs this synchronous scheduler
anyway; vLLM logs a warning at start-up for any custom scheduler class (its interface is not
public). On a GPU vLLM schedules asynchronously, which a custom class would turn off.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import LogprobsLists

HOLD_LOGPROBS = "flywheel_hold_logprobs"


def joined(parts: list[LogprobsLists]) -> LogprobsLists:
    """One LogprobsLists over consecutive positions, in order."""
    if len(parts) == 1:
        return parts[0]
    return LogprobsLists(np.concatenate([p.logprob_token_ids for p in parts]),
                         np.concatenate([p.logprobs for p in parts]),
                         np.concatenate([p.sampled_token_ranks for p in parts]), None)


class HeldLogprobsScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: dict[str, list[LogprobsLists]] = {}

    def _holds(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        params = request.sampling_params if request is not None else None
        return bool(params is not None and params.extra_args and params.extra_args.get(HOLD_LOGPROBS))

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                parts = self._held.get(out.request_id)
                if parts is None:
                    if out.new_logprobs is None or out.finish_reason is not None or not self._holds(out.request_id):
                        continue
                    parts = self._held[out.request_id] = []
                if out.new_logprobs is not None:
                    parts.append(out.new_logprobs)
                if out.finish_reason is None:
                    out.new_logprobs = None
                else:
                    del self._held[out.request_id]
                    out.new_logprobs = joined(parts) if parts else None
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        aborted = super().finish_requests(request_ids, finished_status)
        for request in aborted:
            self._held.pop(request.request_id, None)
        return aborted
