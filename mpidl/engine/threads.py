"""The thread policy: how many threads each process of mpidl uses, and how they wait.

The policy is process-wide (thread counts of three libraries, the environment variables they
read, glibc's ``malloc``), so it is applied by one explicit call, the first thing a training
program does, before it builds a model or runs a kernel::

    from mpidl.engine import threads
    threads.apply()

``python -m mpidl.train``, ``mpidl.gan`` and ``mpidl.predict`` make it; so does a training
script of one's own, the benchmarks, and a test that measures the policy. :func:`apply`
decides the policy once and sets the thread counts and the wait policies; later calls do
nothing. Nothing else changes any of it: no import of an mpidl module, no constructor (a
model, a parameter buffer, a ``DataParallel``), no kernel. Everything else only reads what
:func:`apply` decided (:func:`gemm_threads`, :func:`threads_per_stack`,
:func:`one_blas_thread`); before it, or without it, the process keeps the libraries' own
defaults and mpidl splits no product between threads of its own, which is correct but slower
where the pools fight (below). A user's explicit environment settings always win.

Three thread pools share the cores: OpenBLAS's (the GEMMs), OpenMP's (Numba's
``parallel=True`` kernels run on Numba's ``omp`` threading layer, i.e. libgomp) and mpidl's own
Python threads (:mod:`mpidl.engine.blas`). Left at their defaults they fight: each runs one thread per
core, and both OpenBLAS and libgomp keep their idle workers spinning after a call (OpenBLAS
for about 0.1 s, libgomp for its ``GOMP_SPINCOUNT`` before it sleeps), so the next kernel of
the other pool finds the cores taken. The spinning is the cost, not the counts: each pool's
idle workers must sleep (measurements: benchmarks/results/thread_policy.md).

The policy
----------
* ``T`` threads per process: ``OMP_NUM_THREADS`` if set, else the usable cores
  (``sched_getaffinity``, and no more than the cgroup's CPU quota, :func:`usable_cores`: a
  container, a Slurm step or a host of ``jobs/cluster.sh`` may let a process run on every
  core of the machine yet pay for only one) divided by the processes on this machine, as the
  launcher says
  (:func:`launcher_local_size`: ``MPI_LOCALNRANKS`` of MPICH's and Intel MPI's ``mpiexec``,
  ``OMPI_COMM_WORLD_LOCAL_SIZE`` of Open MPI's, the step's tasks on this node of ``srun``);
  1 when no launcher says (one process). At least 1. The launcher's count, not the
  shared-memory communicator's size: it is known before MPI starts, without a collective, so
  the policy is decided once, before the first kernel, whether a ``DataParallel`` is ever built.
* OpenMP workers wait passively (``OMP_WAIT_POLICY=PASSIVE``, set by :func:`apply` unless
  already set; libgomp reads it when Numba first starts a parallel kernel, which is later).
* Numba's kernels run on ``T`` threads (``numba.set_num_threads``), unless
  ``NUMBA_NUM_THREADS`` is set, which then decides.
* BLAS runs ``T`` threads for each large product, and its idle workers sleep as soon as a call
  ends: mpidl sets ``OPENBLAS_THREAD_TIMEOUT=4`` (unless set) and, because OpenBLAS read its
  environment when it loaded (with NumPy, usually before mpidl), has each loaded OpenBLAS
  re-read it and restart its pool (:func:`_openblas_workers_sleep`; the counts are set at run
  time with ``threadpoolctl``, which finds the OpenBLAS or MKL that NumPy and SciPy loaded,
  whatever its symbol names). Inside the Numba kernels that call BLAS from their own parallel
  threads (convolutions, the LSTM) and for stacks of small products (attention's per-head
  products, which :mod:`mpidl.engine.blas` shares among ``T`` Python threads), BLAS runs one thread
  for the call (:func:`one_blas_thread`).
* Where the workers cannot be made to sleep (MKL, an OpenMP build of OpenBLAS, an OpenBLAS
  without those symbols), BLAS runs one thread per call and :mod:`mpidl.engine.blas` splits each
  large product into ``T`` shares on its own Python threads: no BLAS worker exists to spin.
  When the user sets ``OPENBLAS_NUM_THREADS`` or ``MKL_NUM_THREADS``, BLAS keeps that count and
  mpidl does not split single products; :func:`one_blas_thread` still applies.

Why BLAS's own threads rather than mpidl's split: two threads of one process calling
a one-thread OpenBLAS each run slower than one BLAS call on two threads (the measurements are
in benchmarks/results/thread_policy.md). Re-reading the environment and restarting the pool go
through ``ctypes``: OpenBLAS exports both (``openblas_read_env``, ``blas_thread_shutdown_``, the latter what it
runs itself before a ``fork``) but documents neither, so the result is checked and the
fallback above taken when it does not hold. :func:`apply` must run when no other thread is inside
a BLAS call (mpidl calls it before the first step).
* Every loaded OpenBLAS (NumPy's, and SciPy's, which Numba's ``np.dot`` calls) runs one
  multithreaded ``sgemm`` and ``dgemm`` once (:func:`_prime_openblas`), whatever ``T``: a
  one-thread product with a long inner dimension is 2-3x slower in a process whose OpenBLAS
  never ran a multithreaded one of that precision, and a process running one thread never
  does (``OMP_NUM_THREADS=1``, or as many ranks as cores), nor does SciPy's OpenBLAS in any
  process (mpidl calls it with one thread). The counts in force are not changed; where
  the idle workers cannot be made to sleep (below), nothing is primed, as they would spin.
* glibc's ``malloc`` keeps freed memory in the process (:func:`set_malloc_policy`, on the first
  :func:`apply`), unless ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` is set. Not a thread
  setting, but the same kind of process-wide choice that decides a step's speed, so it lives
  here. It goes through ``ctypes`` because no library exposes ``mallopt``.

:func:`describe` says what was applied.
"""

from __future__ import annotations

import contextlib
import os
import re

__all__ = ["apply", "cgroup_cpu_limit", "describe", "gemm_threads", "one_blas_thread", "threads_per_process",
           "threads_per_stack", "set_wait_policy"]

#: Environment variables naming the processes a launcher put on this machine: MPICH's (and
#: Intel MPI's) ``mpiexec``, Open MPI's; ``SLURM_NTASKS_PER_NODE`` is Slurm's
#: ``--ntasks-per-node`` (read after the step's own layout, :func:`slurm_step_local_size`).
LAUNCHER_LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
SLURM_LOCAL_SIZE = "SLURM_NTASKS_PER_NODE"
#: A user's BLAS thread count: BLAS keeps it, and mpidl does not split products.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

#: What :func:`apply` decided. Before it (or without it): mpidl splits no product between its
#: own threads (``gemm_threads``, ``stack_threads`` 1), and BLAS's count is not known
#: (``blas_threads`` None), so :func:`one_blas_thread` sets it to 1 for its context and back.
_state: dict = {"applied": None, "gemm_threads": 1, "stack_threads": 1, "blas_threads": None,
               "malloc_policy": False, "blas_controller": None, "openblas_sleeps": None,
               "openblas_primed": None}


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
    The peak resident size does not grow: the same blocks are reused step after step.
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


def affinity_cores() -> int:
    """The cores this process may run on (``sched_getaffinity``: its cpuset); all of them where
    there is no such call (not Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _read_quota_v1(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as quota_file:
            quota = int(quota_file.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as period_file:
            period = int(period_file.read())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read_quota_v2(directory: str) -> float | None:
    try:
        with open(os.path.join(directory, "cpu.max")) as max_file:
            quota, _, period = max_file.read().strip().partition(" ")
        quota, period = (None if quota == "max" else int(quota)), int(period or 100000)
    except (OSError, ValueError):
        return None
    return quota / period if quota is not None and quota > 0 and period > 0 else None


def cgroup_cpu_limit(cgroup_root: str = "/sys/fs/cgroup", self_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPU this process's cgroup may use, in cores (quota / period), or None without a limit.

    A container, a Slurm job step's cgroup or a host of ``jobs/cluster.sh`` limits a process's
    CPU by a CFS quota: ``quota`` microseconds of CPU per ``period``, for all its threads
    together. ``sched_getaffinity`` does not see it (the process may still run on every core of
    its cpuset), so a policy that counts only the affinity starts more threads than the quota
    pays for: they run until the quota of the period is spent, then all of them stop until the
    next period, so every parallel kernel and every BLAS call waits at its end for the slowest
    of them (measured: a 1-core-quota host whose process ran 2 threads stepped 2.2x slower).

    cgroup v1: the ``cpu`` controller's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none);
    v2: ``cpu.max`` (``max 100000``: none). The process's own cgroup is the line of
    ``self_cgroup`` for the ``cpu`` controller (v1) or ``0::`` (v2), a path under the
    controller's mount in ``cgroup_root``; the limit is the smallest of that cgroup's and its
    ancestors' (a parent's quota binds its children). Inside a cgroup namespace (a container)
    the path is ``/`` and the mount is the container's own cgroup, read the same way. Anything
    unreadable counts as no limit: the affinity then decides alone.
    """
    try:
        with open(self_cgroup) as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines if line.count(":") >= 2]
    except OSError:
        return None
    limits: list[float] = []
    for _, controllers, path in entries:
        names = controllers.split(",") if controllers else []
        if "cpu" in names:  # v1: the controller's own mount, e.g. cpu or cpu,cpuacct
            mounts = [os.path.join(cgroup_root, name) for name in ("cpu", ",".join(names), "cpu,cpuacct")]
            reader = _read_quota_v1
        elif not controllers:  # v2: the unified hierarchy at the root
            mounts, reader = [cgroup_root], _read_quota_v2
        else:
            continue
        mount = next((m for m in mounts if os.path.isdir(m)), None)
        if mount is None:
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts), -1, -1):  # the cgroup, then each ancestor up to the mount
            limit = reader(os.path.join(mount, *parts[:depth]))
            if limit is not None:
                limits.append(limit)
    return min(limits) if limits else None


def usable_cores() -> int:
    """The cores this process can keep busy: its affinity (:func:`affinity_cores`), and no more
    than its cgroup's CPU quota (:func:`cgroup_cpu_limit`) rounded down, at least 1. Rounded
    down: a thread that gets only part of a core is stopped at every period's end while the
    others wait for it at the end of each parallel kernel (a 1.5-core quota runs 1 thread)."""
    cores = affinity_cores()
    limit = cgroup_cpu_limit()
    if limit is not None:
        cores = min(cores, max(1, int(limit + 1e-9)))
    return max(1, cores)


def slurm_step_local_size(environ=os.environ) -> int | None:
    """The tasks ``srun`` started on this node: entry ``SLURM_NODEID`` of
    ``SLURM_STEP_TASKS_PER_NODE`` (e.g. ``"4(x2),3"`` = 4, 4, 3 for nodes 0, 1, 2); None
    outside an ``srun`` step or when the two do not fit together."""
    layout, node = environ.get("SLURM_STEP_TASKS_PER_NODE"), environ.get("SLURM_NODEID", "").strip()
    if not layout or not node.isdigit():
        return None
    node = int(node)
    counts: list[int] = []
    for group in layout.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", group.strip())
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    return counts[node] if node < len(counts) and counts[node] >= 1 else None


def launcher_local_size() -> int:
    """Processes on this machine as the launcher's environment says (1 when it says nothing):
    ``MPI_LOCALNRANKS``, else ``OMPI_COMM_WORLD_LOCAL_SIZE``, else :func:`slurm_step_local_size`,
    else ``SLURM_NTASKS_PER_NODE``."""
    for name in LAUNCHER_LOCAL_SIZE:
        size = _positive_int(os.environ.get(name))
        if size is not None:
            return size
    size = slurm_step_local_size()
    if size is None:  # "8(x4)": 8 on each of 4 nodes
        size = _positive_int(os.environ.get(SLURM_LOCAL_SIZE, "").partition("(")[0])
    return size if size is not None else 1


def threads_per_process(ranks_per_machine: int | None = None) -> int:
    """``T``: ``OMP_NUM_THREADS`` if set, else ``max(1, cores // ranks_per_machine)``
    (default: :func:`launcher_local_size`)."""
    explicit = _positive_int(os.environ.get("OMP_NUM_THREADS"))
    if explicit is not None:
        return explicit
    ranks = ranks_per_machine if ranks_per_machine else launcher_local_size()
    return max(1, usable_cores() // max(1, int(ranks)))


def apply() -> dict:
    """Decide and apply the thread policy of this process (the module docstring), once; a later
    call does nothing. Returns :func:`describe`.

    The one call a training program makes first, before it builds a model or runs a kernel, and
    while no other thread runs BLAS::

        from mpidl.engine import threads
        threads.apply()

    (``OMP_WAIT_POLICY`` only counts when set before libgomp starts, at Numba's first parallel
    kernel.) It changes process-wide state, which nothing else in mpidl does: it sets
    ``OMP_WAIT_POLICY`` and ``OPENBLAS_THREAD_TIMEOUT`` in ``os.environ`` unless they are set,
    Numba's thread count (unless ``NUMBA_NUM_THREADS`` is set), the BLAS libraries' thread
    counts (through ``threadpoolctl``; unless ``OPENBLAS_NUM_THREADS`` or ``MKL_NUM_THREADS``
    is set), restarts OpenBLAS's thread pool, and sets glibc's ``malloc`` thresholds (unless
    ``MALLOC_*_THRESHOLD_`` is set)."""
    if _state["applied"] is not None:
        return describe()
    threads = threads_per_process()
    set_wait_policy()
    set_malloc_policy()
    import numba  # noqa: PLC0415 - imports NumPy; kept out of ``import mpidl``
    from threadpoolctl import threadpool_limits  # noqa: PLC0415

    if "NUMBA_NUM_THREADS" not in os.environ:
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    if _user_sets_blas_threads():
        _state["gemm_threads"], _state["blas_threads"] = 1, None
    else:
        try:  # Numba's kernels load SciPy's own OpenBLAS (for np.dot in jitted code): limit it too
            import scipy.linalg  # noqa: PLC0415,F401
        except ImportError:
            pass
        if threads > 1 and _openblas_workers_sleep():
            threadpool_limits(limits=threads, user_api="blas")
            _state["gemm_threads"], _state["blas_threads"] = 1, threads
        else:
            threadpool_limits(limits=1, user_api="blas")
            _state["gemm_threads"], _state["blas_threads"] = threads, 1
    if _state["openblas_primed"] is None:
        # Only where the workers the primer starts go to sleep right after (else they spin).
        _state["openblas_primed"] = _prime_openblas() if _openblas_workers_sleep() else []
    _state["applied"] = _state["stack_threads"] = threads
    return describe()


#: The product each OpenBLAS runs once on PRIME_THREADS threads (n x n times n x n, about a
#: millisecond): large enough that OpenBLAS gives it more than one thread.
PRIME_SIZE, PRIME_THREADS = 256, 2


def _prime_openblas() -> list[str]:
    """Run one ``PRIME_THREADS``-thread ``sgemm`` and ``dgemm`` on every loaded OpenBLAS, the
    thread counts restored after; returns the libraries' file names.

    Why: a one-thread product with a long inner dimension runs several times slower in a
    process whose OpenBLAS never ran a multithreaded product of that precision, and each
    library (NumPy's, and SciPy's behind Numba's ``np.dot``) needs its own call
    (benchmarks/results/thread_policy.md). A library that is not OpenBLAS is left alone.
    """
    import numpy as np  # noqa: PLC0415
    from threadpoolctl import threadpool_info, threadpool_limits  # noqa: PLC0415

    try:
        import scipy.linalg.blas as scipy_blas  # noqa: PLC0415 - the OpenBLAS of Numba's np.dot
    except ImportError:
        scipy_blas = None
    names = [pool["filepath"].rsplit("/", 1)[-1] for pool in threadpool_info()
             if pool.get("user_api") == "blas" and pool.get("internal_api") == "openblas"]
    if not names:
        return []
    with threadpool_limits(limits=PRIME_THREADS, user_api="blas"):
        for dtype, gemm in ((np.float32, "sgemm"), (np.float64, "dgemm")):
            a = np.ones((PRIME_SIZE, PRIME_SIZE), dtype=dtype)
            np.matmul(a, a)  # NumPy's OpenBLAS
            if scipy_blas is not None:
                getattr(scipy_blas, gemm)(1.0, a, a)  # SciPy's
    return names


#: OpenBLAS's ``OPENBLAS_THREAD_TIMEOUT``: its idle workers spin ``2^4`` cycles (the least it
#: takes), then sleep until the next call. Its default, 28, spins them about 0.1 s.
OPENBLAS_TIMEOUT = 4


def _openblas_workers_sleep() -> bool:
    """Make every loaded BLAS's idle workers sleep right after a call; whether that worked.

    OpenBLAS reads ``OPENBLAS_THREAD_TIMEOUT`` when it loads, usually with NumPy, before mpidl
    is imported. So the variable is set (unless the user set it), then each OpenBLAS re-reads its
    environment (``openblas_read_env``) and stops its thread pool (``blas_thread_shutdown_``,
    what OpenBLAS itself does before a ``fork``); its next multithreaded call starts the pool
    again, with the timeout. Both are exported by every OpenBLAS 0.3 but are not a documented
    interface, so the result is checked (``openblas_thread_timeout``); anything else (MKL, an
    OpenMP build of OpenBLAS, a missing symbol) returns False and BLAS runs one thread.
    """
    if _state["openblas_sleeps"] is not None:
        return _state["openblas_sleeps"]
    import ctypes  # noqa: PLC0415

    from threadpoolctl import threadpool_info  # noqa: PLC0415

    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", str(OPENBLAS_TIMEOUT))
    wanted = _positive_int(os.environ["OPENBLAS_THREAD_TIMEOUT"])
    pools = [pool for pool in threadpool_info() if pool.get("user_api") == "blas"]
    sleeps = bool(pools) and wanted is not None
    for pool in pools:
        if pool.get("internal_api") != "openblas" or pool.get("threading_layer") != "pthreads":
            sleeps = False
            break
        try:
            library = ctypes.CDLL(pool["filepath"])
            read_env, shutdown, timeout = (library.openblas_read_env, library.blas_thread_shutdown_,
                                           library.openblas_thread_timeout)
        except (OSError, AttributeError):
            sleeps = False
            break
        timeout.restype = ctypes.c_int
        read_env()
        shutdown()
        sleeps = sleeps and timeout() == wanted
    _state["openblas_sleeps"] = sleeps
    return sleeps


def gemm_threads() -> int:
    """How many Python threads :mod:`mpidl.engine.blas` splits a product between (1 before
    :func:`apply`)."""
    return _state["gemm_threads"]


def threads_per_stack() -> int:
    """How many Python threads :func:`mpidl.engine.blas.batched_matmul` gives a stack of small
    products (``T``, 1 before :func:`apply`; each product runs one BLAS thread)."""
    return _state["stack_threads"]


def _user_sets_blas_threads() -> bool:
    return any(name in os.environ for name in BLAS_THREAD_VARIABLES)


def one_blas_thread():
    """A context in which BLAS runs one thread: for a Numba kernel that calls BLAS (``np.dot``)
    from its parallel threads, where a multithreaded BLAS oversubscribes the cores and OpenBLAS,
    called inside an OpenMP region, warns that it may hang; and for a stack of products too
    small for BLAS's threads (:func:`mpidl.engine.blas.batched_matmul`). When :func:`apply` made
    BLAS run one thread this does nothing; else (more threads, the user's count, or no policy
    applied) every BLAS library's count is set to 1 for the context and restored after
    (through ``threadpoolctl``'s controllers of the loaded libraries, kept from the first
    call): nothing outlives the context."""
    if _state["blas_threads"] == 1:
        return contextlib.nullcontext()
    if _state["blas_controller"] is None:
        import scipy.linalg.cython_blas  # noqa: PLC0415,F401 - loads the BLAS Numba's np.dot calls
        from threadpoolctl import ThreadpoolController  # noqa: PLC0415

        _state["blas_controller"] = [lib for lib in ThreadpoolController().lib_controllers if lib.user_api == "blas"]
    return _blas_threads(_state["blas_controller"], 1)


@contextlib.contextmanager
def _blas_threads(libraries, count: int):
    before = [library.get_num_threads() for library in libraries]
    for library in libraries:
        library.set_num_threads(count)
    try:
        yield
    finally:
        for library, threads in zip(libraries, before):
            library.set_num_threads(threads)


def describe() -> dict:
    """The thread counts in force: ``threads`` (T), ``affinity_cores`` and ``cpu_quota`` (the
    cores ``sched_getaffinity`` gives and the cgroup's quota in cores, None without one: what
    ``T`` was taken from), ``numba``, ``gemm_threads``, ``blas``
    (per library), ``blas_workers_sleep`` (whether OpenBLAS's idle workers sleep right after a
    call; None until it was needed), ``omp_wait_policy``, ``openblas_primed`` (the OpenBLAS
    libraries :func:`_prime_openblas` primed; None before :func:`apply`); and ``malloc_policy``
    (whether :func:`set_malloc_policy` set glibc's thresholds)."""
    from threadpoolctl import threadpool_info  # noqa: PLC0415

    info: dict = {"threads": _state["applied"], "gemm_threads": _state["gemm_threads"],
                  "affinity_cores": affinity_cores(), "cpu_quota": cgroup_cpu_limit(),
                  "blas_workers_sleep": _state["openblas_sleeps"],
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                  "malloc_policy": _state["malloc_policy"], "openblas_primed": _state["openblas_primed"]}
    try:
        import numba  # noqa: PLC0415

        info["numba"] = numba.get_num_threads()
    except ImportError:
        info["numba"] = None
    info["blas"] = {pool["filepath"].rsplit("/", 1)[-1]: pool["num_threads"]
                    for pool in threadpool_info() if pool.get("user_api") == "blas"}
    return info
