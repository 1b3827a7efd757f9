"""Does a PMI-1 request longer than 1024 bytes reach the process manager whole?

Run as the ranks of a job (``python tests/pmi1_probe.py``, started by a launcher whose PMI
server hands each process ``PMI_FD``: hydra's ``mpiexec``, or ``srun --mpi=pmi2``). Each
process speaks PMI-1 on that socket as MPICH's own client does (one ``write`` per request):
it puts a value of 1000 characters under its own key (a request line of about 1060 bytes),
fences, reads back the value its right-hand neighbour put (across nodes when there is one
rank per node), prints what it got, and exits 1 unless that value came back whole.

Why (tests/cluster_stage.sh step 3, docs/running.md): Slurm's pmi2 plugin reads a PMI-1
request with one ``read`` of at most 1024 bytes, so a longer line is cut, the cut value is
stored and ``put_result rc=0`` answered; MPICH's client sends ``put`` lines of up to ~1080
bytes when ranks on different nodes exchange their UCX addresses (value segments of
``vallen_max - 2`` = 1022 characters plus the command, key and kvsname), and MPI_Init then
fails on the peer ("failed to unpack address", "Destination is unreachable") or not,
depending on the bytes sent. This probe fails on that path every time, and passes where the
server reads whole lines (hydra).
"""

import os
import socket
import sys

VALUE_CHARS = 1000


def main() -> int:
    fd = int(os.environ["PMI_FD"])
    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    sock = socket.socket(fileno=fd)
    pending = b""

    def ask(line: str) -> str:
        nonlocal pending
        sock.sendall(line.encode() + b"\n")  # one request, one write, as MPICH's client
        while b"\n" not in pending:
            chunk = sock.recv(65536)
            if not chunk:
                raise SystemExit(f"pmi1_probe: rank {rank}: the PMI server closed the connection")
            pending += chunk
        reply, _, pending = pending.partition(b"\n")
        return reply.decode()

    ask("cmd=init pmi_version=1 pmi_subversion=1")
    ask("cmd=get_maxes")
    kvs = ask("cmd=get_my_kvsname").split("kvsname=", 1)[1].split()[0]
    value = "".join("0123456789ABCDEF"[(rank + i) % 16] for i in range(VALUE_CHARS))
    request = f"cmd=put kvsname={kvs} key=pmi1probe-{rank} value={value}"
    ask(request)
    ask("cmd=barrier_in")
    peer = (rank + 1) % size
    expected = "".join("0123456789ABCDEF"[(peer + i) % 16] for i in range(VALUE_CHARS))
    reply = ask(f"cmd=get kvsname={kvs} key=pmi1probe-{peer}")
    got = reply.split("value=", 1)[1].split()[0] if "value=" in reply else ""
    whole = got == expected
    # One write of the whole line: the launcher forwards what each rank writes as it comes.
    os.write(1, (f"pmi1_probe: rank {rank} on {socket.gethostname()}: put a request of {len(request) + 1} "
                 f"bytes; rank {peer}'s value came back with {len(got)} of {VALUE_CHARS} characters: "
                 f"{'whole' if whole else 'CUT'}\n").encode())
    ask("cmd=finalize")
    return 0 if whole else 1


if __name__ == "__main__":
    sys.exit(main())
