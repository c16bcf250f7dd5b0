"""The serving engine's held log-probs (inference/vllm_scheduler.py): a request read only at its end
gets every sampled token's log-prob with its last token, equal to what vLLM sends step by step.

Held requests alone in the batch take the step's log-prob arrays without vLLM slicing them per
request; a batch that also holds a request taking its log-probs each step (a stop string, which
the serving process matches) goes through vLLM's per-request slices. Both are checked against
the per-step answer, and a held request that lives through both kinds of step. The frontend
folds a held request's log-probs in at once (inference/engines/patches.py): the same container
as vLLM's position-by-position fold.

    .venv/bin/python -m pytest tests/inference/test_vllm_held_logprobs.py -q
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.engines import SamplingParams
from inference.engines.base import Engine

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):"]
NEVER = ("\x00never\x00",)  # a stop string that never matches: the request takes its log-probs each step


@pytest.fixture(scope="module")
def engine(dense_dir: Path) -> Iterator[Engine]:
    from inference.engines import make_engine

    serving = make_engine("vllm-async", dense_dir, max_model_len=256)
    yield serving
    serving.close()


def _answers(completions) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in completions]


def test_held_log_probs_equal_the_per_step_ones(engine) -> None:
    held = SamplingParams(max_tokens=24, seed=5, ignore_eos=True)
    per_step = SamplingParams(max_tokens=24, seed=5, ignore_eos=True, stop=NEVER)
    a = engine.generate(PROMPTS, n=2, sampling=held)  # every request held: no per-request slices
    b = engine.generate(PROMPTS, n=2, sampling=per_step)
    assert [len(c.logprobs) for c in a] == [24] * 8
    assert _answers(a) == _answers(b)  # the same tokens and bitwise the same log-probs, in order


def test_a_held_request_through_mixed_and_held_alone_steps_keeps_every_position(engine) -> None:
    # The per-step requests end after 4 tokens: the held ones' first steps are shared with them
    # (vLLM slices), the rest are held alone (the step's arrays taken whole).
    held = SamplingParams(max_tokens=20, seed=7, ignore_eos=True)
    short = SamplingParams(max_tokens=4, seed=8, ignore_eos=True, stop=NEVER)

    async def both():
        return await asyncio.gather(engine.agenerate(PROMPTS, sampling=held),
                                    engine.agenerate(PROMPTS, sampling=short))

    mixed, shorts = asyncio.run(both())
    alone = engine.generate(PROMPTS, sampling=SamplingParams(max_tokens=20, seed=7, ignore_eos=True, stop=NEVER))
    assert [len(c.logprobs) for c in mixed] == [20] * 4 and [len(c.logprobs) for c in shorts] == [4] * 4
    assert _answers(mixed) == _answers(alone)


def test_the_frontends_fold_in_one_go_equals_vllms_position_by_position() -> None:
    import numpy as np
    from vllm.logprobs import FlatLogprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    from inference.engines.patches import patch_flat_sample_logprobs

    patch_flat_sample_logprobs()
    rng = np.random.default_rng(0)

    def arrays(count: int) -> LogprobsLists:
        return LogprobsLists(rng.integers(0, 2048, (count, 1), dtype=np.int32),
                             -rng.random((count, 1), dtype=np.float32) * 9,
                             rng.integers(1, 2048, count, dtype=np.int64), None)

    chunks = [arrays(1), arrays(37), arrays(5)]  # a position at a time, then all held at once
    ours, theirs = (LogprobsProcessor(None, FlatLogprobs(), None, 0.0, 0, None) for _ in range(2))
    for lists in chunks:
        ours._update_sample_logprobs(lists)
        LogprobsProcessor._vllms_update_sample_logprobs(theirs, lists)
    for name in ("start_indices", "end_indices", "token_ids", "logprobs", "ranks", "decoded_tokens"):
        a, b = getattr(ours.logprobs, name), getattr(theirs.logprobs, name)
        assert a == b and [type(x) for x in a] == [type(x) for x in b], name
    assert ours.cumulative_logprob == theirs.cumulative_logprob
    assert len(ours.logprobs) == 43


def test_held_positions_come_back_as_vllms_arrays_whatever_the_steps_width() -> None:
    # A position is kept as plain numbers: scalars when the step's arrays hold only the sampled
    # token's column (every served request), rows when a request in the batch asked for top-k.
    # Either way the request's arrays at its end are vLLM's: [positions, width], its dtypes.
    import numpy as np
    from vllm.v1.outputs import LogprobsLists

    from inference.vllm_scheduler import _Held, _Step

    rng = np.random.default_rng(1)

    def step(rows: int, width: int) -> LogprobsLists:
        return LogprobsLists(rng.integers(0, 2048, (rows, width), dtype=np.int32),
                             -rng.random((rows, width), dtype=np.float32) * 9,
                             rng.integers(1, 2048, rows, dtype=np.int64), None)

    narrow = [step(3, 1) for _ in range(4)]
    held = _Held()
    for i, arrays in enumerate(narrow):
        _Step(arrays).take(held, i % 3, 1)
    got = held.lists()
    want = [np.concatenate([a.logprob_token_ids[i % 3:i % 3 + 1] for i, a in enumerate(narrow)]),
            np.concatenate([a.logprobs[i % 3:i % 3 + 1] for i, a in enumerate(narrow)]),
            np.array([a.sampled_token_ranks[i % 3] for i, a in enumerate(narrow)])]
    for a, b in zip(got[:3], want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)

    wide, both = step(2, 3), _Held()
    _Step(wide).take(both, 0, 2)  # two positions of a request whose batch asked for top-2
    got = both.lists()
    assert got.logprob_token_ids.shape == (2, 3) and np.array_equal(got.logprobs, wide.logprobs)
    assert got.logprob_token_ids.dtype == np.int32 and got.logprobs.dtype == np.float32


def test_the_engines_processes_run_on_tcmalloc_and_this_one_keeps_its_malloc(engine) -> None:
    # vLLM's CPU guide: tcmalloc preloaded in the engine's processes (`make install` installs it).
    import os

    import psutil

    from inference.engines.vllm_async import engine_preload

    preload = engine_preload()
    assert preload, "no tcmalloc found: `make install` installs Debian's libtcmalloc-minimal4"

    def on_tcmalloc(process: psutil.Process) -> bool:
        return any("libtcmalloc" in Path(m.path).name for m in process.memory_maps())

    engine_processes = psutil.Process().children(recursive=True)
    assert len([p for p in engine_processes if on_tcmalloc(p)]) >= 2  # the engine core and its worker
    assert "libtcmalloc" not in os.environ.get("LD_PRELOAD", "")  # set only while the engine started
    assert not on_tcmalloc(psutil.Process())
