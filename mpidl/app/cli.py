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
