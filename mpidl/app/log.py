"""Printing and metrics: rank 0 prints, every rank may log to its own file.

- :class:`Printer` prints on rank 0 only, honouring ``--quiet`` and ``--log-level``.
- :class:`MetricsWriter` appends JSON Lines records (rank 0), flushed after each line so a
  killed job keeps every finished epoch; a failed write (a full disk) raises an OSError that
  names the file and the cause (:func:`mpidl.app.outputs.write_error`), never an errno alone.
- :class:`RankTimingLog` is a per-rank JSON Lines file (``--timing-dir``).
"""

from __future__ import annotations

import json
import os
import sys
import time

from mpidl.app.outputs import write_error

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40}


class Printer:
    """Rank-0 console output with levels. ``quiet`` keeps only warnings, errors and the
    final summary (printed with ``always=True``)."""

    def __init__(self, rank: int = 0, level: str = "info", quiet: bool = False, stream=None):
        self.rank = rank
        self.threshold = LEVELS["warning"] if quiet else LEVELS[level]
        self.stream = stream if stream is not None else sys.stdout

    def log(self, level: str, message: str, always: bool = False) -> None:
        if self.rank != 0:
            return
        if always or LEVELS[level] >= self.threshold:
            print(message, file=self.stream, flush=True)

    def debug(self, message: str) -> None:
        self.log("debug", message)

    def info(self, message: str) -> None:
        self.log("info", message)

    def warning(self, message: str) -> None:
        self.log("warning", "warning: " + message)

    def summary(self, message: str) -> None:
        self.log("info", message, always=True)


def _json_default(obj):
    # numpy scalars and arrays appear in metrics; make them plain JSON
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


class MetricsWriter:
    """JSON Lines writer: one object per line, flushed immediately. Inactive when ``path``
    is None or on ranks other than 0."""

    def __init__(self, path: str | None, rank: int = 0, append: bool = False):
        self.file = None
        self.path = path
        if path and rank == 0:
            self._open(path, append)

    def _open(self, path: str, append: bool) -> None:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, "a" if append else "w", encoding="utf-8")
            self._whole = self.file.tell()  # the end of the last whole record
        except OSError as exc:
            raise write_error(path, exc) from None

    def write(self, record: dict) -> None:
        if self.file is None:
            return
        try:
            self.file.write(json.dumps(record, default=_json_default) + "\n")
            self.file.flush()
            self._whole = self.file.tell()
        except OSError as exc:
            self._abandon()
            raise write_error(self.path, exc) from None

    def _abandon(self) -> None:
        """Close the file after a failed write: cut it back to its last whole record (a
        reader never meets half a line), drop what the buffer still holds (a later flush, at
        close or at exit, would fail again and print the raw error); the writer writes
        nothing more."""
        try:
            os.ftruncate(self.file.fileno(), self._whole)
        except OSError:
            pass
        try:
            sink = os.open(os.devnull, os.O_WRONLY)
            os.dup2(sink, self.file.fileno())
            os.close(sink)
            self.file.close()
        except OSError:
            pass
        self.file = None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


class RankTimingLog(MetricsWriter):
    """Per-rank timing file ``DIR/rank{r}.jsonl`` (every rank writes its own)."""

    def __init__(self, folder: str | None, rank: int, append: bool = False):
        self.file = None
        self.path = os.path.join(folder, f"rank{rank}.jsonl") if folder else None
        if folder:
            self._open(self.path, append)

    def write(self, record: dict) -> None:
        super().write({"time": time.time(), **record})
