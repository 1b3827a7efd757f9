"""The exchange: one interface over every strategy and variant, and the factory that builds it.

``build_exchange`` composes, from the options, what :class:`~mpidl.distributed.DataParallel`
calls every step (the interface is :class:`~mpidl.distributed.reducer_base.Reducer`'s)::

    strategy (reducers.py)          flat | hierarchical | node (K', sync_overlap)
      + compress (the strategy)      16-bit inter-node exchange   (hierarchical, node)
      + variant (wraps it)           intra='shm': the node-shared window   (shm.py)
                                     overlap=True: buckets started by backward (overlap.py)

==================  =====================================================================
option              works with
==================  =====================================================================
``compress``        ``hierarchical`` or ``node``, the blocking exchange (no ``overlap``)
``sync_overlap``    ``node`` with ``intra='mpi'`` and no ``compress``; ``< sync_every``
``overlap``         ``flat`` or ``hierarchical``, ``intra='mpi'``, the CPU backend, a
                    Model whose ``net`` is a Sequential
``intra='shm'``     the CPU backend and an elementwise optimizer
==================  =====================================================================

Each rule is written once, in the part that owns it (the strategy's in
:func:`~mpidl.distributed.reducers.check_strategy`, the variants' here), and
:func:`check_options` checks them all without MPI (the command line calls it too, and names
the option from :attr:`OptionError.option`).
"""

from __future__ import annotations

from numbers import Real

import numpy as np

from mpidl.distributed.overlap import OVERLAP_STRATEGIES, Overlapped
from mpidl.distributed.reducer_base import OptionError, Reducer
from mpidl.distributed.reducers import check_strategy, make_reducer
from mpidl.distributed.shm import SharedExchange, check_elementwise

#: how the ranks of one node combine: MPI messages on private replicas, or the shared window
INTRA = ("mpi", "shm")
#: default bucket size of ``overlap`` (MiB)
BUCKET_MB = 1.0

__all__ = ["OptionError", "check_options", "build_exchange", "INTRA", "BUCKET_MB"]


def check_options(*, strategy: str = "flat", weighting: str = "balanced", sync_every: int = 50,
                  intra: str = "mpi", overlap: bool = False, bucket_mb: float = BUCKET_MB,
                  compress: str = "none", sync_overlap: int = 0, host_memory: bool = True,
                  optimizer=None) -> None:
    """Raise :class:`OptionError` when the options do not fit together (see the module table);
    ``host_memory``: the parameters are NumPy arrays (the CPU backend); ``optimizer``: the
    optimizer or its class (None: not checked here)."""
    def rule(option, ok, message):
        if not ok:
            raise OptionError(option, message)

    check_strategy(strategy, weighting, sync_every, sync_overlap, compress)
    rule("intra", intra in INTRA, f"intra must be one of {', '.join(INTRA)}, got {intra!r}")
    rule("bucket_mb", not isinstance(bucket_mb, bool) and isinstance(bucket_mb, Real)
         and 0 < bucket_mb < float("inf"), f"bucket_mb must be a number > 0, got {bucket_mb!r}")
    rule("compress", compress == "none" or not overlap,
         "compress acts on the blocking exchange (not with overlap)")
    rule("sync_overlap", not sync_overlap or intra == "mpi", "sync_overlap works with intra='mpi'")
    if overlap:
        rule("overlap", strategy in OVERLAP_STRATEGIES,
             f"overlap works with strategy {' or '.join(OVERLAP_STRATEGIES)}, not {strategy!r}")
        rule("overlap", intra == "mpi", "overlap works with intra='mpi' (the shared window is reduced in place)")
        rule("overlap", host_memory, "overlap needs the CPU backend (host buffers for non-blocking MPI)")
    rule("intra", intra != "shm" or host_memory, "intra='shm' shares host memory: it needs the CPU backend")
    if intra == "shm" and optimizer is not None:
        try:
            check_elementwise(optimizer)
        except ValueError as exc:
            raise OptionError("intra", str(exc)) from None


def build_exchange(model, params, optimizer, topology, *, strategy: str = "flat",
                   weighting: str = "balanced", sync_every: int = 50, emulate_link=None,
                   intra: str = "mpi", overlap: bool = False, bucket_mb: float = BUCKET_MB,
                   compress: str = "none", sync_overlap: int = 0, check_only: bool = False) -> Reducer | None:
    """The exchange for these options (collective unless ``check_only``, which only raises
    what building would: every rule before any MPI call)."""
    check_options(strategy=strategy, weighting=weighting, sync_every=sync_every, intra=intra,
                  overlap=overlap, bucket_mb=bucket_mb, compress=compress, sync_overlap=sync_overlap,
                  host_memory=isinstance(params.data, np.ndarray), optimizer=optimizer)
    if overlap:
        Overlapped.check_model(model)
    if intra == "shm":
        SharedExchange.check(params, optimizer)
    if check_only:
        return None
    exchange = make_reducer(strategy, topology, weighting=weighting, sync_every=sync_every,
                            emulate_link=emulate_link, sync_overlap=sync_overlap, compress=compress)
    if intra == "shm":
        exchange = SharedExchange(exchange, params, optimizer)
    if overlap and topology.size > 1:  # one rank has nothing to exchange
        exchange = Overlapped(exchange, model, bucket_mb)
    return exchange
