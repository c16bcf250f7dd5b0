"""Selective log-softmax vs its plain-torch reference: values, gradients, memory.

Run: `.venv/bin/python -m pytest tests/kernels/test_logprobs.py -q`
"""

from __future__ import annotations

import pytest
import torch

from kernels.logprobs import peak_allocated_bytes, selective_log_softmax, selective_log_softmax_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "chunk"), [((3, 17, 50), 1), ((2, 33, 1000), 7), ((65, 4096), 512), ((5, 9), 1024)])
def test_it_matches_the_reference_values_and_gradients(dtype: torch.dtype, shape: tuple[int, ...], chunk: int) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    logits = (torch.randn(shape, generator=g) * 4).to(dtype).requires_grad_()
    ids = torch.randint(0, shape[-1], shape[:-1], generator=g)
    ours = selective_log_softmax(logits, ids, chunk_size=chunk)
    ref = selective_log_softmax_reference(logits, ids)
    assert ours.dtype == torch.float32 and ours.shape == ids.shape
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    upstream = torch.randn(ids.shape, generator=g)
    (g_ours,) = torch.autograd.grad(ours, logits, upstream)
    (g_ref,) = torch.autograd.grad(ref, logits, upstream)
    torch.testing.assert_close(g_ours.float(), g_ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


def test_it_never_materialises_the_full_log_softmax() -> None:
    logits = torch.randn(4, 256, 2048).to(torch.bfloat16)  # (B, T, V)
    ids = torch.randint(0, 2048, (4, 256))
    full_fp32 = logits.numel() * 4
    ours = peak_allocated_bytes(lambda: selective_log_softmax(logits, ids, chunk_size=64))
    ref = peak_allocated_bytes(lambda: selective_log_softmax_reference(logits, ids))
    assert ref >= full_fp32
    assert ours <= 64 * 2048 * 4 * 4 < full_fp32 / 2  # a few (chunk, V) fp32 buffers


def test_it_rejects_ids_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match="ids shape"):
        selective_log_softmax(torch.randn(2, 3, 10), torch.zeros(2, dtype=torch.long))
