"""The sampled tokens' log-prob lists as a vLLM worker sends them to its engine core, pickled as
raw bytes.

Each engine step the worker process pickles its output for the engine core (vLLM's shared-memory
message queue) and the engine core unpickles it. With log-probs asked, that output carries three
small numpy arrays (token ids, log-probs, ranks): numpy pickles each one through its dtype and
array reconstructors, which cost 15 µs to pickle and 10 µs to unpickle a step's three arrays
(1 row or 64 alike, warm; more in an engine step), five times what the rest of the output costs.
`SentLogprobsLists` is vLLM's `LogprobsLists` pickled as each array's bytes, dtype and width; the
engine core gets vLLM's own `LogprobsLists` back, the same values, dtypes and shapes, writable
(`lists_from_bytes`). This module has no side effects, so unpickling it in the engine core imports
nothing more than numpy and vLLM's output types.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.outputs import LogprobsLists


def lists_from_bytes(ids: bytearray, logprobs: bytearray, ranks: bytearray, width: int,
                     dtypes: tuple[str, str, str], cu_num_generated_tokens: list[int] | None) -> LogprobsLists:
    """vLLM's LogprobsLists from what `SentLogprobsLists` pickled."""
    return LogprobsLists(np.frombuffer(ids, dtype=dtypes[0]).reshape(-1, width),
                         np.frombuffer(logprobs, dtype=dtypes[1]).reshape(-1, width),
                         np.frombuffer(ranks, dtype=dtypes[2]), cu_num_generated_tokens)


class SentLogprobsLists(LogprobsLists):
    """vLLM's LogprobsLists, pickled as raw bytes (unpickled as vLLM's own LogprobsLists)."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        ids, logprobs, ranks, cu = self
        # bytearrays: the arrays unpickle writable, as numpy's own pickling gives them
        return (lists_from_bytes, (bytearray(ids.tobytes()), bytearray(logprobs.tobytes()),
                                   bytearray(ranks.tobytes()), ids.shape[1],
                                   (ids.dtype.str, logprobs.dtype.str, ranks.dtype.str), cu))
