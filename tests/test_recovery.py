"""Surviving a lost rank: the MPI mechanics (mpidl.distributed.elastic.recovery).

The pure parts (snapshots, the re-split, the agreed step) are tested serially; the whole
recovery is tested for real: tests/recovery_worker.py runs under mpiexec, a rank SIGKILLs
itself mid-loop, and the survivors must shrink, rebuild, re-split and end with the parameters
of an uninterrupted run (float64, <= 1e-10). Under an MPI without failure recovery the worker
says why and the test skips with that reason. Every launch has a timeout, after which the
launcher's process group and every process carrying the launch's tag are killed
(launcher.run_tagged).
"""

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import recovery_worker as worker
from launcher import OPENMPI, available, flavor, mpiexec, run_tagged
from mpidl import settings
from mpidl.distributed.elastic.recovery import (Members, RecoveryError, StepSnapshots, agreed_step, has_quorum,
                                                is_process_failure, resplit, ulfm_available)
from mpidl.distributed.split.balance import RankCost

WORKER = str(Path(__file__).with_name("recovery_worker.py"))
LAUNCH_TIMEOUT_S = 45


# --------------------------------------------------------------------------- serial parts
def test_snapshots_keep_the_state_before_the_last_two_steps():
    w = np.arange(3.0)
    snaps = StepSnapshots()
    for step in range(4):
        snaps.save(step, {"w": w})
        w += 10.0  # the step
    assert snaps.steps == [2, 3]
    snaps.restore(2, {"w": w})
    np.testing.assert_array_equal(w, np.arange(3.0) + 20.0)
    snaps.save(2, {"w": w})  # the step is run again after a restore
    assert snaps.steps == [2, 3]
    with pytest.raises(RecoveryError, match="no snapshot of step 1"):
        snaps.restore(1, {"w": w})


def test_a_restore_writes_into_the_callers_arrays():
    w = np.ones(4)
    view = w[:]
    snaps = StepSnapshots()
    snaps.save(0, {"w": w})
    w *= 3.0
    snaps.restore(0, {"w": w})
    np.testing.assert_array_equal(view, np.ones(4))


def test_a_lost_rank_is_a_rank_of_speed_zero():
    # old split 2,4,6 over ranks 0,1,2; rank 1 lost: 12 samples in proportion 2:6
    assert resplit(12, [2, 4, 6], survivors=[0, 2]) == [3, 9]
    # with cost models, the optimal split of the survivors' models
    costs = [RankCost(0.0, 1.0), RankCost(0.0, 0.5), RankCost(0.0, 0.25)]
    assert resplit(12, [2, 4, 6], survivors=[0, 2], costs=costs) == [2, 10]  # times 2 and 2.5
    assert resplit(12, [2, 4, 6], survivors=[1]) == [12]
    # survivors that had no samples share the batch equally
    assert resplit(5, [0, 0, 5], survivors=[0, 1]) == [3, 2]
    with pytest.raises(ValueError, match="not distinct ranks"):
        resplit(12, [6, 6], survivors=[0, 2])


def test_only_a_majority_goes_on_and_a_tie_goes_to_the_lowest_rank():
    assert has_quorum(range(4), [0, 1, 2])
    assert not has_quorum(range(4), [3])
    assert has_quorum(range(4), [0, 1]) and not has_quorum(range(4), [2, 3])  # the two sides of a cut
    assert has_quorum([1, 2], [1]) and not has_quorum([1, 2], [2])  # after an earlier shrink
    with pytest.raises(ValueError, match="not a part of"):
        has_quorum([0, 1], [5])


def test_the_agreed_step_is_the_smallest_and_refuses_a_gap():
    assert agreed_step(MPI.COMM_SELF, 7) == 7
    with pytest.raises(RecoveryError, match="differ by more than one"):
        agreed_step(_FakeComm([3, 5]), 5)
    assert agreed_step(_FakeComm([4, 5, 5]), 5) == 4


class _FakeComm:
    """Stands in for a communicator whose ranks hold ``counts``."""

    def __init__(self, counts):
        self.counts = counts

    def allgather(self, _):
        return list(self.counts)


def test_members_and_support_on_one_process():
    members = Members.gather(MPI.COMM_SELF)
    assert members.ids == (0,) and members.hosts == (MPI.Get_processor_name(),)
    ok, reason = ulfm_available(MPI.COMM_SELF)
    assert isinstance(ok, bool) and reason
    assert not is_process_failure(ValueError("not MPI"))


def test_support_can_be_forced_off_or_on(monkeypatch):
    """MPIDL_ULFM is read once by mpidl.settings (a test sets it there; a user in the
    environment of the ranks); a malformed value turns fault tolerance off and says why."""
    for value, expected in (("0", (False, "turned off by MPIDL_ULFM=0")), ("1", (True, "forced by MPIDL_ULFM=1")),
                            ("maybe", (False, "environment variable MPIDL_ULFM must be 1 or 0, got 'maybe'; "
                                              "fault tolerance off"))):
        monkeypatch.setattr(settings, "SETTINGS", settings.Settings.from_environ({"MPIDL_ULFM": value}))
        assert ulfm_available(MPI.COMM_SELF) == expected


def test_snapshots_keep_small_values_beside_the_arrays():
    w = np.zeros(2)
    snaps = StepSnapshots()
    snaps.save(0, {"w": w}, {"steps": 0, "exchange": {"steps_since_sync": 3}})
    w += 1.0
    snaps.save(0, {"w": w}, {"steps": 0, "redo": "synchronize"})  # saved again: both replaced
    w += 1.0
    assert snaps.restore(0, {"w": w}) == {"steps": 0, "redo": "synchronize"}
    np.testing.assert_array_equal(w, [1.0, 1.0])


# --------------------------------------------------------------------------- under mpiexec
def _launch(ranks: int, out: Path, *args: str) -> dict:
    """Run the worker on ``ranks`` ranks; returns each survivor's record by start-up rank,
    or skips with the worker's reason where the MPI cannot recover."""
    if not available():
        pytest.skip("no mpiexec")
    # ULFM is on only when the launcher is told; the MPICH wheel has none to turn on. On this
    # machine, also with MPIDL_CLUSTER set (the records name its host; docs/failures.md has the
    # same worker on real hosts).
    with pytest.MonkeyPatch.context() as local:
        local.delenv("MPIDL_CLUSTER", raising=False)
        cmd = mpiexec(ranks, [sys.executable, WORKER, str(out), *args], ft="ulfm" if flavor() == OPENMPI else "")
    env = {k: v for k, v in os.environ.items() if k != "MPIDL_CLUSTER"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    returncode, output = run_tagged(cmd, env, timeout=LAUNCH_TIMEOUT_S)
    skip = out / "skip.json"
    if skip.exists():
        pytest.skip(f"no failure recovery under this MPI: {json.loads(skip.read_text())['reason']}")
    assert returncode == 0, f"{' '.join(cmd)} ended with {returncode}:\n{output[-3000:]}"
    records = {}
    for path in out.glob("rank_*.json"):
        record = json.loads(path.read_text())
        record["w"] = np.load(out / f"w_{record['id']}.npy")
        records[record["id"]] = record
    return records


def _killed_at(out: Path, who: int) -> float:
    return float((out / f"killed_{who}.txt").read_text())


@pytest.mark.launcher
def test_survivors_of_a_killed_rank_end_as_an_uninterrupted_run(tmp_path):
    """3 ranks of unequal split; rank 0 (the leader, the first rank) dies in step 4 of 12."""
    steps, batch = 12, 12
    (tmp_path / "a").mkdir()
    records = _launch(3, tmp_path / "a", "--steps", str(steps), "--batch", str(batch),
                      "--victims", "0:4", "--speeds", "1,2,3")
    assert sorted(records) == [1, 2]
    expected = worker.reference(steps, batch)
    for record in records.values():
        np.testing.assert_allclose(record["w"], expected, rtol=0, atol=1e-10)
        (recovery,) = record["recoveries"]
        assert recovery["lost_ids"] == [0] and recovery["members"] == [1, 2]
        assert recovery["lost_hosts"] == [MPI.Get_processor_name()] and recovery["emptied_hosts"] == []
        assert recovery["resumed_from_step"] == 4 and recovery["size"] == 2
        assert sum(recovery["split"]) == batch and recovery["nodes"] == [2]
        assert "next_step_done_at" in recovery
    # the same replicas on both survivors, and as a run on the survivors only
    np.testing.assert_array_equal(records[1]["w"], records[2]["w"])
    (tmp_path / "b").mkdir()
    alone = _launch(2, tmp_path / "b", "--steps", str(steps), "--batch", str(batch), "--speeds", "2,3")
    np.testing.assert_allclose(alone[0]["w"], records[1]["w"], rtol=0, atol=1e-10)
    killed = _killed_at(tmp_path / "a", 0)
    detection = min(r["recoveries"][0]["detected_at"] for r in records.values()) - killed
    recovery = max(r["recoveries"][0]["next_step_done_at"] for r in records.values()) - killed
    print(f"detection {detection:.3f} s, failure to next completed step {recovery:.3f} s")


@pytest.mark.launcher
def test_a_second_failure_after_a_recovery(tmp_path):
    """4 ranks; rank 3 dies in step 3, then rank 1 in step 7 (on the shrunk world)."""
    steps, batch = 12, 12
    records = _launch(4, tmp_path, "--steps", str(steps), "--batch", str(batch), "--victims", "3:3,1:7")
    assert sorted(records) == [0, 2]
    expected = worker.reference(steps, batch)
    for record in records.values():
        np.testing.assert_allclose(record["w"], expected, rtol=0, atol=1e-10)
        first, second = record["recoveries"]
        assert first["lost_ids"] == [3] and first["members"] == [0, 1, 2] and first["resumed_from_step"] == 3
        assert second["lost_ids"] == [1] and second["members"] == [0, 2] and second["resumed_from_step"] == 7
        assert record["size"] == 2 and sum(record["split"]) == batch


@pytest.mark.launcher
def test_survivors_one_step_apart_go_back_to_the_same_step(tmp_path):
    """Nodes {0,1} and {2,3} (by start-up rank); rank 2, leader of the second node, dies after
    the leaders' allreduce of step 4 and before its node's broadcast: ranks 0 and 1 complete
    step 4 and fail in step 5 (rank 1 only through the revoked node communicator), rank 3
    fails in step 4. All three must go back to the state before step 4."""
    steps, batch = 12, 12
    records = _launch(4, tmp_path, "--steps", str(steps), "--batch", str(batch), "--victims", "2:4",
                      "--die-after-leaders", "--emulate-nodes", "2", "--speeds", "1,2,3,4")
    assert sorted(records) == [0, 1, 3]
    assert {i: r["recoveries"][0]["completed_before"] for i, r in records.items()} == {0: 5, 1: 5, 3: 4}
    expected = worker.reference(steps, batch)
    for record in records.values():
        (recovery,) = record["recoveries"]
        assert recovery["resumed_from_step"] == 4 and recovery["lost_ids"] == [2]
        assert recovery["nodes"] == [2, 1]
        assert recovery["split"] == [2, 3, 7]  # 12 samples at the survivors' speeds 1 : 2 : 4
        np.testing.assert_allclose(record["w"], expected, rtol=0, atol=1e-10)
