"""Trainer options under mpiexec: re-balancing, emulation, per-rank timing files, augmentation."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from mpi4py import MPI

from mpidl.distributed import NonFiniteGradient
from trainer_harness import all_agree, make_trainer, run, tiny_dataset

WORLD = MPI.COMM_WORLD
P = WORLD.Get_size()
BASE = ["--batch-size", "24", "--epochs", "2", "--lr", "0.05", "--schedule", "constant"]


class RecordedClock:
    """A clock that advances only by what it is told: the compute of ``n`` samples costs
    ``n * SECONDS_PER_SAMPLE``, an emulated slowdown's sleep its request, and nothing else
    (other processes, the machine's load) moves it."""

    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


SECONDS_PER_SAMPLE = 1e-3


@pytest.mark.mpi(min_size=2)
def test_rebalance_moves_work_away_from_an_emulated_slow_rank(monkeypatch):
    """Equal given speeds, but the last rank is EMULATED 6x slower (--emulate-slowdown): after
    4 steps the split must follow the measured compute time per sample, identically on every
    rank. The times are those of a recorded clock (every sample costs the same on every rank,
    the slowdown's sleep is recorded, not slept), so the measured slowdown is exactly 6 and
    no load on the machine can blur it: the split must be the balanced one."""
    import mpidl.distributed.clock as clock_module
    from mpidl.distributed.emulation import SlowedClock

    clock = RecordedClock()
    monkeypatch.setattr(clock_module, "time", SimpleNamespace(perf_counter=clock.now))  # ComputeClock's
    slow = ",".join(["1"] * (P - 1) + ["6"])
    trainer = make_trainer(WORLD, BASE + ["--speeds", ",".join(["1"] * P), "--rebalance",
                                          "--rebalance-every", "4", "--emulate-slowdown", slow],
                           train=tiny_dataset(n=96))
    compute = trainer.compute

    def recorded_compute(indices):
        clock.advance(SECONDS_PER_SAMPLE * len(indices))
        return compute(indices)

    trainer.compute = recorded_compute
    is_slowed = isinstance(trainer.dp.clock, SlowedClock)
    assert all_agree(WORLD, is_slowed == (WORLD.rank == P - 1))
    if is_slowed:
        trainer.dp.clock.slowdown.sleep = clock.advance
        trainer.dp.clock.slowdown.clock = clock.now
    trainer.run()
    sizes = trainer.dp.batch_sizes
    gathered = WORLD.allgather(sizes)
    assert all(g == gathered[0] for g in gathered)
    assert sum(sizes) == 24
    assert all_agree(WORLD, sizes[-1] < min(sizes[:-1])), f"slow rank kept its share: {sizes}"
    # Balanced for per-sample costs 1 : 6 (within one sample either way): the slow rank's
    # step is neither the bottleneck nor idle for more than one of its samples.
    assert all_agree(WORLD, 6 * sizes[-1] <= max(sizes[:-1]) + 6 and max(sizes[:-1]) <= 6 * (sizes[-1] + 1)), sizes


@pytest.mark.mpi(min_size=2)
def test_emulated_link_adds_modelled_time_on_inter_node_collectives():
    trainer, _ = run(WORLD, BASE + ["--strategy", "node", "--sync-every", "2", "--speeds",
                                    ",".join(["1"] * P), "--emulate-link", "2000,1"],
                     ranks_per_node=1)
    # one rank per node: every rank leads a node and pays the modelled inter-node time
    syncs = trainer.dp.counters["inter"]["calls"]
    assert all_agree(WORLD, syncs > 0 and trainer.dp.exchange.traffic.emulated_seconds > 0)


@pytest.mark.mpi
def test_every_rank_writes_its_own_timing_file(tmp_path_factory):
    folder = WORLD.bcast(str(tmp_path_factory.mktemp("timing")) if WORLD.rank == 0 else None)
    run(WORLD, BASE + ["--speeds", ",".join(["1"] * P), "--timing-dir", folder])
    WORLD.Barrier()
    path = Path(folder) / f"rank{WORLD.rank}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    ok = len(records) == 2 and all(r["rank"] == WORLD.rank and r["comp_s"] > 0 for r in records)
    assert all_agree(WORLD, ok), records


@pytest.mark.mpi
def test_augmentation_trains_and_is_identical_across_replicas():
    trainer, end = run(WORLD, BASE + ["--speeds", ",".join(["1"] * P), "--augment"],
                       train=tiny_dataset(n=48, shape=(5, 5, 5)))
    digests = WORLD.allgather(trainer.params.data.tobytes())
    assert end["step"] == 4 and all(d == digests[0] for d in digests)


@pytest.mark.mpi
def test_node_strategy_on_one_node_stops_inside_the_epoch():
    """One node: every step's reduction spans the world, so a stop request is agreed at the
    next step, not at the epoch's end (7 steps per epoch here)."""
    _, end = run(WORLD, ["--batch-size", "8", "--epochs", "2", "--strategy", "node", "--sync-every", "50",
                         "--speeds", ",".join(["1"] * P)], ranks_per_node=P, stop_after=2)
    assert all_agree(WORLD, end["stopped"] == "signal" and end["step"] == 3), end


@pytest.mark.mpi(min_size=2)
def test_max_steps_does_not_drop_a_pending_node_nan(monkeypatch):
    """A node's non-finite gradient under ``node`` is decided at the next sync; a run that
    ends by --max-steps before it still meets that decision (the last epoch-end sync)."""
    monkeypatch.setenv("MPIDL_INJECT_FAULT", "0:1:nan")
    try:
        run(WORLD, ["--batch-size", "8", "--epochs", "2", "--strategy", "node", "--sync-every", "100",
                    "--speeds", ",".join(["1"] * P), "--max-steps", "3"],
            ranks_per_node=1)
        outcome = "completed"
    except NonFiniteGradient as exc:
        outcome = "nan" if "non-finite" in str(exc) else str(exc)
    assert WORLD.allgather(outcome) == ["nan"] * P


@pytest.mark.mpi
def test_comm_seconds_mean_the_same_in_metrics_and_timing_files(tmp_path_factory):
    """``comm_s`` is the time in the distributed step minus the idle estimate, in both files."""
    folder = Path(WORLD.bcast(str(tmp_path_factory.mktemp("timing")) if WORLD.rank == 0 else None))
    run(WORLD, BASE + ["--speeds", ",".join(["1"] * P), "--timing-dir", str(folder / "t"),
                       "--metrics", str(folder / "m.jsonl")])
    WORLD.Barrier()
    epochs = [json.loads(line) for line in (folder / "m.jsonl").read_text().splitlines()
              if json.loads(line)["event"] == "epoch"]
    own = [json.loads(line) for line in (folder / "t" / f"rank{WORLD.rank}.jsonl").read_text().splitlines()]
    ok = len(epochs) == len(own) == 2
    ok = ok and all(e["comm_s"][WORLD.rank] == o["comm_s"] and e["idle_s"][WORLD.rank] == o["idle_s"]
                    for e, o in zip(epochs, own))
    assert all_agree(WORLD, ok)
