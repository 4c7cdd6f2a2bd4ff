#!/usr/bin/env bash
# GPU acceptance check for the fused LayerNorm (issue 4); at most 5 minutes.
# Usage, from the repository root:  bash benchmarks/gpu_norm_check.sh [--out path.json]
# Writes gpu_norm_check.json to $OUT (if set) or the current directory; exit 0 = all checks pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
python -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'" || { echo "needs torch with CUDA and triton"; exit 2; }
timeout 290 python benchmarks/gpu_norm_check.py "$@"
status=$?
[ $status -eq 124 ] && echo "gpu_norm_check: timed out after 290 s"
exit $status
