"""What the command lines run under ``mpiexec`` share: a bad option is a set-up error like any
other, printed once.

argparse prints its usage and exits on a bad option, so under ``mpiexec -n 4`` the usage
appears four times and the ranks never agree on anything. :class:`Parser` raises
:class:`UsageError` instead, with argparse's one-line message and where the options are
listed; the entry point treats it like every other set-up error (the ranks agree, rank 0
prints ``error: ...``, every rank exits with code 2). :func:`parse_args` prints ``--help``
on rank 0 only (every rank then exits 0). ``mpidl.train`` does the same in
:mod:`mpidl.app.config`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os


class UsageError(ValueError):
    """A bad command line: argparse's message, one line, naming the option."""


class Parser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose errors raise :class:`UsageError`."""

    def error(self, message):
        raise UsageError(f"{message} ({self.prog} --help lists the options)")


def parse_args(parser: argparse.ArgumentParser, argv, rank: int) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with what it prints (``--help``) shown by rank 0 only."""
    quiet = contextlib.nullcontext() if rank == 0 else contextlib.redirect_stdout(io.StringIO())
    with quiet:
        return parser.parse_args(argv)


def start_process() -> None:
    """What every command line does first, before MPI starts and before any model is built.

    * ``OMPI_MCA_osc=^ucx`` unless the user chose the osc components: Open MPI 5's osc/ucx
      answers the query of every new one-sided window with an error line on each rank where
      UCX has no RMA transport (a container, TCP only), and is then not used; the only window
      here is the node-shared one (``--intra shm``), which is osc/sm's. MPI reads it when it
      starts (mpi4py starts it on import), so it is set here, before. MPICH ignores it.
    * the thread policy (:func:`mpidl.engine.threads.apply`): BLAS and Numba threads for the
      ranks the launcher put on this machine.
    """
    os.environ.setdefault("OMPI_MCA_osc", "^ucx")
    from mpidl.engine import threads  # noqa: PLC0415

    threads.apply()
