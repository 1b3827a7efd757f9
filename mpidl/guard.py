"""``python -m mpidl.guard [--grace S] -- mpiexec ... python -m mpidl.train ...``: a launcher that
returns, with an exit code that says whether the result is complete.

Why. The ranks can end within a bound (the failure bound, :mod:`mpidl.distributed.watchdog`;
the survivors of ``--on-failure shrink`` finish), but a launcher may still not return: Open MPI's
``mpiexec`` (prterun) waits for the daemon of a frozen host for ever, the ranks' exits or
``MPI_Abort`` included, and nothing in PRRTE 3 gives up on a daemon whose kernel still answers
TCP. And its exit code is the worst of the ranks': after a cut link the side without the
quorum stops with exit 1 even though the other side finished the job.

What it does. It runs the launcher command in a session of its own, passes its output through
line by line, and watches for two lines that only ``mpidl.train``'s rank 0 prints:

* ``done: ...`` (``done: completed``, ``done: max_steps`` or ``done: signal``: the job ended by
  itself, its final evaluation, ``--save`` and checkpoint written): from then on the launcher
  has ``--grace`` seconds to return; the guard then exits **0** whatever the launcher's code
  (a stopped minority's exit 1 is not the job's);
* ``... Ending the job (exit code 3) ...`` (the failure bound, the result is NOT complete): the
  launcher has ``--grace`` seconds to return; the guard exits **3**.

If the launcher does not return within the grace, the guard kills its session (SIGKILL: hydra
ignores SIGTERM while ranks hang) and exits as said. With neither line, the launcher's own exit
code is passed on, except 0, which becomes 3 (prterun returns 0 after losing a host's daemon,
the job unfinished). The exit codes (docs/failures.md): 0 complete; 1 failed (an error, see the
output); 2 set-up error; 3 ended by the failure bound (a host lost, frozen or cut off: resume
with ``--resume``); anything else is the launcher's own (a signal, ``MPI_Abort`` code).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

#: the failure bound's exit code, mpidl.distributed.watchdog.EXIT_FAILURE_BOUND (tests check they
#: agree); not imported from there: importing mpidl.distributed starts MPI, and the guard, which
#: runs the launcher, must not be an MPI process itself
EXIT_FAILURE_BOUND = 3

#: seconds the launcher has to return after the result line (default of --grace)
GRACE_S = 30.0
#: rank 0's last line when mpidl.train ends by itself (completed, --max-steps, or a signal's
#: checkpointed stop): the job's own word on its result
DONE_LINE = "done: "
BOUND_LINE = f"Ending the job (exit code {EXIT_FAILURE_BOUND})"


def verdict(line: str) -> int | None:
    """The exit code a line of the job's output decides (0 complete, 3 bound), or None."""
    if line.startswith(DONE_LINE) or f">: {DONE_LINE}" in line:  # plain, or tagged: [1,0]<stdout>: done
        return 0
    if BOUND_LINE in line:
        return EXIT_FAILURE_BOUND
    return None


def run(command: list[str], grace_s: float = GRACE_S, out=None) -> int:
    """Run ``command``, pass its output (stdout and stderr together) to ``out``; the exit code
    as the module docstring says."""
    out = sys.stdout if out is None else out
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            bufsize=0)
    decided: list[tuple[int, float]] = []

    def pump():
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            out.write(line)
            out.flush()
            code = verdict(line)
            if code is not None and (not decided or decided[0][0] != 0):
                decided.insert(0, (code, time.monotonic()))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    while proc.poll() is None:
        if decided and time.monotonic() - decided[0][1] > grace_s:
            out.write(f"mpidl.guard: the launcher did not return {grace_s:g} s after the job's "
                      f"{'end' if decided[0][0] == 0 else 'failure bound'}: ending it (SIGKILL to its session)\n")
            out.flush()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            break
        time.sleep(0.1)
    reader.join(timeout=2)
    if decided:
        return decided[0][0]
    if proc.returncode == 0:
        # Open MPI's prterun returns 0 after losing a host's daemon, the job unfinished
        out.write(f"mpidl.guard: the launcher returned 0, but the job never said it was done: its result is "
                  f"NOT complete (exit code {EXIT_FAILURE_BOUND}); resume from the last --checkpoint\n")
        out.flush()
        return EXIT_FAILURE_BOUND
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpidl.guard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grace", type=float, default=GRACE_S, metavar="SECONDS",
                        help=f"how long the launcher may take to return after the job's end (default {GRACE_S:g})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the launcher command after --")
    if not args.grace > 0:
        parser.error("--grace must be > 0")
    return run(command, args.grace)


if __name__ == "__main__":
    sys.exit(main())
