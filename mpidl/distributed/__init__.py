"""mpidl.distributed: everything that talks MPI, and nothing that knows a layer.

* :mod:`~mpidl.distributed.topology`  world / node / leader communicators
* :mod:`~mpidl.distributed.balance`   rank speeds -> local batch sizes and data shares
* :mod:`~mpidl.distributed.reducers`  gradient reduction strategies (``make_reducer``)
* :mod:`~mpidl.distributed.emulation` EMULATED slow ranks and slow inter-node links
"""

from mpidl.distributed.balance import (batch_sizes, gather_speeds, measure_speed, parse_speeds,
                                       rebalance, split_counts)
from mpidl.distributed.emulation import LinkModel, Slowdown, parse_link, parse_slowdowns
from mpidl.distributed.reducers import (STRATEGIES, WEIGHTINGS, FlatReducer, HierarchicalReducer,
                                        NodeReducer, Reducer, make_reducer)
from mpidl.distributed.topology import Topology

__all__ = [
    "Topology", "make_reducer", "Reducer", "FlatReducer", "HierarchicalReducer", "NodeReducer",
    "STRATEGIES", "WEIGHTINGS", "batch_sizes", "split_counts", "measure_speed", "gather_speeds",
    "parse_speeds", "rebalance", "Slowdown", "LinkModel", "parse_slowdowns", "parse_link",
]
