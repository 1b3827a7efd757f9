"""Matrix products, parallel in the way the thread policy (:mod:`mpidl.engine.threads`) chose.

:func:`matmul` computes one product ``a @ b``. Under the policy's default BLAS runs ``T``
threads and its idle workers sleep right after a call, so the product is one BLAS call. Where
the workers could not be made to sleep, BLAS runs one thread per call and the parallelism comes
from here instead: the product is cut into ``T`` blocks of rows or columns of ``out`` (``T`` =
:func:`mpidl.engine.threads.gemm_threads`), one one-thread BLAS call each on mpidl's own Python
threads (NumPy releases the GIL inside ``matmul``, so the shares run in parallel; the calling
thread computes the first share itself). Each element of ``out`` is then computed by one
single-threaded BLAS call over the whole inner dimension, so the result does not depend on
``T`` beyond the blocking BLAS picks for a given block shape.

:func:`batched_matmul` computes a stack of products too small for BLAS's threads (attention's
one product per sample and head): each of ``T`` Python threads takes a contiguous share of the
stack, BLAS running one thread meanwhile (:func:`mpidl.engine.threads.one_blas_thread`).

CuPy arrays go straight to ``cupy.matmul`` (cuBLAS parallelizes on its own); so do products
too small to be worth a thread hand-off, and everything when ``T == 1``. :func:`run_shares`
runs a caller's own split the same way (the LSTM's weight gradients).

Not re-entrant: it assumes no other Python thread calls it concurrently (mpidl does all its
numerics on the main thread).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mpidl.engine import threads as _threads

__all__ = ["batched_matmul", "matmul", "run_shares"]

_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0
_LOCK = threading.Lock()
#: Products of fewer multiply-adds than this run as one call: a hand-off to the pool costs tens
#: of microseconds. Measured here (float32, 2 threads): 1.3 M multiply-adds 25 us whole vs 74 us
#: split, 8.4 M 148 vs 145 us, 21-26 M 400-460 vs 270-370 us.
MIN_SPLIT_WORK = 1 << 24


def _pool(size: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    with _LOCK:
        if _POOL is None or _POOL_SIZE != size:
            if _POOL is not None:
                _POOL.shutdown(wait=True)
            _POOL, _POOL_SIZE = ThreadPoolExecutor(max_workers=size, thread_name_prefix="mpidl-gemm"), size
        return _POOL


def _run_shares(function, shares) -> None:
    """``function(*share)`` for every share, the first on the calling thread."""
    pool = _pool(len(shares) - 1)
    futures = [pool.submit(function, *share) for share in shares[1:]]
    try:
        function(*shares[0])
    finally:
        for future in futures:
            future.result()


def run_shares(function, shares) -> None:
    """``function(*share)`` for every share of a caller's own split (NumPy work that releases
    the GIL, e.g. one-thread BLAS calls): all at once, one thread per share (the first on the
    calling thread), when ``T >= 2`` (``T`` = :func:`mpidl.engine.threads.gemm_threads`), else one
    after the other. The shares must write disjoint outputs; so the results do not depend on
    ``T``."""
    shares = list(shares)
    if _threads.gemm_threads() < 2 or len(shares) < 2:
        for share in shares:
            function(*share)
        return
    _run_shares(function, shares)


def _is_device(a) -> bool:
    return type(a).__module__.startswith("cupy")


def matmul(a, b, out):
    """``out = a @ b`` for 2-D ``a : (M, K)``, ``b : (K, N)``, ``out : (M, N)``; returns ``out``.

    Any strides BLAS accepts (a transposed view, a leading dimension larger than the row).
    Split into ``T`` blocks of columns of ``out`` when ``N >= M``, else of rows.
    """
    if _is_device(a):
        import cupy  # noqa: PLC0415 - only reached with CuPy arrays

        return cupy.matmul(a, b, out=out)
    workers = _threads.gemm_threads()
    m, k = a.shape
    n = b.shape[1]
    if workers < 2 or m * n * k < MIN_SPLIT_WORK or max(m, n) < 2 * workers:
        return np.matmul(a, b, out=out)
    if n >= m:
        bounds = [(n * i // workers, n * (i + 1) // workers) for i in range(workers)]
        _run_shares(lambda lo, hi: np.matmul(a, b[:, lo:hi], out=out[:, lo:hi]), bounds)
    else:
        bounds = [(m * i // workers, m * (i + 1) // workers) for i in range(workers)]
        _run_shares(lambda lo, hi: np.matmul(a[lo:hi], b, out=out[lo:hi]), bounds)
    return out


def batched_matmul(a, b, out):
    """``out[i...] = a[i...] @ b[i...]`` for every index of the leading (batch) axes; returns
    ``out``. The stack is shared among threads along the first axis.

    Parameters
    ----------
    a : (B, ..., M, K), b : (B, ..., K, N), out : (B, ..., M, N); any strides BLAS accepts in
        the last two axes (a transposed view, or a leading dimension larger than the row:
        attention's heads use both), any in the others.
    """
    if _is_device(a):
        import cupy  # noqa: PLC0415 - only reached with CuPy arrays

        # cuBLAS batches the products itself. ``out`` may be a strided view (the Winograd
        # layouts), which not every CuPy version writes into directly: compute, then copy.
        out[...] = cupy.matmul(a, b)
        return out
    batch = a.shape[0]
    workers = min(_threads.threads_per_stack(), batch)
    with _threads.one_blas_thread():  # each product is too small for BLAS's own threads
        if workers < 2:
            return np.matmul(a, b, out=out)
        bounds = [(batch * i // workers, batch * (i + 1) // workers) for i in range(workers)]
        _run_shares(lambda lo, hi: np.matmul(a[lo:hi], b[lo:hi], out=out[lo:hi]), bounds)
    return out
