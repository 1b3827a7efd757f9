# python benchmarks/recovery_train.py --cluster NAME --faults kill,freeze,cut --strategies flat,hierarchical,node
"""Recovery of ``python -m mpidl.train --on-failure shrink`` from a killed host, a frozen host
and a cut link, on real hosts.

On a cluster of jobs/cluster.sh (network namespaces with their own names), the training runs
on hosts 1 and 2 with ``--ranks`` ranks each under Open MPI's ``mpiexec --with-ft ulfm``;
``--after`` seconds after the metrics' start record, host 2 is lost (the time is taken just
before the injection):

* ``kill``: every rank of host 2 gets SIGKILL (``jobs/cluster.sh kill 2``);
* ``freeze``: every process of host 2, its Open MPI daemon included, is stopped (freezer
  cgroup, ``jobs/cluster.sh freeze 2``);
* ``cut``: host 2's link is pulled out of the bridge (``jobs/cluster.sh cut 2``).

A frozen or unreachable host is reported only by Open MPI's heartbeat detector, so for
``freeze`` and ``cut`` mpiexec gets ``--mca mpi_ft_detector true`` with ``--detector
PERIOD,TIMEOUT`` (docs/failures.md: detection after about 3 x TIMEOUT). mpiexec does not
return while a host is frozen or cut off, so the run is watched through its metrics: once the
survivors' ``end`` record is there, and ``--grace`` seconds later, host 2 is thawed or its link
restored, and for ``--after-restore`` seconds the benchmark records what mpiexec (does it
return by itself, with which code) and host 2's ranks (do they find out they are out, and end)
do; whatever is still running then is killed, and said so. ``--restore-at failure`` thaws or
restores as soon as the survivors' failure record is written, while they train on (will the
host that is back disturb them? It does: Open MPI aborts a live rank that was reported dead,
and each side reported the other), ``--fence`` first SIGKILLs the frozen ranks or waits until
the cut side has stopped. ``--keepalive`` adds TCP keepalive to prterun's links to its
daemons (as tests/launcher.py does), which may let it give up on an unreachable one.

``--stress``: 3 hosts; host 3 is killed ``--after`` seconds after the start, then host 2
``--gap`` seconds after the survivors' first failure record: the survivors on host 1 (holding
start-up rank 0: exactly half of the 4 ranks left is a quorum) must finish.

From the metrics' ``failure`` records: detection = the survivors' exception minus the
injection, recovery = the next step the survivors completed minus the injection (the issue's
"failure to next completed step"). Every scenario's OA is reported beside an uninterrupted
run's on the same hosts (``--baseline-hosts``: also on fewer hosts, to see how much the OA
moves with the local batches alone). Results (JSON, rewritten after every run) go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ["bash", str(ROOT / "jobs" / "cluster.sh")]
FAULTS = ("kill", "freeze", "cut")
UNDO = {"freeze": "thaw", "cut": "restore"}
#: tries of a run whose job ends before its start record (Open MPI's start-up failed once in
#: about 30 runs: "The PMIx server's listener thread failed to start"); each is recorded
START_TRIES = 3
#: lines of mpiexec's output worth keeping: a rank's own report, Open MPI's notices
NOTABLE = re.compile(r"mpidl: rank|RecoveryError|lost rank|minority|prterun|PRTE|ERROR|error:|"
                     r"warning:|recovered:|done:", re.IGNORECASE)


def cluster_state(name: str) -> dict[str, str]:
    path = Path("/run/mpidl-cluster") / name / "cluster.env"
    if not path.is_file():
        raise SystemExit(f"cluster {name} is not up ({path} missing): bash jobs/cluster.sh --name {name} start")
    return {k: v.strip('"') for k, v in (line.split("=", 1) for line in path.read_text().splitlines()
                                         if "=" in line and not line.startswith("#"))}


def cluster(args, *words: str) -> None:
    subprocess.run([*CLUSTER, "--name", args.cluster, *words], check=True, capture_output=True, timeout=60)


def host_ranks(args, host: int) -> list[tuple[int, str, str]]:
    """(pid, start-up rank, state) of every MPI rank still alive on ``host``."""
    procs = Path(f"/sys/fs/cgroup/freezer/mpidl-cluster-{args.cluster}/node{host}/cgroup.procs")
    found = []
    for pid in procs.read_text().split() if procs.exists() else []:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        if rank is not None:
            found.append((int(pid), rank, state))
    return found


def kill_host(args, host: int) -> int:
    """SIGKILL every process of ``host`` (its cgroup); how many."""
    procs = Path(f"/sys/fs/cgroup/freezer/mpidl-cluster-{args.cluster}/node{host}/cgroup.procs")
    killed = 0
    for pid in procs.read_text().split() if procs.exists() else []:
        try:
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return records


def wait_for(predicate, proc, timeout: float, poll: float = 0.1) -> bool:
    """Until ``predicate()`` or ``proc`` ended or ``timeout``; whether ``predicate()`` held."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return predicate()
        time.sleep(poll)
    return predicate()


def command(args, state: dict, strategy: str, hosts: int, fault: str, metrics: Path) -> list[str]:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    host_list = ",".join(f"{args.cluster}-node{i}:{args.ranks}" for i in range(1, hosts + 1))
    cmd = [mpiexec, "--with-ft", "ulfm", "--allow-run-as-root",
           "--prtemca", "plm_ssh_agent", str(ROOT / "jobs" / "cluster_ssh.sh"),
           "--host", host_list, "-n", str(hosts * args.ranks), "--oversubscribe", "--bind-to", "none",
           "--mca", "mpi_yield_when_idle", "1", "--mca", "btl_tcp_if_include", "eth0",
           "--mca", "oob_tcp_if_include", f"10.77.{state['SUBNET']}.0/24"]
    if fault in UNDO:
        period, timeout = args.detector.split(",")
        cmd += ["--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_period", period,
                "--mca", "mpi_ft_detector_timeout", timeout]
        if args.detector_thread:
            cmd += ["--mca", "mpi_ft_detector_thread", "true"]
    if args.keepalive:  # prterun's own connections to its daemons (tests/launcher.py sets these)
        cmd += ["--prtemca", "oob_tcp_keepalive_time", "5", "--prtemca", "oob_tcp_keepalive_intvl", "1",
                "--prtemca", "oob_tcp_keepalive_probes", "5"]
    return cmd + [sys.executable, "-m", "mpidl.train", "--on-failure", "shrink", "--strategy", strategy,
                  "--sync-every", "10", "--epochs", str(args.epochs), "--max-steps", str(args.steps),
                  "--batch-size", str(args.batch_size), "--balance", "none", "--metrics", str(metrics),
                  "--progress-every", "1000"]


def run_once(args, state: dict, strategy: str, fault: str, hosts: int, tag: str) -> dict:
    """One training run; ``fault`` is ``none``, one of FAULTS, or ``stress``."""
    metrics = args.workdir / f"{tag}.jsonl"
    log = args.workdir / f"{tag}.out"
    metrics.unlink(missing_ok=True)
    failure_file = metrics.with_suffix(".failure.txt")
    failure_file.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(command(args, state, strategy, hosts, fault, metrics), env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=ROOT)
    started = time.time()
    result = {"strategy": strategy, "fault": fault, "hosts": hosts, "ranks": hosts * args.ranks}
    injected: list[float] = []
    victim = 3 if fault == "stress" else 2

    def records(event):
        return [r for r in read_metrics(metrics) if r.get("event") == event]

    undone = fault not in UNDO
    try:
        if fault != "none" and wait_for(lambda: records("start"), proc, args.timeout):
            time.sleep(args.after)
            injected.append(time.time())
            cluster(args, "kill" if fault == "stress" else fault, str(victim))
            if fault == "stress":
                if wait_for(lambda: records("failure"), proc, args.timeout):
                    time.sleep(args.gap)
                    injected.append(time.time())
                    cluster(args, "kill", "2")
        if fault in UNDO:
            result["restore_at"] = args.restore_at
            if args.restore_at == "end":
                wait_for(lambda: records("end"), proc, args.timeout - (time.time() - started))
                # does mpiexec end by itself while host 2 is still frozen / cut off?
                wait_for(lambda: proc.poll() is not None, proc, args.grace)
                result["mpiexec_before_restore"] = proc.poll()  # None: still running
            else:  # while the survivors train on without host 2
                wait_for(lambda: records("failure"), proc, args.timeout - (time.time() - started))
            ranks_before = host_ranks(args, victim)
            if args.fence and fault == "freeze":
                cluster(args, "kill", str(victim))  # pending until the thaw, taken before any code runs
            elif args.fence:  # the cut side's ranks stop by themselves (minority): wait for that
                wait_for(lambda: not host_ranks(args, victim), proc, args.after_restore, poll=0.2)
                result["host2_ranks_gone_before_restore_s"] = time.time() - injected[0]
                if args.fence == "host":  # and its Open MPI daemon, which keeps their verdict
                    result["host2_processes_killed"] = kill_host(args, victim)
            restored = time.time()
            cluster(args, UNDO[fault], str(victim))
            undone = True
            if injected:
                result["restored_after_fault_s"] = restored - injected[0]
            gone = wait_for(lambda: not host_ranks(args, victim), proc, args.after_restore, poll=0.2)
            result["host2_ranks_at_restore"] = [f"rank {r} ({s})" for _, r, s in ranks_before]
            result["host2_ranks_gone_s"] = (time.time() - restored) if gone else None
            if args.restore_at != "end":
                # the survivors, even if mpiexec has returned without them (it did once host 2's
                # daemon was killed)
                deadline = started + args.timeout
                while not records("end") and host_ranks(args, 1) and time.time() < deadline:
                    time.sleep(0.2)
                result["survivors_alone_after_mpiexec"] = proc.poll() is not None and bool(records("end"))
            ended = wait_for(lambda: proc.poll() is not None, proc,
                             max(args.grace, args.after_restore - (time.time() - restored)), poll=0.2)
            result["mpiexec_after_restore"] = proc.returncode if ended else None
            result["mpiexec_ended_s"] = (time.time() - restored) if ended else None
            result["host2_ranks_left"] = [f"rank {r} ({s})" for _, r, s in host_ranks(args, victim)]
        else:
            wait_for(lambda: records("end"), proc, args.timeout - (time.time() - started))
            wait_for(lambda: proc.poll() is not None, proc, args.grace + 30)
    finally:
        if not undone:  # a frozen process takes no SIGKILL until thawed
            cluster(args, UNDO[fault], str(victim))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            result["killed_by_benchmark"] = True
        for host in range(1, hosts + 1):  # ranks left in the hosts (outside mpiexec's session)
            for pid, _, _ in host_ranks(args, host):
                try:
                    os.kill(pid, signal.SIGKILL)
                    result.setdefault("ranks_killed_by_benchmark", []).append(pid)
                except ProcessLookupError:
                    pass
    result["rc"] = proc.returncode
    result["started"] = bool(records("start"))
    end = next(iter(records("end")), {})
    result.update(oa=end.get("oa"), steps=end.get("step"), failures_recorded=end.get("failures"))
    epochs = records("epoch")
    if epochs:
        result["epoch_samples"] = sum(epochs[-1]["samples"])
        result["batch_sizes_end"] = epochs[-1]["batch_sizes"]
    result["failures"] = []
    for f, at in zip(records("failure"), injected):
        result["failures"].append({
            "step": f["step"], "where": f["where"], "lost_ranks": f["lost_ranks"],
            "emptied_hosts": f["emptied_hosts"], "ranks_left": f["ranks_left"], "batch_sizes": f["batch_sizes"],
            "shrink_s": f["shrink_s"], "detection_s": f["seen_at_unix"] - at,
            "recovery_s": (f["next_step_at_unix"] - at) if f["next_step_at_unix"] else None})
    text = log.read_text(errors="replace")
    result["notable_output"] = [line for line in text.splitlines() if NOTABLE.search(line)][-20:]
    if failure_file.exists():
        result["failure_reports"] = [line for line in failure_file.read_text().splitlines()
                                     if line.startswith("mpidl: rank")]
    if proc.returncode != 0:
        result["output_tail"] = text[-1500:]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="NAME of a jobs/cluster.sh cluster that is up")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per host")
    parser.add_argument("--strategies", default="flat,hierarchical,node")
    parser.add_argument("--faults", default="kill", help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--stress", action="store_true", help="3 hosts: lose host 3, then host 2 (kills)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per strategy and fault")
    parser.add_argument("--baseline-hosts", default=None,
                        help="uninterrupted runs on these numbers of hosts (comma-separated; 0: none; "
                             "default: the hosts of the scenario)")
    parser.add_argument("--steps", type=int, default=400, help="--max-steps (one epoch is fewer)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--after", type=float, default=2.0, help="seconds after the start record")
    parser.add_argument("--gap", type=float, default=2.0, help="--stress: seconds after the first failure record")
    parser.add_argument("--detector", default="1,4", help="freeze/cut: mpi_ft_detector_period,_timeout (s)")
    parser.add_argument("--detector-thread", action=argparse.BooleanOptionalAction, default=True,
                        help="freeze/cut: heartbeats from a thread of their own (without it, a rank "
                             "computing longer than the timeout without an MPI call is taken for dead)")
    parser.add_argument("--restore-at", choices=("end", "failure"), default="end",
                        help="freeze/cut: thaw / restore after the survivors' end record, or as soon "
                             "as their failure record is written (while they train on)")
    parser.add_argument("--fence", nargs="?", const="ranks", choices=("ranks", "host"),
                        help="before the thaw / restore: SIGKILL the frozen ranks; for a cut, wait until "
                             "the cut side's ranks have stopped (ranks), and SIGKILL every other process "
                             "of the host too, its Open MPI daemon included (host)")
    parser.add_argument("--keepalive", action="store_true", help="TCP keepalive on prterun's daemons' links")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--grace", type=float, default=5.0, help="seconds to wait for mpiexec after the end record")
    parser.add_argument("--after-restore", type=float, default=60.0, help="seconds to watch after a thaw/restore")
    parser.add_argument("--timeout", type=float, default=240.0, help="per run, until the end record")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mpidl-recovery-train"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "recovery_train_faults.json")
    args = parser.parse_args(argv)
    faults = [f for f in args.faults.split(",") if f]
    if any(f not in FAULTS for f in faults):
        parser.error(f"--faults: of {', '.join(FAULTS)}, got {args.faults}")
    hosts = 3 if args.stress else 2
    state = cluster_state(args.cluster)
    if int(state["HOSTS"]) < hosts:
        parser.error(f"cluster {args.cluster} has {state['HOSTS']} hosts, this needs {hosts}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    scenarios = ["stress"] if args.stress else faults
    baselines = [int(h) for h in (args.baseline_hosts or str(hosts)).split(",") if int(h) > 0]
    results = []
    for strategy in args.strategies.split(","):
        runs = [("none", h) for h in baselines] + [(f, hosts) for f in scenarios for _ in range(args.repeats)]
        for i, (fault, n) in enumerate(runs):
            failed_starts = []
            for _ in range(START_TRIES):  # a job that never started is retried (nothing injected)
                result = run_once(args, state, strategy, fault, n, f"{strategy}_{fault}_{n}h_{i}")
                if result["started"]:
                    break
                failed_starts.append(result.get("output_tail", "")[-300:])
            result["failed_starts"] = failed_starts
            results.append(result)
            print(json.dumps({k: v for k, v in results[-1].items() if k not in ("output_tail", "notable_output")}),
                  flush=True)
            tmp = args.out.with_suffix(".tmp")
            tmp.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "results": results}, indent=1))
            tmp.replace(args.out)
    return 0 if all(r["rc"] == 0 for r in results if r["fault"] in ("none", "kill", "stress")) else 1


if __name__ == "__main__":
    sys.exit(main())
