"""mpidl.distributed: everything that talks MPI, and nothing that knows a layer.

The core (read these first)::

    data_parallel.py   DataParallel: weight, reduce, update, after_step; the loop's one object
    exchange.py        the exchange interface every strategy implements, and its message
    flat.py            one world allreduce                           (exact, the reference)
    hierarchical.py    node reduce -> leaders allreduce -> node bcast (exact)
    node.py            node allreduce; parameter average every K'    (the TNNLS scheme)
    split/             how the global batch is shared: equal, given, measured (HDP)
    topology.py        world / node / leader communicators
    channel.py         counted collectives of one level

Around it, never named by it::

    build.py           data_parallel(...): options -> the composed object, and their rules
    extras/            overlapped buckets, the shared window, compression, background syncs
    emulation/         EMULATED slow ranks and slow links
    elastic/           surviving a lost host, and a host joining (ULFM)
    checkpoint.py      a DataParallel's state as a dict, and back
    launch.py          the job: agreed set-up errors, ending every rank on a failure
"""

from mpidl.distributed.build import OptionError, check_options, data_parallel, make_exchange
from mpidl.distributed.data_parallel import ON_NAN, WEIGHTINGS, DataParallel, NonFiniteGradient
from mpidl.distributed.exchange import Exchange
from mpidl.distributed.flat import Flat
from mpidl.distributed.hierarchical import Hierarchical
from mpidl.distributed.node import Node
from mpidl.distributed.split import FixedSplit, MeasuredSplit, Split
from mpidl.distributed.topology import Topology

__all__ = ["DataParallel", "NonFiniteGradient", "ON_NAN", "WEIGHTINGS", "Exchange", "Flat", "Hierarchical",
           "Node", "Split", "FixedSplit", "MeasuredSplit", "Topology", "data_parallel", "make_exchange",
           "check_options", "OptionError"]
