"""Numerics kernels for Flywheel (plain torch, optional Triton; never Django).

- `kernels.logprobs`: chunked selective log-softmax (log-prob of chosen ids).
- `kernels.batch_invariant`: matmul / log_softmax / rms_norm whose per-row result does not
  depend on batch size or position, and `batch_invariant_mode()` to route a model through them.
- `kernels.triton_ops`: the same ops as Triton kernels for GPU (import guarded).
- `kernels.delta`: lossless XOR + byte-plane + zstd checkpoint delta codec.

Import the submodules directly. This file stays empty on purpose: `import transformers` probes
for Hugging Face's own `kernels` package by importing the name `kernels`, which finds this one.
It must import cheaply, never import transformers, and never define `__version__` (with a
version, transformers would take it for the hub package and import names that don't exist here).

Tests: `.venv/bin/python -m pytest tests/kernels -q -p no:django`
"""
