# mpiexec --with-ft ulfm -n 4 python benchmarks/recovery.py --steps 400 --stamp /tmp/fault.txt --out rec.json
"""Time to detect a lost rank or host and to complete the next step after it (ULFM shrink).

A paced loop of hierarchical allreduces (node allreduce, leaders allreduce, node broadcast of
``--floats`` float64 per step, ``--step-s`` of emulated compute before each) runs until
``--steps`` steps are done. A fault is injected from outside (``jobs/cluster.sh kill|freeze|cut
HOST``, or ``kill -9`` of a rank) by a script that writes the time of the injection (seconds
since the epoch, ``date +%s.%N``) to ``--stamp``. Survivors recover with
mpidl.distributed.elastic.recovery (revoke, shrink, agreed step, topology rebuild) and go on; at the
end the first survivor writes ``--out`` (JSON): per recovery, the lost ranks and hosts, the
time from the injection to the failure raised on the first survivor (detection), the shrink
time, and the time from the injection to the next completed step (recovery).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--step-s", type=float, default=0.02, help="emulated compute per step")
    parser.add_argument("--floats", type=int, default=1 << 15, help="float64 per allreduce")
    parser.add_argument("--stamp", type=Path, required=True, help="file the injector writes its time to")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from mpi4py import MPI

    from mpidl.distributed.elastic.recovery import (Members, RecoveryError, agreed_step, is_process_failure,
                                                    leave, rebuild_topology, shrink, ulfm_available)
    from mpidl.distributed.topology import Topology

    comm = MPI.COMM_WORLD
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    ok, reason = ulfm_available(comm)
    if comm.Get_rank() == 0:
        print(f"failure recovery: {'yes' if ok else 'no'} ({reason})", flush=True)
    if not ok:
        return 1
    members = Members.gather(comm)
    topo = Topology.from_comm(comm)
    if comm.Get_rank() == 0:
        print(topo.describe(), flush=True)
    g = np.ones(args.floats)
    recoveries, pending = [], None
    step = 0
    while step < args.steps:
        try:
            time.sleep(args.step_s)
            topo.node.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            if topo.is_leader:
                topo.leaders.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
            topo.node.Bcast(g, root=0)
            g[:] = 1.0
            step += 1
            if pending is not None:
                pending["next_step_done_at"] = time.time()
                pending = None
        except MPI.Exception as exc:
            if not is_process_failure(exc):
                raise
            detected = time.time()
            shrunk = shrink(comm, members, also_revoke=[topo.node, topo.leaders])
            if not shrunk.quorum:
                raise RecoveryError(shrunk.describe()) from exc
            step = agreed_step(shrunk.comm, step)
            topo = rebuild_topology(shrunk.comm, topo)
            comm, members = shrunk.comm, shrunk.members
            pending = {"error": exc.Get_error_string(), "detected_at": detected, "step": step,
                       "shrink_s": shrunk.seconds, "lost_ids": list(shrunk.lost_ids),
                       "lost_hosts": list(shrunk.lost_hosts), "emptied_hosts": list(shrunk.emptied_hosts),
                       "describe": shrunk.describe(), "topology": topo.describe()}
            recoveries.append(pending)
            print(f"rank {comm.Get_rank()}: {shrunk.describe()}", flush=True)
    views = comm.gather(recoveries, root=0)
    if comm.Get_rank() == 0:
        injected = float(args.stamp.read_text()) if args.stamp.exists() else None
        summary = []
        for k, first in enumerate(views[0]):
            detected = min(v[k]["detected_at"] for v in views)
            done = max(v[k].get("next_step_done_at", float("nan")) for v in views)
            item = {key: first[key] for key in ("error", "step", "lost_ids", "lost_hosts", "emptied_hosts",
                                                "describe", "topology")}
            item["shrink_s_max"] = max(v[k]["shrink_s"] for v in views)
            if injected is not None and k == 0:
                item["detection_s"] = detected - injected
                item["recovery_s"] = done - injected
            summary.append(item)
        result = {"command": " ".join(sys.argv), "ranks_left": comm.Get_size(), "steps": step,
                  "recoveries": summary}
        args.out.write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1), flush=True)
    if recoveries:
        leave(comm)
    return 0


if __name__ == "__main__":
    sys.exit(main())
