"""The probe checks and the batch-invariant matmul under every instruction-set setting this CPU runs.

ATen picks its kernels from ATEN_CPU_CAPABILITY, MKL from MKL_ENABLE_INSTRUCTIONS (MKL_CBWR=COMPATIBLE
forces its generic kernels), oneDNN from ONEDNN_MAX_CPU_ISA, each once per process, so each setting
runs `python -m tests.kernels.reorder` in a fresh interpreter. Settings above the CPU are left out
(read from torch's CPU checks): torch trusts ATEN_CPU_CAPABILITY, so avx512 on an AVX2-only CPU
dies of SIGILL, and MKL and oneDNN cap theirs at the CPU, which would only repeat a lower one.

Run: `.venv/bin/python -m pytest tests/kernels/test_probe_isa.py -q`
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ISA_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA")


def _supported(name: str) -> bool:
    return bool(getattr(torch.cpu, name, lambda: False)())


def _settings() -> list[dict[str, str]]:
    avx2, avx512 = _supported("_is_avx2_supported"), _supported("_is_avx512_supported")
    mkl, onednn = torch.backends.mkl.is_available(), torch.backends.mkldnn.is_available()
    settings: list[dict[str, str]] = [{}, {"ATEN_CPU_CAPABILITY": "default"}]
    settings += [{"ATEN_CPU_CAPABILITY": "avx2"}] if avx2 else []
    settings += [{"ATEN_CPU_CAPABILITY": "avx512"}] if avx512 else []
    settings += [{"MKL_CBWR": "COMPATIBLE"}] if mkl else []
    settings += [{"MKL_ENABLE_INSTRUCTIONS": "AVX2"}] if mkl and avx2 else []
    settings += [{"MKL_ENABLE_INSTRUCTIONS": "AVX512"}] if mkl and avx512 else []
    settings += [{"ONEDNN_MAX_CPU_ISA": "AVX2"}] if onednn and avx2 else []
    settings += [{"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}] if onednn and avx512 else []
    settings += [{"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}] if onednn and _supported("_is_avx512_bf16_supported") else []
    return settings


@pytest.mark.parametrize("setting", _settings(), ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "as_is")
def test_the_probe_checks_hold_under_each_isa_setting(setting: dict[str, str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ISA_VARS} | setting
    run = subprocess.run(
        [sys.executable, "-m", "tests.kernels.reorder"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1] == "ok", run.stdout
    if "ATEN_CPU_CAPABILITY" in setting:  # the setting took: torch reports it back
        assert f"cpu capability: {setting['ATEN_CPU_CAPABILITY'].upper()}" in run.stdout
