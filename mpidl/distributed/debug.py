"""Debug checks a loop may run on a :class:`~mpidl.distributed.DataParallel` (collective)."""

from __future__ import annotations

import hashlib

import numpy as np

from mpidl.engine.backend import to_host

__all__ = ["check_replicas"]


def check_replicas(dp) -> None:
    """Raise RuntimeError on every rank when the replicas' parameters are not bitwise equal
    (a SHA-1 of every rank's ``params.data``, gathered); call it where they must agree: after
    every step of an exact exchange, after a sync of the node strategy."""
    digest = hashlib.sha1(np.ascontiguousarray(to_host(dp.params.data)).tobytes()).hexdigest()
    digests = dp.all_gather_object(digest)
    if len(set(digests)) != 1:
        raise RuntimeError(f"replicas diverged at step {dp.steps}: checksums {digests}")
