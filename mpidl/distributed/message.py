"""The message a rank exchanges each step: its gradient and three slots, one flat buffer::

    message = [ g_i (P scalars) | count | stop | nonfinite ]       (FlatParameters.message)

(see :mod:`~mpidl.distributed.reducer_base` for what the slots carry).
"""

from __future__ import annotations

#: positions of the three slots after the gradient, counted from the end of the message
COUNT, STOP, NONFINITE = -3, -2, -1
SLOTS = 3


def check_message(message) -> None:
    """The reducers exchange one flat, contiguous 1-D message: ``P`` gradients + 3 slots."""
    if getattr(message, "ndim", None) != 1 or not message.flags.c_contiguous or message.size <= SLOTS:
        raise ValueError("the reducer works on one flat, contiguous 1-D message of the gradients "
                         f"and {SLOTS} slots (FlatParameters.message); got shape "
                         f"{getattr(message, 'shape', None)}")
