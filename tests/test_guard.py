"""python -m mpidl.guard: the launcher returns, and its exit code says whether the result is
complete (fake launchers: shell commands; generous grace, nothing timed)."""

import io
import sys

import subprocess

from mpidl import guard
from mpidl.distributed.watchdog import EXIT_FAILURE_BOUND
from mpidl.guard import main, run, verdict


def test_the_guard_is_not_an_mpi_process_and_shares_the_bound_s_exit_code():
    assert guard.EXIT_FAILURE_BOUND == EXIT_FAILURE_BOUND
    probe = subprocess.run([sys.executable, "-c", "import sys, mpidl.guard; print('mpi4py.MPI' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "False", probe.stderr


def sh(script):
    return ["bash", "-c", script]


def test_the_lines_that_decide():
    assert verdict("done: completed after 256 steps in 30.1 s; test OA 95.0%\n") == 0
    assert verdict("[1,0]<stdout>: done: completed after 256 steps\n") == 0
    assert verdict("done: signal after 12 steps\n") == 0  # a clean stop, checkpointed: the job's own end
    assert verdict("mpidl: rank 0: no progress ... Ending the job (exit code 3): its result ...\n") == EXIT_FAILURE_BOUND
    assert verdict("epoch 1/4 loss 0.5\n") is None




def test_a_completed_job_is_0_even_when_a_stopped_minority_made_the_launcher_return_1():
    out = io.StringIO()
    assert run(sh("echo 'done: completed after 10 steps'; echo 'mpidl: rank 2 stops: RecoveryError'; exit 1"),
               out=out) == 0
    assert "done: completed" in out.getvalue()


def test_a_launcher_that_does_not_return_after_the_end_is_ended_after_the_grace():
    out = io.StringIO()
    assert run(sh("echo 'done: completed after 10 steps'; exec sleep 600"), grace_s=0.5, out=out) == 0
    assert "did not return 0.5 s after the job's end" in out.getvalue()
    out = io.StringIO()
    code = run(sh("echo 'mpidl: rank 1: no progress. Ending the job (exit code 3): NOT complete' >&2; sleep 600"),
               grace_s=0.5, out=out)
    assert code == EXIT_FAILURE_BOUND
    assert "failure bound" in out.getvalue()


def test_without_a_deciding_line_the_launcher_code_is_passed_on():
    assert run(sh("echo hello; exit 5"), out=io.StringIO()) == 5
    out = io.StringIO()
    assert run(sh("exit 0"), out=out) == EXIT_FAILURE_BOUND  # prterun after losing a daemon
    assert "never said it was done" in out.getvalue()
    assert run(sh("kill -KILL $$"), out=io.StringIO()) == 128 + 9


def test_the_command_line(capsys):
    assert main(["--grace", "5", "--", sys.executable, "-c", "print('done: completed after 1 steps')"]) == 0
    assert "done: completed" in capsys.readouterr().out
