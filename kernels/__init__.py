"""Convolution and pooling kernels, one dispatch for every backend.

Three implementations share one set of signatures:

==============  =========================  ===========================================
module          runs on                    role
==============  =========================  ===========================================
``reference``   NumPy (or CuPy) arrays     the definition: clear, vectorized array code
``cpu``         NumPy arrays               Numba ``@njit(parallel=True)`` kernels
``cuda``        CuPy arrays                Numba CUDA kernels (``numba.cuda.jit``)
==============  =========================  ===========================================

The functions below pick the implementation from the array (CuPy array -> ``cuda``, NumPy
array -> ``cpu``). Setting the environment variable ``MPIDL_KERNELS=reference`` forces the
reference everywhere (for debugging a suspected kernel bug); ``MPIDL_KERNELS=cpu`` or
``cuda`` forces one of the others. The choice is read at each call, so tests can flip it.

Layouts (NCHW everywhere)
-------------------------
``im2col(x, kh, kw, stride, pad)`` with ``x : (N, C, H, W)`` returns
``cols : (C*kh*kw, N*OH*OW)``; row ``(c*kh + i)*kw + j`` holds input channel ``c`` at kernel
offset ``(i, j)``, column ``(n*OH + oh)*OW + ow`` is output pixel ``(oh, ow)`` of sample
``n``, and ``cols[r, col] = x[n, c, oh*stride + i - pad, ow*stride + j - pad]`` (0 outside).
``OH = (H + 2*pad - kh)//stride + 1`` (same for ``OW``). ``col2im`` is its adjoint: it
scatter-adds ``cols`` back into an ``(N, C, H, W)`` array.

``winograd_input / winograd_output`` and their adjoints are the transforms around the batched
GEMMs of a stride-1 convolution by Winograd's F(m x m, r x r) algorithm. They have their own
three files, ``winograd_reference`` / ``winograd_cpu`` / ``winograd_cuda``, chosen by the same
rule; their layout ``(C, alpha, alpha, TH*TW*N)`` and math are in
:mod:`mpidl.kernels.winograd_reference`.

Batch normalization (+ ReLU) has its own pair of files, ``batchnorm_reference`` (the
definition, any ``xp``: it also serves CuPy arrays) and ``batchnorm_cpu`` (Numba), chosen the
same way; the math is in :mod:`mpidl.kernels.batchnorm_reference`.

Pooling takes ``(k, stride, pad)``; max pooling pads with -inf and returns ``argmax``, int32,
the index ``h*W + w`` of the winning input pixel in its ``(H, W)`` plane; average pooling pads
with zeros and always divides by ``k*k`` (PyTorch's ``count_include_pad=True``).
"""

from __future__ import annotations

import os

from . import reference, winograd_reference

__all__ = [
    "conv_output_size",
    "im2col",
    "col2im",
    "maxpool2d_forward",
    "maxpool2d_backward",
    "avgpool2d_forward",
    "avgpool2d_backward",
    "winograd_matrices",
    "winograd_geometry",
    "winograd_input",
    "winograd_input_adjoint",
    "winograd_output",
    "winograd_output_adjoint",
    "batchnorm_forward",
    "batchnorm_backward",
    "implementation_for",
]

conv_output_size = reference.conv_output_size
winograd_matrices = winograd_reference.winograd_matrices
winograd_geometry = winograd_reference.winograd_geometry

_FORCE_VALUES = ("", "reference", "cpu", "cuda")


def _load(name: str):
    if name == "reference":
        return reference
    if name == "cpu":
        try:
            from . import cpu  # noqa: PLC0415 - Numba compilation is deferred until needed
        except ImportError:
            return None
        return cpu
    if name == "cuda":
        return _cuda_or_reference()
    raise ValueError(name)


_CUDA_MODULE = None


def _cuda_or_reference():
    """The Numba CUDA kernels, or, when Numba cannot compile for this GPU (no NVVM found, an
    unsupported CUDA version), the reference, which runs on CuPy arrays too: warned once."""
    global _CUDA_MODULE
    if _CUDA_MODULE is None:
        try:
            from numba import cuda as numba_cuda  # noqa: PLC0415

            if not numba_cuda.is_available():
                raise RuntimeError("numba.cuda.is_available() is False")
            from . import cuda  # noqa: PLC0415

            _CUDA_MODULE = cuda
        except Exception as exc:  # ImportError, CUDA driver or toolkit errors
            import warnings  # noqa: PLC0415

            warnings.warn(
                f"Numba CUDA kernels unavailable ({exc}); using the reference kernels on CuPy arrays. "
                "Install numba-cuda[cu12] (the 'gpu' extra) for the CUDA kernels.",
                RuntimeWarning, stacklevel=3,
            )
            _CUDA_MODULE = reference
    return _CUDA_MODULE


def implementation_for(x):
    """The kernel module that will run for array ``x`` (see the module docstring)."""
    forced = os.environ.get("MPIDL_KERNELS", "").strip().lower()
    if forced not in _FORCE_VALUES:
        raise ValueError(
            f"MPIDL_KERNELS={forced!r} is not one of reference, cpu, cuda (or unset)"
        )
    on_gpu = type(x).__module__.startswith("cupy")
    if forced:
        if forced == "cuda" and not on_gpu:
            raise ValueError("MPIDL_KERNELS=cuda needs CuPy arrays")
        if forced == "cpu" and on_gpu:
            raise ValueError("MPIDL_KERNELS=cpu needs NumPy arrays")
        return _load(forced)
    module = _load("cuda") if on_gpu else _load("cpu")
    return module if module is not None else reference


def im2col(x, kh, kw, stride=1, pad=0, out=None):
    """``x : (N, C, H, W)`` -> ``cols : (C*kh*kw, N*OH*OW)``; ``out`` is an optional workspace."""
    return implementation_for(x).im2col(x, kh, kw, stride, pad, out=out)


def col2im(cols, x_shape, kh, kw, stride=1, pad=0, out=None):
    """Adjoint of :func:`im2col`: ``cols : (C*kh*kw, N*OH*OW)`` -> ``dx : x_shape``."""
    return implementation_for(cols).col2im(cols, x_shape, kh, kw, stride, pad, out=out)


def maxpool2d_forward(x, k, stride, pad=0):
    """``x : (N, C, H, W)`` -> ``(y : (N, C, OH, OW), argmax : int32 (N, C, OH, OW))``."""
    return implementation_for(x).maxpool2d_forward(x, k, stride, pad)


def maxpool2d_backward(dy, argmax, x_shape, k, stride, pad=0):
    """Route each ``dy`` to its window's winner: ``dx[n, c].flat[argmax] += dy``."""
    return implementation_for(dy).maxpool2d_backward(dy, argmax, x_shape, k, stride, pad)


def avgpool2d_forward(x, k, stride, pad=0):
    """``y[n, c, oh, ow] = sum of the k*k window / (k*k)``."""
    return implementation_for(x).avgpool2d_forward(x, k, stride, pad)


def avgpool2d_backward(dy, x_shape, k, stride, pad=0):
    """Spread each ``dy / (k*k)`` over its window."""
    return implementation_for(dy).avgpool2d_backward(dy, x_shape, k, stride, pad)


def _winograd_module(x):
    """The Winograd file of the implementation :func:`implementation_for` picks for ``x``."""
    module = implementation_for(x)
    if module is reference:
        return winograd_reference
    if module.__name__.endswith(".cpu"):
        from . import winograd_cpu  # noqa: PLC0415

        return winograd_cpu
    from . import winograd_cuda  # noqa: PLC0415

    return winograd_cuda


def winograd_input(x, m, r, pad=0, out=None):
    """``x : (N, C, H, W)`` -> ``V : (C, alpha, alpha, TH*TW*N)``, ``B^T d B`` per input tile."""
    return _winograd_module(x).winograd_input(x, m, r, pad, out=out)


def winograd_input_adjoint(dv, x_shape, m, r, pad=0, out=None):
    """Adjoint of :func:`winograd_input`: ``dV -> dx : x_shape``."""
    return _winograd_module(dv).winograd_input_adjoint(dv, x_shape, m, r, pad, out=out)


def winograd_output(mt, y_shape, m, r, bias=None, out=None):
    """``M : (F, alpha, alpha, TH*TW*N)`` -> ``y : y_shape``, ``A^T M A`` per tile plus ``bias``."""
    return _winograd_module(mt).winograd_output(mt, y_shape, m, r, bias=bias, out=out)


def winograd_output_adjoint(dy, m, r, out=None):
    """Adjoint of :func:`winograd_output` (bias aside): ``dy -> dM``."""
    return _winograd_module(dy).winograd_output_adjoint(dy, m, r, out=out)


def _batchnorm_module(x):
    """``batchnorm_cpu`` for NumPy arrays (unless ``MPIDL_KERNELS=reference``), else the reference."""
    if implementation_for(x) is reference or type(x).__module__.startswith("cupy"):
        from . import batchnorm_reference  # noqa: PLC0415

        return batchnorm_reference
    try:
        from . import batchnorm_cpu  # noqa: PLC0415
    except ImportError:
        from . import batchnorm_reference as batchnorm_cpu  # noqa: PLC0415
    return batchnorm_cpu


def batchnorm_forward(x, gamma, beta, eps, relu=False, stats=None):
    """``x : (N, C, H, W)`` -> ``(y, mean, var)`` (float64 statistics); ``stats=(mean, var)``
    normalizes with those (evaluation); ``relu`` applies ``max(y, 0)``."""
    if x.ndim != 4 or gamma.shape != (x.shape[1],) or beta.shape != (x.shape[1],):
        raise ValueError(f"batchnorm_forward: x must be (N, C, H, W) with gamma, beta of shape (C,); "
                         f"got {tuple(x.shape)}, {tuple(gamma.shape)}, {tuple(beta.shape)}")
    return _batchnorm_module(x).batchnorm_forward(x, gamma, beta, float(eps), bool(relu), stats)


def batchnorm_backward(dy, x, y, gamma, mean, var, eps, relu=False, batch_stats=True):
    """``(dx, dgamma, dbeta)`` of :func:`batchnorm_forward` (``y`` its output, read with ``relu``)."""
    if dy.shape != x.shape or (relu and y.shape != x.shape):
        raise ValueError(f"batchnorm_backward: dy {tuple(dy.shape)} (and y with relu) must have x's shape {tuple(x.shape)}")
    return _batchnorm_module(dy).batchnorm_backward(dy, x, y, gamma, mean, var, float(eps), bool(relu), bool(batch_stats))
