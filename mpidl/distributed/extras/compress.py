"""Compressed inter-node exchange (``compress='bf16' | 'fp16'``), with error feedback.

:class:`Compressed` is a channel around the leaders' ``inter`` channel of the hierarchical
strategy: only the slow network is compressed, inside a node the exchange stays exact, and
the strategy does not know. A leader's message ``m = [x (n) | count | stop | nonfinite]`` travels as ``n`` 16-bit
values plus the three slots in float64 (counts and flags stay exact), so the bytes it hands
to MPI fall from ``4 n`` (float32) to ``2 n + 24``.

Error feedback. Each leader keeps the rounding error of its last message of this kind,
``e``, and sends ``q = Q(x + e)``, then keeps ``e <- (x + e) - D(q)`` (``Q``: round to the
16-bit format, ``D``: back to float). What one exchange loses is thus added to the next one,
so the error does not accumulate over the exchanges: ``sum_t D(q_t) = sum_t x_t + e_0 - e_T``.

Accumulation. MPI has no SUM over 16-bit floats that accumulates in float32, so the leaders
``Allgather`` the compressed messages and every leader sums the ``L`` decoded ones in node
order in float32 (float64 for float64 models): every leader gets bitwise the same sum. For
``L`` nodes a leader receives ``(L-1) (2 n + 24)`` bytes, against ``2 (L-1) 4 n / L`` for a
ring allreduce of float32: half at ``L = 2``, and no gain from about ``L = 4`` on (a
compressed reduce-scatter would be the next step).

``bf16``: the top 16 bits of float32, round to nearest even (8 exponent bits: the range of
float32, 8 significant bits). ``fp16``: IEEE half (11 significant bits, but |x| > 65504
overflows to inf, which the non-finite check then catches).
"""

from __future__ import annotations

import numpy as np

from mpidl.distributed.message import SLOTS

__all__ = ["COMPRESSIONS", "Compressor", "Compressed", "check_options", "to_bf16", "from_bf16"]

COMPRESSIONS = ("none", "bf16", "fp16")


def check_compression(kind) -> str:
    """``kind`` must be one of :data:`COMPRESSIONS`."""
    if kind not in COMPRESSIONS:
        raise ValueError(f"compress must be one of {', '.join(COMPRESSIONS)}, got {kind!r}")
    return kind


def check_options(kind, strategy: str, overlap: bool) -> None:
    """ValueError unless ``kind`` is known and, when not 'none', the strategy has a gradient
    exchange between nodes of its own (hierarchical) and it is blocking. (The node strategy's
    inter-node traffic is its parameter average, already 1/K' of the gradients': compressing
    parameters to 16 bits would lose their low bits.)"""
    check_compression(kind)
    if kind == "none":
        return
    if strategy != "hierarchical":
        raise ValueError(f"compress acts on the leaders' gradient exchange of strategy hierarchical, not {strategy}")
    if overlap:
        raise ValueError("compress acts on the blocking exchange (not with overlap)")


def to_bf16(x) -> np.ndarray:
    """float -> bfloat16 bits (uint16), round to nearest, ties to even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def from_bf16(bits) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32."""
    return (np.asarray(bits, dtype=np.uint32) << np.uint32(16)).view(np.float32)


class Compressor:
    """The compressed SUM of a message among the leaders (see the module docstring)."""

    def __init__(self, kind: str):
        if check_compression(kind) == "none":
            raise ValueError("Compressor('none'): no compression has no compressor")
        self.kind = kind
        #: rounding error carried to the next exchange, per kind of message
        self.residuals: dict = {}

    def encode(self, x) -> np.ndarray:
        return to_bf16(x) if self.kind == "bf16" else np.asarray(x, np.float32).astype(np.float16).view(np.uint16)

    def decode(self, bits) -> np.ndarray:
        return from_bf16(bits) if self.kind == "bf16" else bits.view(np.float16).astype(np.float32)

    def packed(self, message, key) -> np.ndarray:
        """This leader's message as uint16: ``Q(x + e)`` then the slots as float64 (updates e)."""
        n = message.size - SLOTS
        x = message[:n]
        residual = self.residuals.get(key)
        if residual is None or residual.shape != x.shape:
            residual = self.residuals[key] = np.zeros_like(x)
        corrected = x + residual
        bits = self.encode(corrected)
        residual[...] = corrected - self.decode(bits)
        slots = np.asarray(message[n:], dtype=np.float64).view(np.uint16)
        return np.concatenate([bits, slots])

    def unpack_sum(self, gathered, message) -> None:
        """``message <- sum over the gathered leaders`` (node order, >= float32 accumulation)."""
        n = message.size - SLOTS
        acc_dtype = np.promote_types(message.dtype, np.float32)
        acc = np.zeros(n, dtype=acc_dtype)
        slots = np.zeros(SLOTS, dtype=np.float64)
        for row in gathered:
            acc += self.decode(row[:n])
            slots += np.ascontiguousarray(row[n:]).view(np.float64)
        message[:n] = acc
        message[n:] = slots


class Compressed:
    """A channel whose SUM (:meth:`allreduce`) travels compressed: each rank's ``Q(x + e)``
    is gathered and every rank sums the decoded messages in rank order (bitwise the same sum
    everywhere); the residual ``e`` is kept per message size (one per kind of message)."""

    def __init__(self, channel, kind: str):
        self.channel = channel
        self.compressor = Compressor(kind)

    def __getattr__(self, name):  # level, comm, traffic, size, is_root, communicators
        return getattr(self.channel, name)

    def allreduce(self, message) -> None:
        if self.channel.size <= 1:
            return
        packed = self.compressor.packed(message, message.size)
        gathered = np.empty((self.channel.size, packed.size), dtype=packed.dtype)
        self.channel.allgather(packed, gathered)
        self.compressor.unpack_sum(gathered, message)

    def reduce(self, array) -> None:
        self.channel.reduce(array)

    def bcast(self, array) -> None:
        self.channel.bcast(array)

    def run(self, op: str, array) -> None:
        getattr(self, op)(array)

    def start(self, op: str, array):
        """Not compressed: refused rather than sent in full (``check_options`` keeps
        compression away from the non-blocking exchanges)."""
        raise ValueError("compress acts on the blocking exchange (not with overlap or sync_overlap)")

    def describe(self) -> str:
        return f"inter-node {self.compressor.kind}"
