"""The thread policy: how many threads each process of mpidl uses, and how they wait.

mpidl applies it itself, wherever it runs (the CLI, the Python API, the tests, the
benchmarks): ``import mpidl`` sets the wait policy, and :func:`apply` (called by
``build_model``, by ``DataParallel`` and by the CLI, idempotent) sets the thread counts. A
user's explicit environment settings always win.

Three thread pools share the cores: OpenBLAS's (the GEMMs), OpenMP's (Numba's
``parallel=True`` kernels run on Numba's ``omp`` threading layer, i.e. libgomp) and mpidl's own
Python threads (:mod:`mpidl.blas`). Left at their defaults they fight: each runs one thread per
core, and both OpenBLAS and libgomp keep their idle workers spinning after a call (OpenBLAS
for about 0.1 s, libgomp for its ``GOMP_SPINCOUNT`` before it sleeps), so the next kernel of
the other pool finds the cores taken. Measured on 2 cores (hsicnn, batch 64, one training step,
fresh processes, loaded machine): nothing set 40 ms; ``OMP_WAIT_POLICY=PASSIVE`` alone
20-24 ms; ``OPENBLAS_THREAD_TIMEOUT=4`` alone 64-107 ms (then OpenMP spins instead);
both 13-14 ms; one OpenBLAS thread and passive OpenMP 17-24 ms (before mpidl split the
products itself). The spinning is the cost, not the counts. With this policy and nothing set,
``benchmarks/step.py`` (README, "One training step vs PyTorch") measures the API path.

The policy
----------
* ``T`` threads per process: ``OMP_NUM_THREADS`` if set, else the usable cores
  (``sched_getaffinity``) divided by the processes on this machine: the launcher's count
  (``MPI_LOCALNRANKS`` of MPICH, ``OMPI_COMM_WORLD_LOCAL_SIZE`` of Open MPI,
  ``SLURM_NTASKS_PER_NODE``) at first, then the shared-memory communicator's size when
  ``DataParallel`` or the CLI builds its topology. At least 1.
* OpenMP workers wait passively (``OMP_WAIT_POLICY=PASSIVE``, set on ``import mpidl``, unless
  already set; libgomp reads it when Numba first starts a parallel kernel, which is later).
* Numba's kernels run on ``T`` threads (``numba.set_num_threads``), unless
  ``NUMBA_NUM_THREADS`` is set, which then decides.
* BLAS runs one thread per call (set at run time with ``threadpoolctl``, which finds the
  OpenBLAS or MKL that NumPy and SciPy loaded, whatever its symbol names), and
  :mod:`mpidl.blas` splits each large product into ``T`` shares on its own Python threads. No
  BLAS worker exists to spin, so the policy works even when NumPy was imported (and OpenBLAS
  started its pool) before mpidl. When the user sets ``OPENBLAS_NUM_THREADS`` or
  ``MKL_NUM_THREADS``, BLAS keeps that count and mpidl does not split the products, except
  inside the Numba kernels that call BLAS from their own parallel threads (the convolutions):
  there it runs one thread for the call (:func:`one_blas_thread`).
* glibc's ``malloc`` keeps freed memory in the process (:func:`set_malloc_policy`, on ``import
  mpidl``), unless ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` is set. Not a thread
  setting, but the same kind of process-wide choice that decides a step's speed, so it lives
  here. It goes through ``ctypes`` because no library exposes ``mallopt``.

:func:`describe` says what was applied.
"""

from __future__ import annotations

import contextlib
import os

__all__ = ["apply", "describe", "gemm_threads", "one_blas_thread", "threads_per_process", "set_wait_policy"]

#: Environment variables naming the processes a launcher put on this machine.
LAUNCHER_LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")
#: A user's BLAS thread count: BLAS keeps it, and mpidl does not split products.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_state: dict = {"applied": None, "gemm_threads": 1, "ranks": None, "malloc_policy": False, "blas_controller": None}


def set_wait_policy() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set it (must precede libgomp's loading)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


#: glibc's ``mallopt`` parameters (malloc.h) and the values mpidl sets: keep freed blocks of up
#: to 256 MiB in the heap and never trim it below 1 GiB of free top memory.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_POLICY = {_M_MMAP_THRESHOLD: 256 << 20, _M_TRIM_THRESHOLD: 1 << 30}
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def set_malloc_policy() -> bool:
    """Make glibc's ``malloc`` keep freed array memory in the process instead of returning it to
    the OS; returns whether the policy was set (not on another C library, or when the user set
    either ``MALLOC_*_THRESHOLD_`` variable, which then stand).

    Why: a training step allocates and frees many arrays of a few MiB (layer outputs and
    gradients). By default glibc serves such a block with ``mmap`` and ``munmap``s it on free, or
    trims the heap top, so the next step's array of the same size starts as fresh pages: a page
    fault per 4 KiB on first touch, inside kernels that would otherwise run at memory speed.
    Measured on resnet8 (benchmarks/step.py, batch 64, 2 threads, 3 rounds, a noisy 2-core VM):
    89.5 -> 85.3 and 79.7 -> 74.2 ms per step in two before/after pairs (the same thresholds as
    environment variables: 90.4 / 88.0 -> 78.4 / 77.0 ms); no change at one thread; the
    FusedResidual backward (page-faulting fresh outputs) 5.6 -> 2.7 ms in profile_layers.py.
    The peak resident size is unchanged (422 MB): the same blocks are reused step after step,
    and the resident growth during the timed steps falls from 11-15 MB to 0.
    """
    if any(name in os.environ for name in _MALLOC_ENV):
        return False
    try:
        import ctypes  # noqa: PLC0415

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _state["malloc_policy"] = all(mallopt(parameter, value) == 1 for parameter, value in _MALLOC_POLICY.items())
    return _state["malloc_policy"]


def _positive_int(value) -> int | None:
    try:
        number = int(str(value).strip().split(",")[0])
    except (TypeError, ValueError):
        return None
    return number if number >= 1 else None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def launcher_local_size() -> int:
    """Processes on this machine as the launcher's environment says (1 when it says nothing)."""
    for name in LAUNCHER_LOCAL_SIZE:
        size = _positive_int(os.environ.get(name))
        if size is not None:
            return size
    return 1


def threads_per_process(ranks_per_machine: int | None = None) -> int:
    """``T``: ``OMP_NUM_THREADS`` if set, else ``max(1, cores // ranks_per_machine)``."""
    explicit = _positive_int(os.environ.get("OMP_NUM_THREADS"))
    if explicit is not None:
        return explicit
    ranks = ranks_per_machine if ranks_per_machine else launcher_local_size()
    return max(1, usable_cores() // max(1, int(ranks)))


def apply(ranks_per_machine: int | None = None) -> dict:
    """Apply the policy for ``ranks_per_machine`` processes on this machine (default: the
    count of the last call that gave one, else the launcher's); a second call with the same
    outcome does nothing. Returns :func:`describe`."""
    if ranks_per_machine:
        _state["ranks"] = int(ranks_per_machine)
    threads = threads_per_process(_state["ranks"])
    if _state["applied"] == threads:
        return describe()
    set_wait_policy()
    import numba  # noqa: PLC0415 - imports NumPy; kept out of ``import mpidl``
    from threadpoolctl import threadpool_limits  # noqa: PLC0415

    if "NUMBA_NUM_THREADS" not in os.environ:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    if _user_sets_blas_threads():
        _state["gemm_threads"] = 1
    else:
        try:  # Numba's kernels load SciPy's own OpenBLAS (for np.dot in jitted code): limit it too
            import scipy.linalg  # noqa: PLC0415,F401
        except ImportError:
            pass
        threadpool_limits(limits=1, user_api="blas")
        _state["gemm_threads"] = threads
    _state["applied"] = threads
    return describe()


def gemm_threads() -> int:
    """How many Python threads :mod:`mpidl.blas` splits a product between (applies the policy
    first if nobody did)."""
    if _state["applied"] is None:
        apply()
    return _state["gemm_threads"]


def _user_sets_blas_threads() -> bool:
    return any(name in os.environ for name in BLAS_THREAD_VARIABLES)


def one_blas_thread():
    """A context in which BLAS runs one thread, for a Numba kernel that calls BLAS (``np.dot``)
    from its parallel threads: there a multithreaded BLAS oversubscribes the cores (resnet8's
    step went from 66 to 100-137 ms with ``OPENBLAS_NUM_THREADS=2``, 2 cores) and OpenBLAS,
    called inside an OpenMP region, warns that it may hang. Under the policy BLAS already runs
    one thread and this does nothing; when the user's ``OPENBLAS_NUM_THREADS`` or
    ``MKL_NUM_THREADS`` kept more, they are limited for the call and restored after
    (``threadpoolctl``, about 20 us)."""
    if _state["applied"] is None:
        apply()
    if not _user_sets_blas_threads():
        return contextlib.nullcontext()
    if _state["blas_controller"] is None:
        import scipy.linalg.cython_blas  # noqa: PLC0415,F401 - loads the BLAS Numba's np.dot calls
        from threadpoolctl import ThreadpoolController  # noqa: PLC0415

        _state["blas_controller"] = ThreadpoolController()
    return _state["blas_controller"].limit(limits=1, user_api="blas")


def describe() -> dict:
    """The thread counts in force: ``threads`` (T), ``numba``, ``gemm_threads``, ``blas``
    (per library), ``omp_wait_policy``; and ``malloc_policy`` (whether :func:`set_malloc_policy`
    set glibc's thresholds)."""
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    info: dict = {"threads": _state["applied"], "gemm_threads": _state["gemm_threads"],
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                  "malloc_policy": _state["malloc_policy"]}
    try:
        import numba  # noqa: PLC0415

        info["numba"] = numba.get_num_threads()
    except ImportError:
        info["numba"] = None
    info["blas"] = {pool["filepath"].rsplit("/", 1)[-1]: pool["num_threads"]
                    for pool in threadpool_info() if pool.get("user_api") == "blas"}
    return info
