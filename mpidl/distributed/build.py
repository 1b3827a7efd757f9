"""From options to objects: :func:`data_parallel` assembles a DataParallel and its extras.

:class:`~mpidl.distributed.DataParallel` is composed of parts passed in (an exchange, a split,
a clock). This module is the one place that knows every part and every extra, and the rules
between their options; the core and the three strategies never name the extras::

    strategy          Flat | Hierarchical | Node(K')              flat.py, hierarchical.py, node.py
      channels          compress: 16-bit inter-node level          extras/compress.py
                        emulate_link: slow inter-node link         emulation/link.py
      around it         sync_overlap: node's sync in the background extras/sync_overlap.py
                        overlap: buckets started by backward       extras/overlap.py
                        intra='shm': the node-shared window        extras/shm.py
    split             FixedSplit (equal, given speeds) | MeasuredSplit ('auto', or
                      rebalance_every: the fixed split re-fitted from the steps)  split/
    clock             ComputeClock | SlowedClock (emulate_slowdown)              emulation/
    on_failure        'shrink': ElasticDataParallel around it                     elastic/

==================  =====================================================================
option              works with
==================  =====================================================================
``compress``        ``hierarchical`` (its leaders' gradient exchange, also from the shared
                    window), blocking (no ``overlap``)
``sync_overlap``    ``node``, ``intra='mpi'``, no ``compress``; ``< sync_every``
``overlap``         any strategy (its stages, bucket by bucket); ``intra='mpi'``, the CPU
                    backend, a Model whose ``net`` is a Module
``intra='shm'``     any strategy; the CPU backend and an elementwise optimizer
``on_failure``      'shrink': none of the above, and real (not emulated) nodes
==================  =====================================================================

Each rule is written once, in the file of the part that owns it (``check_options`` of each
extra), and :func:`check_options` runs them all without MPI: the command line calls it too,
and names the option from :attr:`OptionError.option`.
"""

from __future__ import annotations

from numbers import Real

import numpy as np

from mpidl.distributed.data_parallel import ON_NAN, WEIGHTINGS, DataParallel
from mpidl.distributed.flat import Flat
from mpidl.distributed.hierarchical import Hierarchical
from mpidl.distributed.node import Node, check_sync_every
from mpidl.distributed.topology import Topology

#: the strategies by name
STRATEGIES = {"flat": Flat, "hierarchical": Hierarchical, "node": Node}
#: how the ranks of one node combine: MPI messages on private replicas, or the shared window
INTRA = ("mpi", "shm")
#: default cap of an overlapped bucket (MiB)
BUCKET_MB = 1.0
ON_FAILURE = ("restart", "shrink")

__all__ = ["OptionError", "check_options", "data_parallel", "make_exchange", "STRATEGIES", "INTRA",
           "BUCKET_MB", "ON_FAILURE"]


class OptionError(ValueError):
    """A bad option; :attr:`option` names the keyword argument that broke the rule."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def _owned(option: str, check, *args) -> None:
    try:
        check(*args)
    except OptionError:
        raise
    except ValueError as exc:
        raise OptionError(option, str(exc)) from None


def check_options(*, strategy: str = "flat", weighting: str = "balanced", sync_every: int = 50,
                  on_nan: str = "stop", intra: str = "mpi", overlap: bool = False,
                  bucket_mb: float = BUCKET_MB, compress: str = "none", sync_overlap: int = 0,
                  on_failure: str = "restart", host_memory: bool = True, optimizer=None,
                  model=None, emulated_nodes: bool = False) -> None:
    """Raise :class:`OptionError` when the options do not fit together (the module's table);
    no MPI. ``host_memory``: the parameters are NumPy arrays; ``optimizer``: the optimizer or
    its class; ``model``: checked for ``overlap`` when given."""
    if strategy not in STRATEGIES:
        raise OptionError("strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if weighting not in WEIGHTINGS:
        raise OptionError("weighting", f"unknown weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")
    if on_nan not in ON_NAN:
        raise OptionError("on_nan", f"on_nan must be one of {', '.join(ON_NAN)}, got {on_nan!r}")
    _owned("sync_every", check_sync_every, sync_every)
    if intra not in INTRA:
        raise OptionError("intra", f"intra must be one of {', '.join(INTRA)}, got {intra!r}")
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, Real) or not 0 < bucket_mb < float("inf"):
        raise OptionError("bucket_mb", f"bucket_mb must be a number > 0, got {bucket_mb!r}")
    if on_failure not in ON_FAILURE:
        raise OptionError("on_failure", f"on_failure must be one of {', '.join(ON_FAILURE)}, got {on_failure!r}")
    from mpidl.distributed.extras import compress as compress_, overlap as overlap_, shm, sync_overlap as sync_

    _owned("compress", compress_.check_options, compress, strategy, overlap)
    _owned("sync_overlap", sync_.check_options, sync_overlap, strategy, sync_every, intra, compress)
    if overlap:
        _owned("overlap", overlap_.check_options, intra, host_memory, model)
    if intra == "shm":
        _owned("intra", shm.check_options, host_memory, optimizer)
    if on_failure == "shrink":
        from mpidl.distributed.elastic import check_options as check_elastic  # noqa: PLC0415

        _owned("on_failure", check_elastic, intra, overlap, compress, sync_overlap, emulated_nodes)


def make_exchange(topology: Topology, strategy: str = "flat", *, sync_every: int = 50,
                  sync_optimizer_state: bool = False, compress: str = "none", sync_overlap: int = 0,
                  emulate_link=None):
    """The strategy over ``topology`` with its channels wrapped (collective). Its options are
    checked first, by the rules of :func:`check_options` (:class:`OptionError`), alike on every
    rank: ``emulate_link`` is a LinkModel, a 'LATENCY_US,GBIT_S' string or None."""
    from mpidl.distributed.emulation import EmulatedLink, LinkModel, parse_link  # noqa: PLC0415
    from mpidl.distributed.extras.compress import Compressed  # noqa: PLC0415

    check_options(strategy=strategy, sync_every=sync_every, compress=compress, sync_overlap=sync_overlap)
    try:
        link = parse_link(emulate_link) if isinstance(emulate_link, str) else emulate_link
    except ValueError as exc:
        raise OptionError("emulate_link", f"emulate_link: {exc}") from None
    if link is not None and not isinstance(link, LinkModel):
        raise OptionError("emulate_link", "emulate_link must be a LinkModel, a 'LATENCY_US,GBIT_S' string or None, "
                                          f"got {emulate_link!r}")

    def wrap(channel):
        inter_node = channel.level == "inter" or (channel.level == "world" and topology.num_nodes > 1)
        if link is not None and inter_node:
            channel = EmulatedLink(channel, link)
        if compress != "none" and channel.level == "inter":
            channel = Compressed(channel, compress)
        return channel

    if strategy == "node":
        if sync_overlap:
            from mpidl.distributed.extras.sync_overlap import OverlappedSyncNode  # noqa: PLC0415

            exchange = OverlappedSyncNode(topology, sync_every, sync_optimizer_state, sync_overlap, wrap=wrap)
        else:
            exchange = Node(topology, sync_every, sync_optimizer_state, wrap=wrap)
    else:
        exchange = STRATEGIES[strategy](topology, wrap=wrap)
    return exchange


def data_parallel(model, optimizer, *, batch_size: int, topology: Topology | None = None,
                  strategy: str = "flat", sync_every: int = 50, weighting: str = "balanced",
                  sync_optimizer_state: bool = False, speeds="equal", probe=None,
                  balance_threshold: float = 0.05, min_local_batch: int = 1, rebalance_every: int | None = None,
                  on_nan: str = "stop", intra: str = "mpi", overlap: bool = False,
                  bucket_mb: float = BUCKET_MB, compress: str = "none", sync_overlap: int = 0,
                  emulate_slowdown=1.0, emulate_clock: str = "wall", emulate_link=None,
                  on_failure: str = "restart"):
    """A :class:`~mpidl.distributed.DataParallel` from options (collective), or an
    :class:`~mpidl.distributed.elastic.ElasticDataParallel` around one with
    ``on_failure='shrink'`` (where the MPI can shrink; else the plain one and its
    ``failure_note`` says why).

    ``speeds``: 'equal' | 'auto' (measured with ``probe(n)``: one forward + backward on ``n``
    samples) | one relative speed per rank. A ``probe`` given with equal or given speeds still
    runs once untimed on every rank (the JIT compiles then, one rank per node first), so the
    first timed step measures the model, not the compiler. ``emulate_slowdown``: one factor (>= 1) or one per
    rank; ``emulate_link``: a LinkModel or 'LATENCY_US,GBIT_S' (EMULATION). The other options:
    the module's table, :class:`~mpidl.distributed.DataParallel` and the parts' own docs.
    Every option is checked, alike on every rank, before any MPI call.
    """
    from mpidl.distributed.emulation import compute_clock  # noqa: PLC0415
    from mpidl.distributed.split import FixedSplit, MeasuredSplit, check_batch_fits  # noqa: PLC0415
    from mpidl.distributed.split.measured import check_options as check_split_options  # noqa: PLC0415
    from mpidl.distributed.split.probe import warm_up  # noqa: PLC0415

    params = getattr(model, "params", model)
    emulated = topology.emulated_ranks_per_node is not None if topology is not None else None
    check_options(strategy=strategy, weighting=weighting, sync_every=sync_every, on_nan=on_nan, intra=intra,
                  overlap=overlap, bucket_mb=bucket_mb, compress=compress, sync_overlap=sync_overlap,
                  on_failure=on_failure, host_memory=isinstance(params.data, np.ndarray),
                  optimizer=optimizer, model=model if overlap else None, emulated_nodes=bool(emulated))
    if isinstance(speeds, str) and speeds not in ("equal", "auto"):
        raise ValueError(f"speeds must be 'equal', 'auto' or one number per rank, got {speeds!r}")
    if isinstance(speeds, str) and speeds == "auto" and probe is None:
        raise ValueError("speeds='auto' measures the ranks with probe(n): pass probe=")
    check_split_options(balance_threshold, rebalance_every)
    topology = topology if topology is not None else Topology.from_comm()
    check_batch_fits(batch_size, min_local_batch, topology.size)
    factors = emulate_slowdown if isinstance(emulate_slowdown, (list, tuple)) else [emulate_slowdown] * topology.size
    if len(factors) != topology.size:
        raise ValueError(f"emulate_slowdown has {len(factors)} factors for {topology.size} ranks")
    synchronize = getattr(getattr(model, "backend", None), "synchronize", None)
    clock = compute_clock(factors[topology.rank], emulate_clock, synchronize)
    exchange = make_exchange(topology, strategy, sync_every=sync_every, sync_optimizer_state=sync_optimizer_state,
                             compress=compress, sync_overlap=sync_overlap, emulate_link=emulate_link)
    step_optimizer = optimizer
    if intra == "shm":
        from mpidl.distributed.extras.shm import SharedWindow  # noqa: PLC0415

        exchange = SharedWindow(exchange, params, optimizer)
        step_optimizer = exchange.optimizer
    if overlap and topology.size > 1:
        from mpidl.distributed.extras.overlap import Overlapped  # noqa: PLC0415

        exchange = Overlapped(exchange, model, bucket_mb)
    if isinstance(speeds, str) and speeds == "auto":
        split = MeasuredSplit(topology, batch_size, _keeping_buffers(model, probe), clock,
                              threshold=balance_threshold, min_local_batch=min_local_batch,
                              rebalance_every=rebalance_every)
    else:
        split = FixedSplit(batch_size, topology.size, None if isinstance(speeds, str) else speeds, min_local_batch)
        if probe is not None:
            warm_up(topology, _keeping_buffers(model, probe), batch_size)
        if rebalance_every is not None:  # equal or given speeds to start from, re-fitted from the steps
            split = MeasuredSplit.from_costs(topology, batch_size, split.costs, split.batch_sizes, clock,
                                             threshold=balance_threshold, min_local_batch=min_local_batch,
                                             rebalance_every=rebalance_every, source=split.source)
    dp = DataParallel(model, step_optimizer, batch_size=batch_size, exchange=exchange, split=split,
                      weighting=weighting, on_nan=on_nan, clock=clock)
    if on_failure == "shrink":
        from mpidl.distributed.elastic import ElasticDataParallel  # noqa: PLC0415

        return ElasticDataParallel.around(dp, rebuild=lambda topo: make_exchange(   # the survivors' exchange
            topo, strategy, sync_every=sync_every, sync_optimizer_state=sync_optimizer_state,
            emulate_link=emulate_link))
    return dp



def join_data_parallel(model, optimizer, *, batch_size: int, strategy: str = "flat", sync_every: int = 50,
                       sync_optimizer_state: bool = False, weighting: str = "balanced", on_nan: str = "stop",
                       emulate_link=None):
    """In a process started into a running job by
    :meth:`~mpidl.distributed.elastic.ElasticDataParallel.grow`: the
    :class:`~mpidl.distributed.elastic.ElasticDataParallel` of the grown job (collective with
    its ranks), built with the same options as theirs, and the ``extra`` they shipped. Returns
    ``(dp, extra)``."""
    from mpidl.distributed.elastic import ElasticDataParallel  # noqa: PLC0415

    return ElasticDataParallel.join(model, optimizer, lambda topo: make_exchange(
        topo, strategy, sync_every=sync_every, sync_optimizer_state=sync_optimizer_state,
        emulate_link=emulate_link), batch_size=batch_size, weighting=weighting, on_nan=on_nan)

def _keeping_buffers(model, probe):
    """``probe`` that leaves the model's buffers (batch-norm statistics) as it found them."""
    buffers_host = getattr(model, "buffers_host", None)
    if buffers_host is None:
        return probe

    def kept(n: int) -> None:
        saved = buffers_host()
        probe(n)
        if saved:
            model.load_buffers_host(saved)

    return kept
