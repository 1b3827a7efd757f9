"""Surviving a lost host (and a host joining the running job): a wrapper the core never names.

:class:`~mpidl.distributed.elastic.recovery` holds the MPI part (ULFM: revoke, shrink, agree,
quorum); the wrapper around a :class:`~mpidl.distributed.DataParallel` and the loop helper
build on it.
"""

from mpidl.distributed.elastic.recovery import (ON_FAILURE, RanksLost, RecoveryError, check_on_failure,
                                                ulfm_available)

__all__ = ["RanksLost", "RecoveryError", "ON_FAILURE", "check_options", "ulfm_available"]


def check_options(intra: str = "mpi", overlap: bool = False, compress: str = "none", sync_overlap: int = 0,
                  emulated_nodes: bool = False) -> None:
    """ValueError when ``on_failure='shrink'`` cannot rebuild these options after a loss (no MPI)."""
    check_on_failure("shrink", intra=intra, overlap=overlap, compress=compress, sync_overlap=sync_overlap,
                     emulated_nodes=emulated_nodes)
