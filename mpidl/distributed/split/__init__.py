"""How the global batch ``B`` is shared by the ranks: the split (heterogeneous data parallelism).

:class:`~mpidl.distributed.DataParallel` asks its split for every rank's share of a global
batch (:meth:`Split.counts`), tells it every step's compute time (:meth:`Split.observe`), and
lets it re-split after a step (:meth:`Split.after_step`, collective when it acts).

=====================  =================================================================
split                  when
=====================  =================================================================
:class:`FixedSplit`    equal shares, or shares from speeds the caller gives
                       (``b_i ~ B s_i / sum_j s_j``)
:class:`MeasuredSplit` every rank's cost ``t_i(b) = a_i + c_i b`` measured by timed passes
                       of the real model; the split minimizing the slowest rank's step;
                       optionally re-fitted from the steps themselves while training
=====================  =================================================================

The math (cost models, the min-max split, re-fitting) is :mod:`.balance`; the measurement
before training :mod:`.probe`.
"""

from mpidl.distributed.split.base import FixedSplit, Split, check_batch_fits
from mpidl.distributed.split.measured import MeasuredSplit

__all__ = ["Split", "FixedSplit", "MeasuredSplit", "check_batch_fits"]
