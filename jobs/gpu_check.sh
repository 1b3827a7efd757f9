#!/usr/bin/env bash
# bash jobs/gpu_check.sh
#
# The one short check on a real GPU machine (under 9 minutes): the GPU test suite, the
# one-step GPU benchmark (each case with im2col and with Winograd convolutions) and
# benchmarks/step.py on the GPU (mpidl on CuPy vs PyTorch CUDA). Run from anywhere; it works
# in the repository root. It installs
# nothing unless asked: GPU_CHECK_PIP="cupy-cuda12x numba-cuda[cu12]" bash jobs/gpu_check.sh first runs
# `pip install $GPU_CHECK_PIP` (that time is not part of the 9 minutes).
# Exit code 0 only when the tests pass AND the benchmark ran.

# Stop at the first failing command and at unset variables.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}

if [[ -n "${GPU_CHECK_PIP:-}" ]]; then
    # Unquoted on purpose: the variable may name several packages.
    # shellcheck disable=SC2086
    "$PYTHON" -m pip install -q $GPU_CHECK_PIP
fi

# What hardware and driver the results below come from (absent on CPU-only machines).
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi
else
    echo "gpu_check: nvidia-smi not found (no NVIDIA driver on PATH)"
fi

# Without a usable GPU every test skips and the benchmark only says so: fail, and say why.
reason=$("$PYTHON" -c 'from mpidl.engine.backend import gpu_unavailable_reason as r; print(r() or "")')
if [[ -n "$reason" ]]; then
    echo "gpu_check: no usable GPU: $reason" >&2
    exit 1
fi

# Time limits per step keep the whole check under 9 minutes even if something hangs
# (first CuPy use compiles kernels, so the tests get most of the budget).
status=0
echo "gpu_check: python -m pytest -q -rs tests/gpu"
timeout 180 "$PYTHON" -m pytest -q -rs tests/gpu || status=$?

# The benchmark comes from another part of the project; its absence is a failure to report,
# not a reason to skip silently.
if [[ ! -f benchmarks/gpu_step.py ]]; then
    echo "gpu_check: benchmarks/gpu_step.py is missing, no GPU benchmark to run" >&2
    exit 1
fi
echo "gpu_check: python benchmarks/gpu_step.py"
timeout 150 "$PYTHON" benchmarks/gpu_step.py || status=$?
# One training step of every twinned model, mpidl on CuPy against PyTorch CUDA (fresh process
# each; one round to stay within the time limit): benchmarks/results/step_gpu.md.
echo "gpu_check: python benchmarks/step.py --device gpu --rounds 1 --kinds api,torch"
# six models x two kinds, a fresh process each: about 2x what three models took
timeout 300 "$PYTHON" benchmarks/step.py --device gpu --rounds 1 --kinds api,torch --timeout 120 || status=$?

if [[ $status -ne 0 ]]; then
    echo "gpu_check: FAILED (exit code $status)" >&2
fi
exit "$status"
