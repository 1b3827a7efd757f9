"""Gradient reducers: the communication strategies, one file each, and their factory.

=================  ======================  ==========================================
strategy           file                    what it does
=================  ======================  ==========================================
``flat``           ``flat.py``             one world ``Allreduce`` per step
``hierarchical``   ``hierarchical.py``     node ``Reduce`` -> leaders ``Allreduce`` ->
                                           node ``Bcast``; same result as ``flat``
``node``           ``node.py``             node-local ``Allreduce`` every step; leaders
                                           average the parameters every ``K'`` steps
=================  ======================  ==========================================

The shared machinery (the message, the weights, counters, GPU buffers) is in
``reducer_base.py``; :class:`~mpidl.distributed.DataParallel` is what a training loop uses.
"""

from __future__ import annotations

from mpidl.distributed.emulation import LinkModel
from mpidl.distributed.flat import FlatReducer
from mpidl.distributed.hierarchical import HierarchicalReducer
from mpidl.distributed.compress import check_compression
from mpidl.distributed.node import NodeReducer, check_sync_every, check_sync_overlap
from mpidl.distributed.reducer_base import (LEVELS, WEIGHTINGS, OptionError, Reducer, check_weighting,
                                            mpi_is_cuda_aware)
from mpidl.distributed.topology import Topology

STRATEGIES = {
    FlatReducer.name: FlatReducer,
    HierarchicalReducer.name: HierarchicalReducer,
    NodeReducer.name: NodeReducer,
}

__all__ = ["make_reducer", "Reducer", "FlatReducer", "HierarchicalReducer", "NodeReducer",
           "STRATEGIES", "WEIGHTINGS", "LEVELS", "mpi_is_cuda_aware"]


def make_reducer(strategy: str, topology: Topology, weighting: str = "balanced",
                 sync_every: int = 50, emulate_link: LinkModel | str | None = None,
                 sync_overlap: int = 0, compress: str = "none") -> Reducer:
    """Create the gradient reducer for ``strategy``.

    ==================  ======  ===========================================================
    strategy            exact   when to use it
    ==================  ======  ===========================================================
    ``'flat'``          yes     The reference. One node, or a fast uniform network, or
                                few ranks: MPI's own allreduce is then hard to beat.
    ``'hierarchical'``  yes     Several ranks per node and a slower network between nodes:
                                same result as flat, but one message per node crosses the
                                network (fewer, larger inter-node messages).
    ``'node'``          no      Many ranks per node and a slow network (the TNNLS scheme):
                                nodes exchange only every ``sync_every`` (K') steps, so
                                inter-node traffic falls by about K' x ranks per node, at
                                the price of replicas that differ between syncs. With one
                                node it is the flat scheme without any inter-node traffic.
    ==================  ======  ===========================================================

    Parameters
    ----------
    strategy : 'flat' | 'hierarchical' | 'node'
    topology : Topology
    weighting : 'balanced' | 'uniform'
        balanced: rank i contributes ``(b_i / B) g_i`` (``B`` = samples of the ranks that
        reduce together): the exact gradient of the batch's mean loss. uniform: ``g_i / n``,
        the naive baseline, biased when local batches differ. (Both are carried out as a SUM
        of ``[c_i g_i | c_i]`` divided by the summed ``c_i``; see ``reducer_base``.)
    sync_every : int
        ``K'``, the steps between parameter syncs of the node strategy (ignored otherwise,
        but validated).
    emulate_link : LinkModel or 'LATENCY_US,GBIT_S' or None
        EMULATION: sleep the modelled time of every inter-node collective.
    sync_overlap : int
        ``node``: apply each parameter sync this many steps after starting it
        non-blockingly (0: blocking); see :meth:`NodeReducer._start_async`.
    compress : 'none' | 'bf16' | 'fp16'
        ``hierarchical`` / ``node``: the leaders' exchange in 16 bits
        (:mod:`~mpidl.distributed.compress`).

    Raises :class:`OptionError` (a ValueError) as :func:`check_strategy` says.
    """
    check_strategy(strategy, weighting, sync_every, sync_overlap, compress)
    if strategy == NodeReducer.name:
        return NodeReducer(topology, weighting, sync_every=sync_every, emulate_link=emulate_link,
                           sync_overlap=sync_overlap, compress=compress)
    return STRATEGIES[strategy](topology, weighting, emulate_link=emulate_link, compress=compress)


def check_strategy(strategy, weighting="balanced", sync_every=50, sync_overlap=0, compress="none") -> None:
    """The strategy's options, each rule once (no MPI); :class:`OptionError` names the option:
    a known strategy and weighting, ``sync_every >= 1`` (checked for every strategy: a bad
    value is a bad configuration), ``sync_overlap`` only with ``node`` (and ``< sync_every``,
    uncompressed), ``compress`` only where there is an inter-node exchange of its own
    (hierarchical, node)."""
    def owned(option, check, *args):
        try:
            check(*args)
        except ValueError as exc:
            raise OptionError(option, str(exc)) from None

    if strategy not in STRATEGIES:
        raise OptionError("strategy", f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    owned("weighting", check_weighting, weighting)
    owned("sync_every", check_sync_every, sync_every)
    owned("compress", check_compression, compress)
    if compress != "none" and strategy == FlatReducer.name:
        raise OptionError("compress", "compress acts on the inter-node exchange of the hierarchical or "
                                      "node strategy (not flat)")
    if sync_overlap and strategy != NodeReducer.name:
        raise OptionError("sync_overlap", "sync_overlap applies to strategy='node'")
    owned("sync_overlap", check_sync_overlap, sync_overlap, sync_every, compress)
