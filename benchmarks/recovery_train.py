# python benchmarks/recovery_train.py --cluster NAME --strategies flat,hierarchical,node --repeats 3
"""Recovery time of ``python -m mpidl.train --on-failure shrink`` when a whole host is killed.

On a cluster of jobs/cluster.sh (real hosts: network namespaces with their own names), the
training runs on hosts 1 and 2 with ``--ranks`` ranks each under Open MPI's ``mpiexec
--with-ft ulfm``; ``--after`` seconds after the first step every rank of host 2 gets SIGKILL
(``jobs/cluster.sh kill``), its time written just before. From the metrics' ``failure``
record: detection = the first survivor's exception minus the kill, recovery = the next
step completed by the survivors minus the kill (the issue's "failure to next completed
step"). The run must end with exit 0; its OA is reported beside an uninterrupted run's.
Results (JSON) go to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(args, strategy: str, kill: bool, workdir: Path) -> dict:
    env_file = Path("/run/mpidl-cluster") / args.cluster / "cluster.env"
    cluster = dict(line.split("=", 1) for line in env_file.read_text().splitlines()
                   if "=" in line and not line.startswith("#"))
    metrics = workdir / f"{strategy}_{'kill' if kill else 'whole'}.jsonl"
    metrics.unlink(missing_ok=True)
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "--with-ft", "ulfm", "--allow-run-as-root",
           "--prtemca", "plm_ssh_agent", str(ROOT / "jobs" / "cluster_ssh.sh"),
           "--host", f"{args.cluster}-node1:{args.ranks},{args.cluster}-node2:{args.ranks}",
           "-n", str(2 * args.ranks), "--oversubscribe", "--bind-to", "none",
           "--mca", "mpi_yield_when_idle", "1", "--mca", "btl_tcp_if_include", "eth0",
           "--mca", "oob_tcp_if_include", f"10.77.{cluster['SUBNET']}.0/24",
           sys.executable, "-m", "mpidl.train", "--on-failure", "shrink", "--strategy", strategy,
           "--sync-every", "10", "--epochs", "1", "--max-steps", str(args.steps),
           "--batch-size", "32", "--balance", "none", "--metrics", str(metrics), "--progress-every", "1000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
    killed_at = None
    if kill:
        while not metrics.exists() or "\"start\"" not in metrics.read_text():
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        time.sleep(args.after)
        killed_at = time.time()
        subprocess.run(["bash", str(ROOT / "jobs" / "cluster.sh"), "--name", args.cluster, "kill", "2"],
                       check=True, capture_output=True, timeout=60)
    try:
        output, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    end = next((r for r in records if r["event"] == "end"), {})
    result = {"strategy": strategy, "killed": kill, "rc": proc.returncode, "oa": end.get("oa"),
              "steps": end.get("step")}
    failures = [r for r in records if r["event"] == "failure"]
    if kill and failures:
        f = failures[0]
        result.update(step=f["step"], where=f["where"], lost_ranks=f["lost_ranks"],
                      emptied_hosts=f["emptied_hosts"], shrink_s=f["shrink_s"],
                      detection_s=f["seen_at_unix"] - killed_at,
                      recovery_s=(f["next_step_at_unix"] - killed_at) if f["next_step_at_unix"] else None)
    if proc.returncode != 0:
        result["output"] = output[-2000:]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="NAME of a jobs/cluster.sh cluster that is up")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per host")
    parser.add_argument("--strategies", default="flat,hierarchical,node")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--after", type=float, default=3.0, help="seconds after the start record")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mpidl-recovery-train"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "recovery_train.json")
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = []
    for strategy in args.strategies.split(","):
        results.append(run_once(args, strategy, False, args.workdir))
        print(json.dumps(results[-1]), flush=True)
        for _ in range(args.repeats):
            results.append(run_once(args, strategy, True, args.workdir))
            print(json.dumps(results[-1]), flush=True)
    args.out.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "results": results}, indent=1))
    return 0 if all(r["rc"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
