"""The split interface, and the fixed splits (equal, or from given speeds)."""

from __future__ import annotations

from mpidl.distributed.split import balance
from mpidl.distributed.split.balance import RankCost

__all__ = ["Split", "FixedSplit", "check_batch_fits"]


def check_batch_fits(batch_size: int, min_local_batch: int, world_size: int) -> None:
    """The one rule on the global batch: a full batch gives every rank at least
    ``min_local_batch`` samples, ``min_local_batch * P <= B``. With ``min_local_batch = 0``
    (a loop that handles an empty local batch) any ``B >= 1`` fits."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if isinstance(min_local_batch, bool) or not isinstance(min_local_batch, int) or min_local_batch < 0:
        raise ValueError(f"min_local_batch must be an integer >= 0, got {min_local_batch!r}")
    if min_local_batch * world_size > batch_size:
        raise ValueError(f"batch_size {batch_size} is smaller than {min_local_batch} x {world_size} ranks: "
                         f"every rank needs at least {min_local_batch} sample{'s' if min_local_batch > 1 else ''} "
                         "of each global batch (min_local_batch)")


class Split:
    """The batch sizes of a full global batch, ``batch_sizes`` (one per rank, summing to
    ``batch_size``), and the cost model behind them, ``costs`` (one
    :class:`~.balance.RankCost` per rank)."""

    batch_size: int
    batch_sizes: list[int]
    costs: list[RankCost]
    #: the last re-split (a dict for the log) or None
    last_change: dict | None = None

    def counts(self, n: int) -> list[int]:
        """Samples of every rank in a global batch of ``n``: :attr:`batch_sizes` for a full
        batch, the same proportions for a smaller one (largest remainder, zeros allowed)."""
        if n == self.batch_size:
            return list(self.batch_sizes)
        return balance.split_counts(n, self.batch_sizes)

    @property
    def predicted_step_s(self) -> float:
        """``max_i t_i(b_i)`` under the cost model."""
        return balance.step_time(self.costs, self.batch_sizes)

    @property
    def speeds(self) -> list[float]:
        """Every rank's marginal speed ``1 / c_i`` (samples per second)."""
        return [1.0 / cost.c for cost in self.costs]

    def observe(self, count: int, seconds: float, outside_s: float = 0.0) -> None:
        """This rank computed ``count`` samples in ``seconds`` (every step), and spent
        ``outside_s`` on the step's own work outside the compute (the previous optimizer
        update, the loop): the per-step cost a split must also balance."""

    def after_step(self, steps: int) -> dict | None:
        """After step ``steps``: re-split when due (collective then); the change, or None."""
        return None

    def describe(self) -> str:
        return f"split: batch sizes {self.batch_sizes}"


class FixedSplit(Split):
    """Equal shares (``speeds=None``), or ``b_i`` minimizing ``max_i b_i / s_i`` for the given
    relative speeds ``s_i`` (each rank at least ``min_local_batch``)."""

    def __init__(self, batch_size: int, ranks: int, speeds=None, min_local_batch: int = 1):
        check_batch_fits(batch_size, min_local_batch, ranks)
        self.batch_size = batch_size
        self.source = "equal" if speeds is None else "given"
        speeds = [1.0] * ranks if speeds is None else balance.check_speeds(speeds, ranks)
        self.costs = balance.costs_from_speeds(speeds)
        self.batch_sizes = (balance.equal_split(batch_size, ranks) if self.source == "equal"
                            else balance.solve_split(self.costs, batch_size, min_local_batch))

    def describe(self) -> str:
        speeds = ", ".join(f"{s:.3g}" for s in self.speeds)
        return f"split ({self.source} speeds [{speeds}]): batch sizes {self.batch_sizes}"

