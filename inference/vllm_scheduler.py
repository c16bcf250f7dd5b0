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

When every request of a step that asks for log-probs is held (the serving process's usual case),
vLLM is not handed the step's log-prob arrays at all, so it does not slice them per request; each
held request keeps its own row's values (token id, log-prob, rank) as plain numbers, and its array
is built once, at its end. Measured on the tiny policy with 16 requests in flight: the engine
core's `update_from_output` cost 53 µs a step more with log-probs than without, sliced per request.

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

# One held position: its token id, log-prob and rank; each of the first two a row [1 + top-k] when
# the step's arrays are wider than the sampled token's own column.
Position = tuple[int | list[int], float | list[float], int]


def _rows(a: LogprobsLists) -> list[Position]:
    ids, logprobs = a.logprob_token_ids, a.logprobs
    if ids.shape[1] == 1:  # only the sampled token's (logprobs=0, every served request): scalars
        ids, logprobs = ids.ravel(), logprobs.ravel()
    return list(zip(ids.tolist(), logprobs.tolist(), a.sampled_token_ranks.tolist(), strict=True))


def _dtypes(a: LogprobsLists) -> tuple[Any, Any, Any]:
    return a.logprob_token_ids.dtype, a.logprobs.dtype, a.sampled_token_ranks.dtype


def _column(values: tuple[Any, ...], dtype: Any) -> np.ndarray:
    if all(not isinstance(v, list) for v in values):
        return np.array(values, dtype=dtype).reshape(-1, 1)
    return np.array([v if isinstance(v, list) else [v] for v in values], dtype=dtype)


class _Held:
    """A held request's positions so far, in order, and the dtypes of vLLM's arrays."""

    __slots__ = ("positions", "dtypes")

    def __init__(self) -> None:
        self.positions: list[Position] = []
        self.dtypes: tuple[Any, Any, Any] | None = None

    def add_lists(self, lists: LogprobsLists) -> None:
        """Positions from a LogprobsLists of this request alone (vLLM's per-request slice)."""
        self.dtypes = self.dtypes or _dtypes(lists)
        self.positions += _rows(lists)

    def lists(self) -> LogprobsLists | None:
        if not self.positions:
            return None
        ids, logprobs, ranks = zip(*self.positions, strict=True)
        id_dtype, logprob_dtype, rank_dtype = self.dtypes  # type: ignore[misc]
        return LogprobsLists(_column(ids, id_dtype), _column(logprobs, logprob_dtype),
                             np.array(ranks, dtype=rank_dtype), None)


class _Step:
    """One step's log-prob arrays, as plain numbers per row (made on first use)."""

    __slots__ = ("arrays", "rows", "dtypes")

    def __init__(self, arrays: LogprobsLists) -> None:
        self.arrays = arrays
        self.rows: list[Position] | None = None
        self.dtypes = _dtypes(arrays)

    def take(self, held: _Held, row: int, count: int) -> None:
        if self.rows is None:
            self.rows = _rows(self.arrays)
        held.dtypes = held.dtypes or self.dtypes
        if count == 1:
            held.positions.append(self.rows[row])
        else:
            held.positions += self.rows[row:row + count]


class HeldLogprobsScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._held: dict[str, _Held] = {}
        self._per_step: set[str] = set()  # live requests that take their log-probs each step

    def add_request(self, request: Any) -> None:
        new = request.request_id not in self.requests
        super().add_request(request)
        params = request.sampling_params
        if not new or params is None or params.num_logprobs is None:
            return
        if params.extra_args and params.extra_args.get(HOLD_LOGPROBS):
            self._held[request.request_id] = _Held()
        else:
            self._per_step.add(request.request_id)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        arrays = model_runner_output.logprobs
        # No request of this step takes its log-probs now: vLLM is not given them to slice.
        step = None
        if arrays is not None and not self._per_step and arrays.cu_num_generated_tokens is None:
            step = _Step(arrays)
            model_runner_output.logprobs = None
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            if step is not None:
                model_runner_output.logprobs = arrays
        if not self._held:
            return outputs
        rows = model_runner_output.req_id_to_index
        for client_outputs in outputs.values():
            for out in client_outputs.outputs:
                held = self._held.get(out.request_id)
                if held is None:
                    continue
                if step is not None:
                    if out.new_token_ids:
                        step.take(held, rows[out.request_id], len(out.new_token_ids))
                elif out.new_logprobs is not None:
                    held.add_lists(out.new_logprobs)
                if out.finish_reason is None:
                    out.new_logprobs = None
                else:
                    del self._held[out.request_id]
                    out.new_logprobs = held.lists()
        return outputs

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        aborted = super().finish_requests(request_ids, finished_status)
        for request in aborted:
            self._held.pop(request.request_id, None)
        return aborted

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._per_step.discard(request.request_id)
        return super()._free_request(request, *args, **kwargs)
