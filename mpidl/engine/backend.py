"""The array backend: NumPy on the CPU, CuPy on a CUDA GPU.

Every piece of array code in mpidl is written once against ``xp``, the module returned by
:func:`get_array_module` (``numpy`` or ``cupy``), never against ``numpy`` directly, so the
same layer runs on both devices (the idiom of Chainer's ``backend.get_array_module``).

A :class:`Backend` bundles the three choices a run makes once: the device, the array module
and the floating-point dtype (float32 by default, float64 for gradient checks and exact
equivalence tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

DTYPES = {"float32": np.float32, "float64": np.float64}
DEVICES = ("cpu", "gpu")


def cupy_or_none():
    """Return the ``cupy`` module if it imports and sees at least one CUDA device, else None."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # ImportError, or a CUDA runtime error on a machine without a GPU
        return None


def gpu_unavailable_reason() -> str | None:
    """Why the GPU backend cannot be used here (None when it can). Used by tests to skip."""
    try:
        import cupy  # noqa: PLC0415
    except Exception as exc:  # pragma: no cover - depends on the machine
        return f"CuPy is not installed ({exc.__class__.__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # pragma: no cover
        return f"CuPy finds no CUDA runtime/device ({exc})"
    return None if n > 0 else "CuPy sees no CUDA device"


def get_array_module(x: Any):
    """``cupy`` if ``x`` is a CuPy array, else ``numpy`` (for writing device-agnostic code)."""
    if type(x).__module__.startswith("cupy"):
        import cupy  # noqa: PLC0415

        return cupy
    return np


def is_device_array(x: Any) -> bool:
    """True for a CuPy (GPU) array."""
    return type(x).__module__.startswith("cupy")


def to_host(x: Any) -> np.ndarray:
    """Copy an array to host memory as a NumPy array (no copy when it already is one)."""
    if is_device_array(x):
        return x.get()
    return np.asarray(x)


@dataclass(frozen=True)
class Backend:
    """The device, the array module ``xp`` and the default floating dtype of one run."""

    device: str = "cpu"
    dtype: Any = np.float32

    @property
    def xp(self):
        if self.device == "gpu":
            import cupy  # noqa: PLC0415

            return cupy
        return np

    def asarray(self, x: Any, dtype: Any = None):
        """Host or device data -> an ``xp`` array on this backend's device (float arrays in
        ``dtype``, default the backend's dtype; integer arrays keep their type)."""
        xp = self.xp
        if self.device == "cpu" and is_device_array(x):
            # NumPy refuses implicit device -> host conversion of a CuPy array: copy explicitly.
            x = x.get()
        if dtype is None:
            arr = np.asarray(x) if not is_device_array(x) else x
            dtype = self.dtype if arr.dtype.kind == "f" else arr.dtype
        return xp.asarray(x, dtype=dtype)

    def to_host(self, x: Any) -> np.ndarray:
        return to_host(x)

    def zeros(self, shape, dtype: Any = None):
        return self.xp.zeros(shape, dtype=self.dtype if dtype is None else dtype)

    def synchronize(self) -> None:
        """Wait for all queued device work. Needed before timing, and before handing a device
        buffer to MPI (MPI does not know about CUDA streams)."""
        if self.device == "gpu":
            import cupy  # noqa: PLC0415

            cupy.cuda.get_current_stream().synchronize()

    def select_device(self, local_rank: int) -> int | None:
        """Bind this process to its GPU (see :func:`select_device`); a no-op on the CPU."""
        return select_device(local_rank, self.device)


def select_device(local_rank: int, device: str = "gpu") -> int | None:
    """Make GPU ``local_rank % device_count`` the current device of this process.

    One rank per GPU on a multi-GPU node: rank ``r`` of the node (``local_rank``, from an
    ``MPI_COMM_TYPE_SHARED`` split) takes GPU ``r % n``, with ``n`` the GPUs this process can
    see. A launcher that already gives every rank one GPU (Slurm ``--gpus-per-task=1``,
    ``CUDA_VISIBLE_DEVICES=<one id>``) leaves ``n = 1``, so the rank keeps the one it was
    given. More ranks than GPUs share them round-robin.

    Must run before anything is allocated on the GPU (CuPy allocates on the current
    device), i.e. before the model is built. Both CuPy and Numba (whose CUDA kernels run on
    CuPy's arrays) are pointed at the device, so they share one CUDA context.

    Parameters
    ----------
    local_rank : this rank's index among the ranks of its node, >= 0
    device : ``"gpu"`` selects; ``"cpu"`` does nothing and returns None

    Returns
    -------
    The device ordinal chosen (among the visible ones), or None on the CPU.

    Raises
    ------
    ValueError for a bad ``local_rank`` or ``device``; RuntimeError when the GPU backend is
    unavailable.
    """
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if isinstance(local_rank, bool) or not isinstance(local_rank, (int, np.integer)) or local_rank < 0:
        raise ValueError(f"local_rank must be an integer >= 0, got {local_rank!r}")
    if device == "cpu":
        return None
    cupy = cupy_or_none()
    if cupy is None:
        raise RuntimeError(f"cannot select a GPU: {gpu_unavailable_reason() or 'CuPy sees no CUDA device'}")
    ordinal = int(local_rank) % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(ordinal).use()
    try:
        from numba import config as numba_config  # noqa: PLC0415 - the CUDA kernels' runtime
        from numba import cuda as numba_cuda  # noqa: PLC0415
    except ImportError:  # no Numba: mpidl.kernels says so if its CUDA kernels are ever needed
        return ordinal
    if not numba_config.ENABLE_CUDASIM:
        # Numba launches the kernels in the context current on this thread, and creates one
        # on device 0 if none is; binding it here keeps CuPy and Numba on the same device
        # (both use the device's primary context).
        try:
            numba_cuda.select_device(ordinal)
        except Exception as exc:  # CudaSupportError, CudaAPIError: report as a set-up error
            raise RuntimeError(f"Numba cannot use GPU {ordinal} for the CUDA kernels: {exc}") from exc
    return ordinal


def get_backend(device: str = "cpu", dtype: str | Any = "float32") -> Backend:
    """Build a :class:`Backend`; raise ``ValueError`` with a clear message on a bad choice."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype = np.dtype(dtype).type
    if dtype not in DTYPES.values():
        raise ValueError(f"unsupported dtype {np.dtype(dtype).name}; use float32 or float64")
    if device == "gpu":
        reason = gpu_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"--device gpu was requested but the GPU backend is unavailable: {reason}")
    return Backend(device=device, dtype=dtype)
