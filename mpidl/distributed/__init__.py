"""mpidl.distributed: everything that talks MPI, and nothing that knows a layer.

* :mod:`~mpidl.distributed.data_parallel` ``DataParallel``: the public object a training
  loop uses (split, step, sync, decisions); its split is :mod:`~mpidl.distributed.hdp`, its
  checkpoint state :mod:`~mpidl.distributed.checkpoint_state`
* :mod:`~mpidl.distributed.exchange`  ``build_exchange``: the strategy and its variants behind
  one interface (``reducer_base.Reducer``), and the rules between their options
* :mod:`~mpidl.distributed.reducers`  the strategies (``flat.py``, ``hierarchical.py``,
  ``node.py``) and ``make_reducer``; :mod:`~mpidl.distributed.message` the message layout
* :mod:`~mpidl.distributed.shm`       node-shared buffers in an MPI-3 window (``intra='shm'``)
* :mod:`~mpidl.distributed.overlap`   bucketed non-blocking gradient exchange (``overlap``)
* :mod:`~mpidl.distributed.compress`  16-bit inter-node exchange with error feedback
* :mod:`~mpidl.distributed.topology`  world / node / leader communicators
* :mod:`~mpidl.distributed.balance`   rank speeds -> local batch sizes and data shares
* :mod:`~mpidl.distributed.emulation` EMULATED slow ranks and slow inter-node links
* :mod:`~mpidl.distributed.launch`    the job: rank, agreed errors, ending every rank on a failure
* :mod:`~mpidl.distributed.recovery`  surviving a lost rank with ULFM (revoke, shrink, agree), and
  :mod:`~mpidl.distributed.elastic` DataParallel's ``on_failure='shrink'`` on top of it
"""

from mpidl.distributed.balance import (RankCost, choose_split, fit_cost, parse_speeds, solve_split,
                                       split_counts)
from mpidl.distributed.data_parallel import ON_NAN, DataParallel, NonFiniteGradient
from mpidl.distributed.recovery import ON_FAILURE, RanksLost, RecoveryError
from mpidl.distributed.emulation import LinkModel, Slowdown, parse_link, parse_slowdowns
from mpidl.distributed.reducers import (LEVELS, STRATEGIES, WEIGHTINGS, FlatReducer,
                                        HierarchicalReducer, NodeReducer, Reducer, make_reducer)
from mpidl.distributed.topology import Topology

__all__ = [
    "DataParallel", "NonFiniteGradient", "ON_NAN", "ON_FAILURE", "RanksLost", "RecoveryError", "Topology", "make_reducer", "Reducer",
    "FlatReducer", "HierarchicalReducer", "NodeReducer", "STRATEGIES", "WEIGHTINGS", "LEVELS",
    "RankCost", "fit_cost", "solve_split", "choose_split", "split_counts", "parse_speeds",
    "Slowdown", "LinkModel",
    "parse_slowdowns", "parse_link",
]
