"""Surviving a lost host: a wrapper and a loop helper that the core never names.

The core :class:`~mpidl.distributed.DataParallel` knows nothing of failures. With
``data_parallel(..., on_failure='shrink')`` it is wrapped::

    recovery.py        the MPI part (ULFM): revoke, shrink, quorum, the agreed step, snapshots,
                       re-split, rebuilt topology, leave
    confirmed.py       the core's exchange as the wrapper sees it: each step and sync confirmed
                       by an agreement, and where the core is when a failure is seen
    data_parallel.py   ElasticDataParallel: guards every collective call of the core; on a lost
                       rank shrinks, goes back, builds a new core for the survivors, raises RanksLost;
                       grow/join: new ranks started into the running job take its state
    loop.py            run_surviving: a stretch of steps (an epoch) run again from the step the
                       survivors went back to
"""

from mpidl.distributed.elastic.confirmed import ConfirmedExchange
from mpidl.distributed.elastic.data_parallel import ElasticDataParallel
from mpidl.distributed.elastic.loop import run_surviving
from mpidl.distributed.elastic.recovery import (ON_FAILURE, RanksLost, RecoveryError, check_on_failure,
                                                ulfm_available)

__all__ = ["ElasticDataParallel", "ConfirmedExchange", "run_surviving", "RanksLost", "RecoveryError",
           "ON_FAILURE", "check_options", "ulfm_available"]


def check_options(intra: str = "mpi", overlap: bool = False, compress: str = "none", sync_overlap: int = 0,
                  emulated_nodes: bool = False) -> None:
    """ValueError when ``on_failure='shrink'`` cannot rebuild these options after a loss (no MPI)."""
    check_on_failure("shrink", intra=intra, overlap=overlap, compress=compress, sync_overlap=sync_overlap,
                     emulated_nodes=emulated_nodes)
