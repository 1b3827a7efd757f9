# mpiexec --with-ft ulfm -n 3 python benchmarks/ulfm_probe.py        (Open MPI)
# mpiexec -disable-auto-cleanup -n 3 -launcher fork python benchmarks/ulfm_probe.py   (MPICH)
"""What an MPI does when a rank dies in an Allreduce loop, and which ULFM calls work after it.

Every rank returns errors as exceptions (``ERRORS_RETURN``) and runs an ``Allreduce`` of
1000 float64 in a loop; the last rank (``VICTIM``) SIGKILLs itself at iteration ``KILL_AT``
after writing the time to ``STAMP``. Each survivor prints the error class it gets (75 is
``MPI_ERR_PROC_FAILED`` under Open MPI), the time from the kill to the exception, then tries
``Revoke``, ``Get_failed``, ``Ack_failed``, ``Agree``, ``Shrink``, an allreduce and
``Split_type(COMM_TYPE_SHARED)`` on the shrunk communicator, printing each result and time.
With ``USR1_HANDLER=1`` a Python handler keeps ``SIGUSR1`` (hydra's failure notice) from
ending the process. docs/failures.md records what each MPI printed.
"""

import os
import signal
import time

notices = []
if os.environ.get("USR1_HANDLER") == "1":
    signal.signal(signal.SIGUSR1, lambda signum, frame: notices.append(time.time()))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

comm = MPI.COMM_WORLD
comm.Set_errhandler(MPI.ERRORS_RETURN)
rank, size = comm.Get_rank(), comm.Get_size()
victim = int(os.environ.get("VICTIM", size - 1))
kill_at = int(os.environ.get("KILL_AT", 20))
stamp = os.environ.get("STAMP", f"/tmp/ulfm_probe_{os.getppid()}.txt")


def say(*words):
    print(f"[{rank}] {time.time():.3f}", *words, flush=True)


def attempt(name, call):
    start = time.time()
    try:
        result = call()
        say(f"{name}: ok ({time.time() - start:.3f} s) -> {result}")
        return result
    except Exception as exc:  # report every failure and go on to the next call
        say(f"{name}: FAILED ({time.time() - start:.3f} s) {type(exc).__name__} {exc}")
        return None


send, recv = np.ones(1000), np.empty(1000)
failed_at = None
for i in range(kill_at + 50000):
    if rank == victim and i == kill_at:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.Allreduce(send, recv)
    except MPI.Exception as exc:
        failed_at = time.time()
        say(f"iteration {i}: error class {exc.Get_error_class()} ({exc.Get_error_string()!r}); "
            f"ERR_PROC_FAILED={getattr(MPI, 'ERR_PROC_FAILED', None)} ERR_REVOKED={getattr(MPI, 'ERR_REVOKED', None)}")
        break
else:
    say(f"no failure seen; SIGUSR1 received at {notices}")
if failed_at is not None and os.path.exists(stamp):
    with open(stamp) as f:
        say(f"detection {failed_at - float(f.read()):.3f} s after the kill")
attempt("Revoke", comm.Revoke)
group = attempt("Get_failed", comm.Get_failed)
if group is not None:
    attempt("failed group size", group.Get_size)
attempt("Ack_failed", comm.Ack_failed)
attempt("Agree", lambda: comm.Agree(1))
new = attempt("Shrink", comm.Shrink)
if new is not None:
    attempt("size and rank after the shrink", lambda: (new.Get_size(), new.Get_rank()))
    attempt("allreduce on the shrunk communicator", lambda: new.allreduce(rank))
    node = attempt("Split_type(COMM_TYPE_SHARED)", lambda: new.Split_type(MPI.COMM_TYPE_SHARED))
    if node is not None:
        attempt("node size", node.Get_size)
    attempt("Barrier", new.Barrier)
    say("done")
    os._exit(0)  # MPI_Finalize may wait for the dead rank (docs/failures.md)
