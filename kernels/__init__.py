"""Convolution and pooling kernels, one dispatch for every backend.

Three implementations share one set of signatures:

==============  =========================  ===========================================
module          runs on                    role
==============  =========================  ===========================================
``reference``   NumPy (or CuPy) arrays     the definition: clear, vectorized array code
``cpu``         NumPy arrays               Numba ``@njit(parallel=True)`` kernels
``cuda``        device arrays              Numba CUDA kernels (``numba.cuda.jit``)
==============  =========================  ===========================================

The Winograd convolution has its own three files (``winograd_reference`` / ``winograd_cpu`` /
``winograd_cuda``; the CPU file has only the whole convolution, fused, so the four transforms
alone run the reference on NumPy arrays), batch normalization (+ ReLU) its own two (``batchnorm_reference``, which
also serves CuPy arrays, and ``batchnorm_cpu``), and so do the transformer layers' GELU, layer
normalization and softmax (``transformer_reference``, ``transformer_cpu``) and the LSTM's loops
over time (``recurrent_reference``, ``recurrent_cpu``); all are chosen by the same rule. The
last two share ``vector_math``: ``exp``, sigmoid and tanh written out so that Numba's loops
vectorize (it would call libm one element at a time). The
finiteness check of a gradient buffer (``all_finite``) and the element-wise passes of a residual
block (``add_relu``, ``relu_backward``, ``add``) have their own two (``elementwise_reference``,
which also serves CuPy arrays, and ``elementwise_cpu``). The math
and the layouts are written once, in the reference files: :mod:`mpidl.kernels.reference`,
:mod:`mpidl.kernels.winograd_reference`, :mod:`mpidl.kernels.batchnorm_reference`,
:mod:`mpidl.kernels.transformer_reference`, :mod:`mpidl.kernels.recurrent_reference` and
:mod:`mpidl.kernels.elementwise_reference`.

Callers go through the functions below. Each checks its arguments once, whichever
implementation runs, and then calls the implementation picked from the array: a device array
(CuPy, or a Numba device array) goes to ``cuda``, a NumPy array to ``cpu``. One family can be
forced instead, to debug a suspected kernel bug or to compare two families:

* in code, for a block: ``with kernels.use("reference"): ...`` (or ``"cpu"``, ``"cuda"``;
  ``"auto"`` restores the choice by the array, whatever the environment says). It holds in
  the current thread (a :class:`contextvars.ContextVar`) and ends with the block;
* for a whole run, from outside: the environment variable ``MPIDL_KERNELS=reference|cpu|cuda``,
  read once, with mpidl's other variables, by :mod:`mpidl.settings` (``SETTINGS.kernels``).

:func:`use` wins over the variable. A forced family that cannot take the array (``cpu`` on a
device array, ``cuda`` on a NumPy one) is refused with ``ValueError``.

The implementation modules are internal: they take arguments these functions have checked
(Python ints, shapes that fit) and check only what is their own: ``cpu`` refuses ``argmax``
indices outside their plane (its scatter-add would race), ``cuda`` takes float32 and float64
only. Calling them directly, as the tests comparing them do, is for valid arguments only.

Every function here raises ``ValueError`` for an argument it cannot take: an array that is
not 4-D or whose shape does not fit the geometry, ``k < 1``, ``stride < 1``, ``pad < 0``, a
window larger than the padded input (an empty output), max pooling's ``pad > k // 2``, an
``argmax`` that is not an integer array, Winograd's ``m < 1`` or ``r < 1``, a convolution's
``weight`` or transformed filters ``u`` not of the input's kind and dtype or of a shape that does
not fit it (or a ``bias`` that does not), an ``out``
workspace that is not an array of the input's kind, shape and dtype, or not C-contiguous,
layer norm's ``gamma, beta`` not of shape ``(D,)`` (or statistics not of ``x.shape[:-1]``), a
softmax ``scale <= 0``, or a backward pass's arrays whose shapes differ.
"""

from __future__ import annotations

import contextlib
import contextvars

from mpidl import settings

from . import reference, winograd_reference

__all__ = [
    "conv_output_size",
    "im2col",
    "col2im",
    "conv2d_forward",
    "conv2d_backward",
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
    "winograd_conv_forward",
    "winograd_conv_backward",
    "batchnorm_forward",
    "batchnorm_backward",
    "all_finite",
    "add_relu",
    "relu_backward",
    "add",
    "gelu_forward",
    "gelu_backward",
    "layernorm_forward",
    "layernorm_backward",
    "softmax_forward",
    "softmax_backward",
    "lstm_forward",
    "lstm_backward",
    "implementation_for",
    "use",
    "forced_family",
    "FAMILIES",
]

conv_output_size = reference.conv_output_size
winograd_matrices = winograd_reference.winograd_matrices
winograd_geometry = winograd_reference.winograd_geometry

#: the kernel families :func:`use` and ``MPIDL_KERNELS`` can force
FAMILIES = ("reference", "cpu", "cuda")
#: the family :func:`use` forced in this context: a name of FAMILIES, "auto", or None (not used)
_USED: contextvars.ContextVar[str | None] = contextvars.ContextVar("mpidl_kernels_family", default=None)


# --------------------------------------------------------------------------------------------
# choosing the implementation
# --------------------------------------------------------------------------------------------


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


def _on_device(x) -> bool:
    """Whether ``x`` lives on a GPU: a CuPy array, or a Numba device array (``cuda.to_device``,
    also under the simulator) or another object exposing ``__cuda_array_interface__``."""
    return (
        type(x).__module__.startswith("cupy")
        or hasattr(x, "__cuda_array_interface__")
        or bool(getattr(x, "__cuda_ndarray__", False))
    )


@contextlib.contextmanager
def use(family: str):
    """Run every kernel called in the ``with`` block (in this thread) with the kernel family
    ``family``: ``"reference"``, ``"cpu"`` or ``"cuda"``, or ``"auto"`` for the choice by the
    array even where ``MPIDL_KERNELS`` forces a family. Blocks nest; the previous choice is
    back when the block ends. A convolution's backward pass runs the family its forward ran
    (:func:`conv2d_backward`), wherever it is called.

    ::

        with kernels.use("reference"):  # is it the Numba kernel?
            y = model.forward(x)
    """
    if family not in (*FAMILIES, "auto"):
        raise ValueError(f"kernels.use: family must be one of {', '.join(FAMILIES)} or auto, got {family!r}")
    token = _USED.set(family)
    try:
        yield
    finally:
        _USED.reset(token)


def forced_family() -> str | None:
    """The family every kernel runs now, or None when the array decides: :func:`use`'s, else
    ``MPIDL_KERNELS`` (:data:`mpidl.settings.SETTINGS`; a malformed value is refused here)."""
    family = _USED.get()
    if family is None:
        return settings.SETTINGS.kernels
    return None if family == "auto" else family


def _forced_by() -> str:
    """Where the forced family came from, for an error message."""
    family = _USED.get()
    return f"kernels.use({family!r})" if family is not None else f"MPIDL_KERNELS={settings.SETTINGS.kernels}"


def implementation_for(x):
    """The kernel module that will run for array ``x`` (see the module docstring)."""
    forced = forced_family()
    on_gpu = _on_device(x)
    if forced:
        if forced == "cuda" and not on_gpu:
            raise ValueError(f"{_forced_by()} needs device arrays (CuPy or Numba)")
        if forced == "cpu" and on_gpu:
            raise ValueError(f"{_forced_by()} needs NumPy arrays")
        return _load(forced)
    module = _load("cuda") if on_gpu else _load("cpu")
    return module if module is not None else reference


def _winograd_module(x, whole: bool = False):
    """The Winograd file of the implementation :func:`implementation_for` picks for ``x``. The
    CPU file has only the whole convolution (``whole``, its passes fused per block of
    samples), so the four transforms alone run the reference on NumPy arrays."""
    module = implementation_for(x)
    if module is reference:
        return winograd_reference
    if module.__name__.endswith(".cpu"):
        if not whole:
            return winograd_reference
        from . import winograd_cpu  # noqa: PLC0415

        return winograd_cpu
    from . import winograd_cuda  # noqa: PLC0415

    return winograd_cuda


def _batchnorm_module(x):
    """``batchnorm_cpu`` for NumPy arrays (unless the reference is forced: :func:`use`,
    ``MPIDL_KERNELS``), else the reference."""
    if implementation_for(x) is reference or _on_device(x):
        from . import batchnorm_reference  # noqa: PLC0415

        return batchnorm_reference
    try:
        from . import batchnorm_cpu  # noqa: PLC0415
    except ImportError:
        from . import batchnorm_reference as batchnorm_cpu  # noqa: PLC0415
    return batchnorm_cpu


def _recurrent_module(x):
    """``recurrent_cpu`` for NumPy arrays (unless the reference is forced: :func:`use`,
    ``MPIDL_KERNELS``), else ``recurrent_reference`` (the LSTM's math and state layout; it runs
    on CuPy arrays too): the rule of :func:`_batchnorm_module`."""
    if implementation_for(x) is reference or _on_device(x):
        from . import recurrent_reference  # noqa: PLC0415

        return recurrent_reference
    try:
        from . import recurrent_cpu  # noqa: PLC0415
    except ImportError:
        from . import recurrent_reference as recurrent_cpu  # noqa: PLC0415
    return recurrent_cpu


# --------------------------------------------------------------------------------------------
# the argument checks, done here once for every implementation
# --------------------------------------------------------------------------------------------


def _ints(*values) -> tuple[int, ...]:
    """Geometry arguments as Python ints: a NumPy integer would otherwise make Numba compile a
    second version of a kernel for another integer type."""
    return tuple(int(v) for v in values)


def _check_4d(x, what: str = "x") -> tuple[int, int, int, int]:
    if len(x.shape) != 4:
        raise ValueError(f"{what} must be 4-D (N, C, H, W); got shape {tuple(x.shape)}")
    return _ints(*x.shape)


def _check_shape(array, expected: tuple, what: str, context: str = "") -> None:
    if tuple(array.shape) != tuple(expected):
        raise ValueError(f"{what} has shape {tuple(array.shape)}, expected {tuple(expected)}{context}")


def _array_kind(a) -> str:
    return type(a).__module__.split(".")[0]


def _check_like(array, like, what: str) -> None:
    """``array`` (a convolution's weights) must be of ``like``'s kind and dtype."""
    if _array_kind(array) != _array_kind(like) or array.dtype != like.dtype:
        raise ValueError(f"{what} must be a {_array_kind(like)} array of dtype {like.dtype}")


def _check_out(out, like, shape: tuple, what: str) -> None:
    """A caller's result buffer (or None): an array of ``like``'s kind and dtype and of the exact
    ``shape``, written in place. It must be C-contiguous: the implementations reshape it, and
    the reshape of a strided buffer is a copy, so the result would land in the copy."""
    if out is None:
        return
    if _array_kind(out) != _array_kind(like) or not hasattr(out, "shape"):
        raise ValueError(f"{what}: out must be a {_array_kind(like)} array like the input, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{what}: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != like.dtype:
        raise ValueError(f"{what}: out has dtype {out.dtype}, expected {like.dtype}")
    if not out.flags["C_CONTIGUOUS"]:  # NumPy, CuPy and Numba flags all take this key
        raise ValueError(f"{what}: out must be C-contiguous")


def _pool_geometry(x_shape: tuple, k, stride, pad):
    """``(k, stride, pad)`` as ints and the pooled shape ``(N, C, OH, OW)`` of ``x_shape``
    (a tuple of ints; checked)."""
    k, stride, pad = _ints(k, stride, pad)
    n, c, h, w = x_shape
    return (k, stride, pad), (n, c, conv_output_size(h, k, stride, pad), conv_output_size(w, k, stride, pad))


def _winograd_args(m, r, pad):
    m, r, pad = _ints(m, r, pad)
    if m < 1 or r < 1 or pad < 0:
        raise ValueError(f"winograd: need m >= 1, r >= 1, pad >= 0; got m={m}, r={r}, pad={pad}")
    return m, r, pad


def _transformed_shape(channels: int, m: int, r: int, oh: int, ow: int, n: int) -> tuple[int, int, int, int]:
    """``(channels, alpha, alpha, TH*TW*N)``: the Winograd layout of an ``OH x OW`` output."""
    alpha = m + r - 1
    return channels, alpha, alpha, -(-oh // m) * -(-ow // m) * n


# --------------------------------------------------------------------------------------------
# the entry points: check, then run the chosen implementation (the math: the reference files)
# --------------------------------------------------------------------------------------------


def im2col(x, kh, kw, stride=1, pad=0, out=None):
    """``x : (N, C, H, W)`` -> ``cols : (C*kh*kw, N*OH*OW)``; ``out`` is an optional workspace.
    The math: :func:`mpidl.kernels.reference.im2col`."""
    n, c, h, w = _check_4d(x)
    kh, kw, stride, pad = _ints(kh, kw, stride, pad)
    oh, ow = conv_output_size(h, kh, stride, pad), conv_output_size(w, kw, stride, pad)
    _check_out(out, x, (c * kh * kw, n * oh * ow), "im2col")
    return implementation_for(x).im2col(x, kh, kw, stride, pad, out=out)


def col2im(cols, x_shape, kh, kw, stride=1, pad=0, out=None):
    """Adjoint of :func:`im2col`: ``cols : (C*kh*kw, N*OH*OW)`` -> ``dx : x_shape``.
    The math: :func:`mpidl.kernels.reference.col2im`."""
    x_shape = n, c, h, w = _ints(*x_shape)
    kh, kw, stride, pad = _ints(kh, kw, stride, pad)
    oh, ow = conv_output_size(h, kh, stride, pad), conv_output_size(w, kw, stride, pad)
    _check_shape(cols, (c * kh * kw, n * oh * ow), "col2im: cols", f" for x_shape {x_shape}")
    _check_out(out, cols, x_shape, "col2im")
    return implementation_for(cols).col2im(cols, x_shape, kh, kw, stride, pad, out=out)


def conv2d_forward(x, weight, bias=None, stride=1, pad=0):
    """The convolution ``x : (N, C, H, W)`` * ``weight : (F, C, kh, kw)`` (+ ``bias : (F,)``)
    by im2col; returns ``(y, saved)``, ``y : (N, F, OH, OW)`` and what
    :func:`conv2d_backward` needs (opaque: it belongs to the implementation that ran).
    The math: :func:`mpidl.kernels.reference.conv2d_forward`."""
    _, c, h, w = _check_4d(x)
    if len(weight.shape) != 4 or weight.shape[1] != c:
        raise ValueError(f"conv2d_forward: weight has shape {tuple(weight.shape)}, expected (F, {c}, kh, kw)")
    _check_like(weight, x, "conv2d_forward: weight")
    f, _, kh, kw = _ints(*weight.shape)
    stride, pad = _ints(stride, pad)
    conv_output_size(h, kh, stride, pad), conv_output_size(w, kw, stride, pad)  # ValueError if empty
    if bias is not None:
        _check_shape(bias, (f,), "conv2d_forward: bias")
    module = implementation_for(x)
    y, state = module.conv2d_forward(x, weight, bias, stride, pad)
    return y, (module, tuple(x.shape), state)


def conv2d_backward(dy, weight, saved, stride=1, pad=0, input_grad=True):
    """``(dW, dx)`` of the convolution :func:`conv2d_forward` ran and ``saved``: ``dW`` of
    ``weight``'s shape, ``dx : (N, C, H, W)`` or None without ``input_grad``. The same
    implementation runs backward as ran forward.
    The math: :func:`mpidl.kernels.reference.conv2d_backward`."""
    module, x_shape, state = saved
    f, _, kh, kw = _ints(*weight.shape)
    stride, pad = _ints(stride, pad)
    n, _, h, w = x_shape
    _check_shape(dy, (n, f, conv_output_size(h, kh, stride, pad), conv_output_size(w, kw, stride, pad)),
                 "conv2d_backward: dy")
    return module.conv2d_backward(dy, weight, state, x_shape, stride, pad, bool(input_grad))


def maxpool2d_forward(x, k, stride, pad=0):
    """``x : (N, C, H, W)`` -> ``(y : (N, C, OH, OW), argmax : int32 (N, C, OH, OW))``.
    The math: :func:`mpidl.kernels.reference.maxpool2d_forward`."""
    (k, stride, pad), _ = _pool_geometry(_check_4d(x), k, stride, pad)
    if pad > k // 2:
        raise ValueError(f"max pooling needs pad <= k // 2 (k={k}), got pad={pad}")
    return implementation_for(x).maxpool2d_forward(x, k, stride, pad)


def maxpool2d_backward(dy, argmax, x_shape, k, stride, pad=0):
    """Route each ``dy`` to its window's winner: ``dx[n, c].flat[argmax] += dy``.
    The math: :func:`mpidl.kernels.reference.maxpool2d_backward`."""
    x_shape = _ints(*x_shape)
    (k, stride, pad), y_shape = _pool_geometry(x_shape, k, stride, pad)
    if tuple(dy.shape) != y_shape or tuple(argmax.shape) != y_shape:
        raise ValueError(
            f"maxpool2d_backward: dy {tuple(dy.shape)} and argmax {tuple(argmax.shape)} "
            f"must both be {y_shape} for x_shape {x_shape}"
        )
    if argmax.dtype.kind not in "iu":
        raise ValueError(f"maxpool2d_backward: argmax must be an integer array, got {argmax.dtype}")
    return implementation_for(dy).maxpool2d_backward(dy, argmax, x_shape, k, stride, pad)


def avgpool2d_forward(x, k, stride, pad=0):
    """``y[n, c, oh, ow] = sum of the k*k window / (k*k)``.
    The math: :func:`mpidl.kernels.reference.avgpool2d_forward`."""
    (k, stride, pad), _ = _pool_geometry(_check_4d(x), k, stride, pad)
    return implementation_for(x).avgpool2d_forward(x, k, stride, pad)


def avgpool2d_backward(dy, x_shape, k, stride, pad=0):
    """Spread each ``dy / (k*k)`` over its window.
    The math: :func:`mpidl.kernels.reference.avgpool2d_backward`."""
    x_shape = _ints(*x_shape)
    (k, stride, pad), y_shape = _pool_geometry(x_shape, k, stride, pad)
    _check_shape(dy, y_shape, "avgpool2d_backward: dy")
    return implementation_for(dy).avgpool2d_backward(dy, x_shape, k, stride, pad)


def winograd_input(x, m, r, pad=0, out=None):
    """``x : (N, C, H, W)`` -> ``V : (C, alpha, alpha, TH*TW*N)``, ``B^T d B`` per input tile.
    The math: :func:`mpidl.kernels.winograd_reference.winograd_input`."""
    n, c, h, w = _check_4d(x)
    m, r, pad = _winograd_args(m, r, pad)
    oh, ow, _, _ = winograd_geometry(x.shape, m, r, pad)
    _check_out(out, x, _transformed_shape(c, m, r, oh, ow, n), "winograd_input")
    return _winograd_module(x).winograd_input(x, m, r, pad, out=out)


def winograd_input_adjoint(dv, x_shape, m, r, pad=0, out=None):
    """Adjoint of :func:`winograd_input`: ``dV -> dx : x_shape``.
    The math: :func:`mpidl.kernels.winograd_reference.winograd_input_adjoint`."""
    x_shape = n, c, _, _ = _ints(*x_shape)
    m, r, pad = _winograd_args(m, r, pad)
    oh, ow, _, _ = winograd_geometry(x_shape, m, r, pad)
    _check_shape(dv, _transformed_shape(c, m, r, oh, ow, n), "winograd_input_adjoint: dv")
    _check_out(out, dv, x_shape, "winograd_input_adjoint")
    return _winograd_module(dv).winograd_input_adjoint(dv, x_shape, m, r, pad, out=out)


def winograd_output(mt, y_shape, m, r, bias=None, out=None):
    """``M : (F, alpha, alpha, TH*TW*N)`` -> ``y : y_shape``, ``A^T M A`` per tile plus ``bias``.
    The math: :func:`mpidl.kernels.winograd_reference.winograd_output`."""
    y_shape = n, f, oh, ow = _ints(*y_shape)
    m, r, _ = _winograd_args(m, r, 0)
    _check_shape(mt, _transformed_shape(f, m, r, oh, ow, n), "winograd_output: M")
    _check_out(out, mt, y_shape, "winograd_output")
    return _winograd_module(mt).winograd_output(mt, y_shape, m, r, bias=bias, out=out)


def winograd_output_adjoint(dy, m, r, out=None):
    """Adjoint of :func:`winograd_output` (bias aside): ``dy -> dM``.
    The math: :func:`mpidl.kernels.winograd_reference.winograd_output_adjoint`."""
    n, f, oh, ow = _check_4d(dy, "dy")
    m, r, _ = _winograd_args(m, r, 0)
    _check_out(out, dy, _transformed_shape(f, m, r, oh, ow, n), "winograd_output_adjoint")
    return _winograd_module(dy).winograd_output_adjoint(dy, m, r, out=out)


def _check_filters(u, x, m, r, what: str) -> int:
    """``u`` must be ``(alpha^2, F, C)`` of ``x``'s kind and dtype; returns F."""
    alpha = m + r - 1
    if len(u.shape) != 3 or u.shape[0] != alpha * alpha or u.shape[2] != x.shape[1]:
        raise ValueError(f"{what}: u has shape {tuple(u.shape)}, expected ({alpha * alpha}, F, {x.shape[1]}) "
                         f"for F({m}x{m}, {r}x{r}) and {x.shape[1]} input channels")
    _check_like(u, x, f"{what}: u")
    return _ints(u.shape[1])[0]


def winograd_conv_forward(x, u, m, r, pad=0, bias=None):
    """The whole stride-1 ``r x r`` convolution of ``x : (N, C, H, W)`` with the transformed
    filters ``u : (alpha^2, F, C)``; returns ``(y, saved)``, ``y : (N, F, OH, OW)`` and what
    :func:`winograd_conv_backward` needs (opaque: it belongs to the implementation that ran).
    The math: :func:`mpidl.kernels.winograd_reference.winograd_conv_forward`."""
    _check_4d(x)
    m, r, pad = _winograd_args(m, r, pad)
    f = _check_filters(u, x, m, r, "winograd_conv_forward")
    winograd_geometry(x.shape, m, r, pad)  # ValueError for an empty output
    if bias is not None:
        _check_shape(bias, (f,), "winograd_conv_forward: bias")
    module = _winograd_module(x, whole=True)
    y, v = module.winograd_conv_forward(x, u, m, r, pad, bias)
    return y, (module, tuple(x.shape), v)


def winograd_conv_backward(dy, u, saved, m, r, pad=0, input_grad=True):
    """``(dU, dx)`` of the convolution :func:`winograd_conv_forward` ran and ``saved``:
    ``dU : (alpha^2, F, C)`` (the filter gradient is ``G^T dU G``), ``dx : (N, C, H, W)`` or None
    without ``input_grad``. The same implementation runs backward as ran forward.
    The math: :func:`mpidl.kernels.winograd_reference.winograd_conv_backward`."""
    module, x_shape, v = saved
    m, r, pad = _winograd_args(m, r, pad)
    oh, ow, _, _ = winograd_geometry(x_shape, m, r, pad)
    _check_shape(dy, (x_shape[0], u.shape[1], oh, ow), "winograd_conv_backward: dy")
    return module.winograd_conv_backward(dy, u, v, x_shape, m, r, pad, bool(input_grad))


def batchnorm_forward(x, gamma, beta, eps, relu=False, stats=None):
    """``x : (N, C, H, W)`` -> ``(y, mean, var)`` (float64 statistics); ``stats=(mean, var)``
    normalizes with those (evaluation); ``relu`` applies ``max(y, 0)``.
    The math: :mod:`mpidl.kernels.batchnorm_reference`."""
    if x.ndim != 4 or gamma.shape != (x.shape[1],) or beta.shape != (x.shape[1],):
        raise ValueError(f"batchnorm_forward: x must be (N, C, H, W) with gamma, beta of shape (C,); "
                         f"got {tuple(x.shape)}, {tuple(gamma.shape)}, {tuple(beta.shape)}")
    return _batchnorm_module(x).batchnorm_forward(x, gamma, beta, float(eps), bool(relu), stats)


def batchnorm_backward(dy, x, y, gamma, mean, var, eps, relu=False, batch_stats=True):
    """``(dx, dgamma, dbeta)`` of :func:`batchnorm_forward` (``y`` its output, read with ``relu``)."""
    if dy.shape != x.shape or (relu and y.shape != x.shape):
        raise ValueError(f"batchnorm_backward: dy {tuple(dy.shape)} (and y with relu) must have x's shape {tuple(x.shape)}")
    return _batchnorm_module(dy).batchnorm_backward(dy, x, y, gamma, mean, var, float(eps), bool(relu), bool(batch_stats))


# --------------------------------------------------------------------------------------------
# the transformer layers' element-wise and row-wise kernels: GELU, layer norm, softmax
# --------------------------------------------------------------------------------------------


def _same_shape_and_dtype(what: str, a, b) -> None:
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        raise ValueError(f"{what}: the arrays must have one shape and dtype, got {tuple(a.shape)} "
                         f"{a.dtype} and {tuple(b.shape)} {b.dtype}")


def _elementwise_module(x):
    """``elementwise_cpu`` for NumPy arrays (unless the reference is forced: :func:`use`,
    ``MPIDL_KERNELS``), else the reference (CuPy arrays run its array code on the device;
    Numba missing)."""
    if implementation_for(x) is reference or _on_device(x):
        from . import elementwise_reference  # noqa: PLC0415

        return elementwise_reference
    try:
        from . import elementwise_cpu  # noqa: PLC0415
    except ImportError:
        from . import elementwise_reference as elementwise_cpu  # noqa: PLC0415
    return elementwise_cpu


def all_finite(x) -> bool:
    """True iff no element of ``x`` (an array of any shape) is NaN or +-inf: the gradient
    check of every distributed step, one read of the buffer on the CPU. Device arrays go to
    the reference (CuPy's own ``isfinite``)."""
    return _elementwise_module(x).all_finite(x)


def add_relu(a, b):
    """``relu(a + b)`` (a residual sum and the ReLU after it), ``a, b`` of one shape and dtype;
    the math: :func:`mpidl.kernels.reference.add_relu`."""
    _same_shape_and_dtype("add_relu", a, b)
    return _elementwise_module(a).add_relu(a, b)


def relu_backward(dy, y):
    """``dy * [y > 0]`` for the output ``y`` of :func:`add_relu` (or of any ReLU)."""
    _same_shape_and_dtype("relu_backward", dy, y)
    return _elementwise_module(dy).relu_backward(dy, y)


def add(a, b):
    """``a + b`` as a new array, ``a, b`` of one shape and dtype (parallel on the CPU)."""
    _same_shape_and_dtype("add", a, b)
    return _elementwise_module(a).add(a, b)


def _transformer_module(x):
    """``transformer_cpu`` for float32/float64 NumPy arrays (unless the reference is forced:
    :func:`use`, ``MPIDL_KERNELS``), else the reference (CuPy arrays, other dtypes, Numba
    missing)."""
    if implementation_for(x) is reference or _on_device(x) or x.dtype.name not in ("float32", "float64"):
        from . import transformer_reference  # noqa: PLC0415

        return transformer_reference
    try:
        from . import transformer_cpu  # noqa: PLC0415
    except ImportError:
        from . import transformer_reference as transformer_cpu  # noqa: PLC0415
    return transformer_cpu


def _check_same_shape(like, what: str, **arrays) -> None:
    """Every array of ``arrays`` (named by its keyword) must have ``like``'s shape."""
    for name, array in arrays.items():
        if tuple(array.shape) != tuple(like.shape):
            raise ValueError(f"{what}: {name} has shape {tuple(array.shape)}, expected {tuple(like.shape)}")


def gelu_forward(x):
    """``(y, cdf)``: ``y = x * Phi(x)``, ``cdf = Phi(x)`` (the standard normal CDF), any shape.
    The math: :mod:`mpidl.kernels.transformer_reference`."""
    return _transformer_module(x).gelu_forward(x)


def gelu_backward(dy, x, cdf):
    """``dx = dy * (Phi(x) + x * phi(x))`` with the forward's ``cdf = Phi(x)``."""
    _check_same_shape(dy, "gelu_backward", x=x, cdf=cdf)
    return _transformer_module(dy).gelu_backward(dy, x, cdf)


def layernorm_forward(x, gamma, beta, eps):
    """``x : (..., D)`` -> ``(y, mean, inv_std)`` (float64 statistics of shape ``x.shape[:-1]``).
    The math: :mod:`mpidl.kernels.transformer_reference`."""
    if x.ndim < 1 or gamma.shape != (x.shape[-1],) or beta.shape != (x.shape[-1],):
        raise ValueError(f"layernorm_forward: x must be (..., D) with gamma, beta of shape (D,); "
                         f"got {tuple(x.shape)}, {tuple(gamma.shape)}, {tuple(beta.shape)}")
    return _transformer_module(x).layernorm_forward(x, gamma, beta, float(eps))


def layernorm_backward(dy, x, gamma, mean, inv_std):
    """``(dx, dgamma, dbeta)`` of :func:`layernorm_forward` (``dgamma, dbeta : (D,)`` float64)."""
    _check_same_shape(x, "layernorm_backward", dy=dy)
    if gamma.shape != (x.shape[-1],) or mean.shape != x.shape[:-1] or inv_std.shape != x.shape[:-1]:
        raise ValueError(f"layernorm_backward: for x {tuple(x.shape)} need gamma (D,) and mean, inv_std "
                         f"{tuple(x.shape[:-1])}; got {tuple(gamma.shape)}, {tuple(mean.shape)}, {tuple(inv_std.shape)}")
    return _transformer_module(dy).layernorm_backward(dy, x, gamma, mean, inv_std)


def softmax_forward(s, scale=1.0):
    """``a = softmax(scale * s)`` along the last axis (``scale > 0``).
    The math: :mod:`mpidl.kernels.transformer_reference`."""
    if s.ndim < 1 or not float(scale) > 0:
        raise ValueError(f"softmax_forward: need an array of at least 1 axis and scale > 0, got {tuple(s.shape)}, {scale}")
    return _transformer_module(s).softmax_forward(s, float(scale))


def softmax_backward(da, a, scale=1.0):
    """``ds = scale * a * (da - sum(da * a))`` along the last axis, ``a`` the forward's output."""
    _check_same_shape(a, "softmax_backward", da=da)
    return _transformer_module(da).softmax_backward(da, a, float(scale))


# --------------------------------------------------------------------------------------------
# the LSTM's loop over time (recurrent_reference: the math; recurrent_cpu: Numba)
# --------------------------------------------------------------------------------------------


def _check_lstm(x, weight_ih, weight_hh, what: str) -> tuple[int, int, int, int]:
    """``(N, T, D, H)`` of an LSTM's input and weights (checked)."""
    if x.ndim != 3 or weight_ih.ndim != 2 or weight_hh.ndim != 2:
        raise ValueError(f"{what}: x must be (N, T, D), the weights 2-D; got {tuple(x.shape)}, "
                         f"{tuple(weight_ih.shape)}, {tuple(weight_hh.shape)}")
    n, steps, d = _ints(*x.shape)
    hid = int(weight_hh.shape[1])
    if tuple(weight_ih.shape) != (4 * hid, d) or tuple(weight_hh.shape) != (4 * hid, hid):
        raise ValueError(f"{what}: weight_ih must be (4H, D) = {(4 * hid, d)} and weight_hh (4H, H) = "
                         f"{(4 * hid, hid)}; got {tuple(weight_ih.shape)}, {tuple(weight_hh.shape)}")
    return n, steps, d, hid


def lstm_forward(x, weight_ih, weight_hh, bias, workspaces=None):
    """``x : (N, T, D)`` -> the state ``(gates, cells, tanh_c, hiddens)`` of a one-layer LSTM
    (``bias = b_ih + b_hh``, (4H,)), time first: ``hiddens : (T+1, N, H)`` holds ``h_0 = 0``
    and every step's hidden state. The math: :mod:`mpidl.kernels.recurrent_reference`.

    ``workspaces``: a dict the caller keeps, one per layer, in which the CPU kernels keep
    their arrays from call to call; the state and the gradients returned are then views of
    arrays the next call with the same dict overwrites."""
    _, _, _, hid = _check_lstm(x, weight_ih, weight_hh, "lstm_forward")
    _check_shape(bias, (4 * hid,), "lstm_forward: bias")
    if not (x.dtype == weight_ih.dtype == weight_hh.dtype == bias.dtype):
        raise ValueError(f"lstm_forward: x and the parameters must share a dtype; got {x.dtype}, "
                         f"{weight_ih.dtype}, {weight_hh.dtype}, {bias.dtype}")
    return _recurrent_module(x).lstm_forward(x, weight_ih, weight_hh, bias, workspaces)


def lstm_backward(dy, x, weight_ih, weight_hh, state, sequence, input_grad=True, workspaces=None):
    """``(dx, dweight_ih, dweight_hh, dbias)`` for the forward that returned ``state``; ``dy``
    is the gradient of every step's hidden state (N, T, H) when ``sequence``, else of the last
    one (N, H); ``dx`` is None when not ``input_grad``; ``workspaces``: :func:`lstm_forward`'s."""
    n, steps, _, hid = _check_lstm(x, weight_ih, weight_hh, "lstm_backward")
    _check_shape(dy, (n, steps, hid) if sequence else (n, hid), "lstm_backward: dy")
    gates, cells, tanh_c, hiddens = state
    for array, shape, name in ((gates, (steps, n, 4 * hid), "gates"), (cells, (steps, n, hid), "cells"),
                               (tanh_c, (steps, n, hid), "tanh_c"), (hiddens, (steps + 1, n, hid), "hiddens")):
        _check_shape(array, shape, f"lstm_backward: {name}")
    return _recurrent_module(dy).lstm_backward(dy, x, weight_ih, weight_hh, gates, cells, tanh_c, hiddens,
                                               bool(sequence), bool(input_grad), workspaces)
