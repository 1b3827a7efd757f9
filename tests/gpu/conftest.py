"""Shared set-up of the real-GPU tests (CuPy on a CUDA device).

* ``tests/`` goes on ``sys.path`` so that these tests reuse the one gradient-check helper,
  ``tests/gradcheck.py`` (pytest puts only ``tests/gpu`` there for the files in this folder).
* Every module here skips itself, with :func:`mpidl.engine.backend.gpu_unavailable_reason` as the
  reason, where CuPy or a CUDA device is missing.
* ``MPIDL_GPU_TESTS_ON_CPU=1`` runs the modules that support it with the CPU backend standing
  in for the GPU. That checks the *test code* on a machine without a GPU (its arithmetic, its
  tolerances, its subprocess plumbing); it tests nothing about the GPU, and the checks that
  only mean something on a GPU (the kernel dispatch, device placement) skip themselves then.

Run: ``python -m pytest -q tests/gpu -rs`` (``jobs/gpu_check.sh`` does, on a GPU machine).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

#: environment variable that makes the CPU stand in for the GPU (a check of the test code)
ON_CPU_ENV = "MPIDL_GPU_TESTS_ON_CPU"


def tests_on_cpu() -> bool:
    """True under ``MPIDL_GPU_TESTS_ON_CPU=1`` (the CPU stands in for the GPU)."""
    return os.environ.get(ON_CPU_ENV, "").strip() == "1"


@pytest.fixture(scope="session")
def device() -> str:
    """``"gpu"``, or ``"cpu"`` under ``MPIDL_GPU_TESTS_ON_CPU=1``."""
    return "cpu" if tests_on_cpu() else "gpu"


@pytest.fixture
def only_on_gpu(device):
    """Skip a test whose check is meaningless when the CPU stands in for the GPU."""
    if device != "gpu":
        pytest.skip(f"{ON_CPU_ENV}=1: the CPU stands in for the GPU, nothing GPU-specific to check")
