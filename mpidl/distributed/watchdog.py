"""The failure bound: a rank whose training makes no progress for too long ends the job, and
says which host it stopped hearing from.

Why it is needed. An MPI may leave the survivors of a lost host waiting inside a collective
for ever: MPICH (hydra, UCX) never reports a killed, frozen or cut-off peer to the others; under
``mpiexec -disable-auto-cleanup`` its launcher then neither ends them nor returns (measured:
two survivors spun at 100 % CPU for 97 minutes). Open MPI without ULFM's detector never
reports a frozen host. No MPI call can be trusted to return, so the bound lives outside MPI:

* **Progress marks.** The training loop calls :meth:`ProgressWatchdog.mark` after each step,
  each evaluation batch and each checkpoint. A thread of this process checks that the time
  since the last mark stays below the bound ``T``; when it does not, this rank ends the job
  (:meth:`ProgressWatchdog.end_job`): one message, ``MPI_Abort`` (from the thread: the main
  thread is inside MPI), and, if the MPI cannot even abort within a few seconds,
  ``os._exit``. Exit code :data:`EXIT_FAILURE_BOUND` either way.
* **Heartbeats, to name the host.** The same thread sends a datagram (UDP, 12 bytes: start-up
  rank and progress count) to every other rank every ``period`` seconds and notes when it last
  heard from each. A killed rank, a frozen host and a cut link all fall silent; the message
  names the ranks (and their hosts) not heard from for more than ``2 x period``. This side
  channel is never used to decide anything but the wording: if the datagrams cannot pass (a
  firewall), the job still ends within the bound, and the message says that it could not tell.
* **The bound.** ``--failure-timeout SECONDS`` sets ``T``. ``auto`` (the default) scales it
  with the run: ``T = max(FLOOR_S, FACTOR x g)``, ``g`` the longest time between two marks seen
  so far on this rank (a step, an evaluation batch, a checkpoint write); until the loop has
  made :data:`WARMUP_MARKS` marks (compilation, the first steps) ``T = WARMUP_S``.

The first rank whose bound passes prints the message and tells the others (a last datagram),
which then end quietly (one line per job, not one per rank; two if two ranks pass it within
the same heartbeat period) and do not name it as lost; every stalled rank ends alike, so the
job ends even if the first one cannot.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

#: exit code of a job ended by the failure bound: a rank or host was lost or unreachable and
#: the result is NOT complete (resume from the last checkpoint)
EXIT_FAILURE_BOUND = 3
#: auto bound: never below this (seconds)
FLOOR_S = 60.0
#: auto bound: this many times the longest time between two progress marks seen so far
FACTOR = 10.0
#: auto bound before the loop has made WARMUP_MARKS marks (compilation, the speed probe)
WARMUP_S = 300.0
WARMUP_MARKS = 3
#: how long end_job waits for MPI_Abort before ending this process itself
ABORT_WAIT_S = 5.0

_PACKET = struct.Struct("!iQB")  # start-up rank, progress count, 1 when that rank is ending the job


def parse_failure_timeout(value) -> float | None:
    """``'auto'`` -> None (the scaled bound), else a number of seconds > 0. ValueError otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--failure-timeout must be 'auto' or a number of seconds > 0, got {value!r}") from None
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"--failure-timeout must be 'auto' or a number of seconds > 0, got {value!r}")
    return seconds


@dataclass
class Progress:
    """The marks of one rank, and the bound they give (pure: times are passed in).

    ``fixed_s`` is ``--failure-timeout`` (None: auto)."""

    fixed_s: float | None
    marks: int = 0
    last_at: float | None = None
    longest_gap_s: float = 0.0
    where: str = "start-up"
    armed_at: float | None = None

    def arm(self, now: float) -> None:
        self.armed_at = self.last_at = now

    def mark(self, now: float, where: str) -> None:
        if self.last_at is not None and self.marks > 0:
            self.longest_gap_s = max(self.longest_gap_s, now - self.last_at)
        self.marks += 1
        self.last_at = now
        self.where = where

    @property
    def bound_s(self) -> float:
        """``T``: ``--failure-timeout``, else ``max(FLOOR_S, FACTOR x longest gap)``, and
        ``WARMUP_S`` until :data:`WARMUP_MARKS` marks."""
        if self.fixed_s is not None:
            return self.fixed_s
        if self.marks < WARMUP_MARKS:
            return WARMUP_S
        return max(FLOOR_S, FACTOR * self.longest_gap_s)

    def quiet_s(self, now: float) -> float:
        """Seconds since the last mark (0 before :meth:`arm`)."""
        return 0.0 if self.last_at is None else now - self.last_at

    def stalled(self, now: float) -> bool:
        return self.last_at is not None and self.quiet_s(now) > self.bound_s


@dataclass
class Peers:
    """When this rank last heard each other rank's heartbeat (pure: times are passed in)."""

    rank: int
    hosts: list[str]
    heard_at: dict = field(default_factory=dict)
    started_at: float = 0.0
    gone: set = field(default_factory=set)
    #: ranks that said they are ending the job (their bound passed first): alive, not lost
    ending: set = field(default_factory=set)

    def heard(self, rank: int, now: float, ending: bool = False) -> None:
        if 0 <= rank < len(self.hosts) and rank != self.rank:
            self.heard_at[rank] = now
            if ending:
                self.ending.add(rank)

    def forget(self, ranks) -> None:
        """Ranks the job already went on without (a shrink): not named again."""
        self.gone.update(ranks)

    def silent(self, now: float, after_s: float) -> list[int]:
        """The other ranks not heard from for more than ``after_s`` (never heard: counted from
        :attr:`started_at`)."""
        return [r for r in range(len(self.hosts)) if r != self.rank and r not in self.gone
                and r not in self.ending and now - self.heard_at.get(r, self.started_at) > after_s]

    def ever_heard(self) -> bool:
        return bool(self.heard_at)

    def speaks_for_job(self) -> bool:
        """Whether this rank prints the message: no other rank has said it is ending the job
        (the first rank whose bound passes speaks; the others end quietly)."""
        return not self.ending


def describe_silent(peers: Peers, silent: list[int]) -> str:
    """``rank(s) [4, 5] on host-3 (all its ranks)``, one clause per host."""
    by_host: dict[str, list[int]] = {}
    for r in silent:
        by_host.setdefault(peers.hosts[r], []).append(r)
    parts = []
    for host, ranks in by_host.items():
        total = sum(1 for r, h in enumerate(peers.hosts) if h == host and r not in peers.gone)
        whole = " (all its ranks)" if len(ranks) == total else ""
        parts.append(f"rank{'s' if len(ranks) > 1 else ''} {ranks} on {host}{whole}")
    return "; ".join(parts)


def stall_message(progress: Progress, peers: Peers, now: float, period_s: float) -> str:
    """What the rank that speaks for the job prints when the bound is passed."""
    silent = peers.silent(now, 2 * period_s)
    if silent:
        # The lost host fell silent first; ranks that went quiet later (seen after a kill under
        # MPICH: survivors silent a few seconds after the lost one) are named apart.
        last = {r: peers.heard_at.get(r, peers.started_at) for r in silent}
        first = min(last.values())
        lost = [r for r in silent if last[r] <= first + period_s]
        later = [r for r in silent if r not in lost]
        hosts = sorted({peers.hosts[r] for r in lost})
        who = (f"no heartbeat from {describe_silent(peers, lost)} for {now - first:.1f} s: "
               f"{'that host is' if len(hosts) == 1 else 'those hosts are'} lost, frozen or cut off "
               f"({', '.join(hosts)})")
        if later:
            who += (f"; {describe_silent(peers, later)} fell silent "
                    f"{min(last[r] for r in later) - first:.1f} s later")
    elif len(peers.hosts) > 1 and not peers.ever_heard():
        who = ("no rank's heartbeat ever arrived (UDP between the hosts blocked?), so the lost host "
               "cannot be named")
    else:
        who = "every rank is still heard from: a rank is stuck (not lost), or the bound is too short for this job"
    source = "--failure-timeout" if progress.fixed_s is not None else "--failure-timeout auto"
    return (f"mpidl: rank {peers.rank}: no progress for {progress.quiet_s(now):.1f} s after {progress.where} "
            f"(bound {progress.bound_s:.1f} s, {source}); {who}. Ending the job (exit code "
            f"{EXIT_FAILURE_BOUND}): its result is NOT complete; start it again with --resume from the last "
            f"--checkpoint, without that host (docs/failures.md)")


class ProgressWatchdog:
    """Ends the job when this rank makes no progress within the bound (the module docstring
    says how). Build it on every rank with the start-up rank and every rank's host and
    heartbeat address (:meth:`create` gathers them), then :meth:`start`."""

    def __init__(self, rank: int, hosts: list[str], addresses: list[tuple[str, int]] | None,
                 sock: socket.socket | None, fixed_s: float | None,
                 end: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.progress = Progress(fixed_s)
        self.peers = Peers(rank, list(hosts))
        self._addresses = addresses
        self._sock = sock
        self._end = end if end is not None else self.end_job
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._fired = False

    @classmethod
    def create(cls, fixed_s: float | None, allgather: Callable, rank: int, host: str):
        """Collective (``allgather`` over the start-up world): bind this rank's UDP socket and
        exchange every rank's host and heartbeat address."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 0))
        sock.setblocking(False)
        try:
            ip = socket.gethostbyname(host)
        except OSError:
            ip = "127.0.0.1"
        entries = allgather((host, ip, sock.getsockname()[1]))
        return cls(rank, [e[0] for e in entries], [(e[1], e[2]) for e in entries], sock, fixed_s)

    # -- what the loop calls
    def mark(self, where: str) -> None:
        """Progress: ``where`` says what was just done (``step 57``, ``evaluation``, ...)."""
        with self._lock:
            self.progress.mark(self._clock(), where)

    def forget(self, ranks) -> None:
        with self._lock:
            self.peers.forget(ranks)

    @property
    def bound_s(self) -> float:
        return self.progress.bound_s

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.progress.fixed_s is not None:
            bound = f"{self.progress.fixed_s:g} s (--failure-timeout)"
        else:
            bound = (f"auto: max({FLOOR_S:g} s, {FACTOR:g} x the longest step, evaluation batch or checkpoint), "
                     f"{WARMUP_S:g} s while warming up")
        return (f"failure bound: a rank without progress for {bound} ends the job with exit code "
                f"{EXIT_FAILURE_BOUND} and names the host it lost")

    # -- the thread
    def start(self) -> "ProgressWatchdog":
        now = self._clock()
        with self._lock:
            self.progress.arm(now)
            self.peers.started_at = now
        self._thread = threading.Thread(target=self._run, name="mpidl-failure-bound", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """At the end of training (the final writes and MPI_Finalize are not watched)."""
        self._stop.set()
        if self._sock is not None:  # wake the thread from its select now, not a period later
            try:
                self._sock.sendto(b"", ("127.0.0.1", self._sock.getsockname()[1]))
            except OSError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.period_s + 1)
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    @property
    def period_s(self) -> float:
        """Heartbeat and check period: a tenth of the bound, within [0.2, 2] s."""
        return min(2.0, max(0.2, self.progress.bound_s / 10))

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            now = self._clock()
            period = self.period_s
            if now >= next_beat:
                self._beat()
                next_beat = now + period
            self._receive(period)
            if self._stop.is_set():
                return
            self.check(self._clock())

    def check(self, now: float) -> bool:
        """End the job if the bound is passed (once); True when it did."""
        with self._lock:
            if self._fired or not self.progress.stalled(now):
                return False
            self._fired = True
            speaks = self.peers.speaks_for_job()
            message = stall_message(self.progress, self.peers, now, self.period_s) if speaks else ""
        self._beat(ending=True)
        self._end(message)
        return True

    def _beat(self, ending: bool = False) -> None:
        if self._sock is None or not self._addresses:
            return
        packet = _PACKET.pack(self.peers.rank, self.progress.marks, 1 if ending else 0)
        for r, address in enumerate(self._addresses):
            if r != self.peers.rank and r not in self.peers.gone:
                try:
                    self._sock.sendto(packet, address)
                except OSError:
                    pass  # unreachable now: it will be named as silent

    def _receive(self, wait_s: float) -> None:
        if self._sock is None:
            self._stop.wait(wait_s)
            return
        try:
            ready, _, _ = select.select([self._sock], [], [], wait_s)
        except (OSError, ValueError):
            return
        while ready:
            try:
                data, _ = self._sock.recvfrom(64)
            except (BlockingIOError, OSError):
                return
            if len(data) == _PACKET.size:
                rank, _marks, ending = _PACKET.unpack(data)
                with self._lock:
                    self.peers.heard(rank, self._clock(), ending=bool(ending))

    # -- ending the job
    def end_job(self, message: str) -> None:
        """Print ``message`` (if any), ask MPI to end every rank (``MPI_Abort`` with
        :data:`EXIT_FAILURE_BOUND`), and end this process if MPI has not within
        :data:`ABORT_WAIT_S`. A quiet rank (another one speaks) waits :data:`ABORT_WAIT_S`
        first: its abort would end the speaker before its line is out (seen under hydra)."""
        if message:
            from mpidl.distributed.launch import report  # noqa: PLC0415

            report(message + "\n")
        else:
            time.sleep(ABORT_WAIT_S)

        def abort():
            try:
                from mpi4py import MPI  # noqa: PLC0415

                MPI.COMM_WORLD.Abort(EXIT_FAILURE_BOUND)
            except Exception:  # noqa: BLE001 -- whatever MPI says, this process ends below
                pass

        threading.Thread(target=abort, name="mpidl-abort", daemon=True).start()
        time.sleep(ABORT_WAIT_S)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os._exit(EXIT_FAILURE_BOUND)
