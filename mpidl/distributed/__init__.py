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

Open MPI: the only one-sided window here is the node-shared one (``intra='shm'``), which is
osc/sm's. Where UCX has no transport for RMA (a container or a cluster on TCP only), Open MPI
5.0's osc/ucx still answers the query of every new window with "Error: OSC UCX component
priority set inside component query failed" on each rank, and then is not used. So, before
MPI starts (mpi4py initialises it at import, and every use of MPI here imports this package
first), osc/ucx is left out of the selection unless the user chose the osc components
(``OMPI_MCA_osc`` set): ``OMPI_MCA_osc=^ucx``. MPICH ignores the variable.
"""

import os

os.environ.setdefault("OMPI_MCA_osc", "^ucx")

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
