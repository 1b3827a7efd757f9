"""Node-based reduction (the TNNLS scheme): exact inside a node, periodic between nodes.

Every step the ranks of a node average their gradients (fast shared-memory traffic); the
nodes train independently for ``K'`` steps, then the leaders average the PARAMETERS,
weighted by how many samples each node processed since the last sync, and broadcast them in
their node. Inter-node traffic falls by a factor of about ``K'`` times the ranks per node.
"""

from __future__ import annotations

from numbers import Integral

from mpi4py import MPI

from mpidl.backend import get_array_module
from mpidl.distributed.emulation import LinkTimeline
from mpidl.distributed.reducer_base import COUNT, NONFINITE, STOP, Reducer, check_message


class NodeReducer(Reducer):
    """Node-local weighted gradient allreduce every step; node-weighted parameter average
    every ``sync_every`` steps.

    Notes
    -----
    Gradients, every step, within node ``n`` (``R_n`` its ranks)::

        g_n = sum_{i in R_n} c_i g_i / sum_{i in R_n} c_i,   balanced c_i = b_i, uniform c_i = 1

    so the replicas of one node stay identical and each node follows the exact gradient of
    its own samples (a node whose ranks computed nothing this step gets ``g_n = 0``).

    Parameters, when ``steps_done % sync_every == 0`` (and at :meth:`synchronize`)::

        theta = sum_n v_n theta_n / sum_n v_n,   balanced: v_n = S_n,  uniform: v_n = 1

    where ``S_n`` is the number of samples node ``n`` processed since the last sync (the sum
    of the counts its per-step reductions returned, so no extra message is needed). Each
    leader sends ``[v_n theta_n | v_n | flags]`` in one ``Allreduce(SUM)`` among the leaders
    and broadcasts the sum in its node; every rank then divides, so afterwards all replicas
    are bitwise identical. The optimizer's state buffers, when given, travel in the same
    message and are averaged with the same weights. With ``sync_every = 1`` and plain SGD
    this equals the flat scheme: ``sum_n v_n (theta - lr g_n) / sum_n v_n = theta - lr sum_i
    (b_i / B) g_i``.

    With a single node this is the flat scheme on the node communicator, and there is no
    inter-node traffic at all (no parameter syncs; :meth:`after_step` returns None).

    Counters: per step ``intra`` 1 call; per parameter sync ``inter`` 1 call (leaders) and
    ``intra`` 1 call (the broadcast), each of the message's ``nbytes``.

    EMULATION: leaders sleep ``2 (L-1) (alpha + n / (L beta))`` after each leaders' allreduce.

    Compressed syncs (``compress='bf16'|'fp16'``): the leaders exchange the weighted
    CHANGES since the last sync, ``v_n (theta_n - theta_ref)`` (small numbers: the rounding
    error is relative to the step, not to the weights), with error feedback, and every node
    gets ``theta = theta_ref + sum_n v_n (theta_n - theta_ref) / sum_n v_n`` (the same
    average); ``theta_ref`` is the result of the last sync (the broadcast start at first).
    """

    name = "node"

    def __init__(self, topology, weighting="balanced", sync_every: int = 50, emulate_link=None,
                 sync_overlap: int = 0, compress: str = "none"):
        self.sync_every = check_sync_every(sync_every)
        check_sync_overlap(sync_overlap, self.sync_every, compress)
        super().__init__(topology, weighting, emulate_link, compress)
        #: steps between the start of an overlapped parameter sync and its application (0: blocking)
        self.sync_overlap = int(sync_overlap)
        self._async = None  # the overlapped sync in flight: dict, or None
        self._async_comm = (topology.leaders.Dup() if self.sync_overlap and topology.is_leader
                            else MPI.COMM_NULL)
        self._timeline = LinkTimeline()
        #: samples this rank's node processed since the last parameter sync (S_n)
        self.samples_since_sync = 0
        #: optimizer steps since the last parameter sync (the same on every rank)
        self.steps_since_sync = 0
        self._scratch = None
        #: the node's SharedNode under intra='shm' (see attach_shared): the parameter sync
        #: then reads and writes the one copy in the window
        self.shared = None
        #: compressed syncs: buffer index -> its value at the last sync (common to all nodes)
        self._refs: dict = {}

    @property
    def step_is_global(self) -> bool:
        return self.topology.num_nodes == 1

    @property
    def exact(self) -> bool:
        """One node is the flat scheme; several differ between syncs."""
        return self.topology.num_nodes == 1

    def _details(self) -> str:
        text = f", K'={self.sync_every}"
        if self.sync_overlap:
            text += f", sync applied {self.sync_overlap} step(s) after it starts"
        return text

    def attach_shared(self, shared) -> None:
        self.shared = shared

    def add_samples(self, total: float) -> None:
        if self.weighting == "balanced":
            self.samples_since_sync += int(round(total))

    def reduce_gradients(self, message, count: int) -> None:
        check_message(message)
        self.add_samples(self._weighted_sum("intra", self.topology.node, message, count, self.allreduce))

    def after_step(self, params_data, state_buffers, flags, steps_done: int) -> tuple | None:
        """Sync the parameters when ``steps_done`` is a multiple of ``sync_every``."""
        self.steps_since_sync += 1
        if self.topology.num_nodes == 1:
            return None
        result = None
        if self._async is not None and steps_done >= self._async["apply_at"]:
            result = self._finish_async(params_data, state_buffers)
        if steps_done % self.sync_every != 0:
            return result
        if self.sync_overlap:
            self._start_async(params_data, state_buffers, flags, steps_done + self.sync_overlap)
            return result
        return self._average_over_nodes(params_data, state_buffers, flags, into=params_data)

    # -- the overlapped sync -----------------------------------------------------------------
    def _start_async(self, params_data, state_buffers, flags, apply_at: int) -> None:
        """Start the leaders' ``Iallreduce`` of ``[v_n theta_t | v_n s_t | v_n | flags]``.

        Applied at step ``t + sync_overlap`` (:meth:`_finish_async`) as::

            theta <- avg(theta_t) + (theta_now - theta_t)

        i.e. the average of the nodes' parameters at the start, plus the progress this node
        made meanwhile (the same for the optimizer state with ``sync_optimizer_state``). It
        equals the blocking sync when nothing changed the parameters meanwhile
        (``theta_now = theta_t``: ``sync_overlap = 0``, or skipped steps only); otherwise the
        local steps taken between ``t`` and the application were computed at the
        un-averaged ``theta``, which is the price of not waiting."""
        topo = self.topology
        buffers = [params_data, *state_buffers]
        size = params_data.size
        pending = {"apply_at": apply_at, "count": len(buffers), "request": None, "deadline": 0.0}
        if topo.is_leader:
            xp = get_array_module(params_data)
            message = xp.zeros(size * len(buffers) + 3, dtype=params_data.dtype)
            weight = self.samples_since_sync if self.weighting == "balanced" else 1
            for k, buf in enumerate(buffers):
                part = message[k * size:(k + 1) * size]
                part[...] = buf
                if weight != 1:
                    part *= weight
            message[COUNT], message[STOP], message[NONFINITE] = weight, flags[0], flags[1]
            pending["message"] = message
            pending["snapshot"] = [buf.copy() for buf in buffers]
            pending["request"] = self._async_comm.Iallreduce(MPI.IN_PLACE, message, op=MPI.SUM)
            self.counters["inter"]["calls"] += 1
            self.counters["inter"]["bytes"] += message.nbytes
            if self.emulate_link is not None:
                pending["deadline"] = self._timeline.start(
                    self.emulate_link.allreduce_seconds(message.nbytes, topo.num_nodes))
        self._async = pending
        self.samples_since_sync = 0
        self.steps_since_sync = 0

    def _finish_async(self, params_data, state_buffers) -> tuple:
        """Wait for the sync in flight and apply it (see :meth:`_start_async`)."""
        import time  # noqa: PLC0415

        pending, self._async = self._async, None
        topo = self.topology
        buffers = [params_data, *state_buffers][: pending["count"]]
        size = params_data.size
        start = time.perf_counter()
        if topo.is_leader:
            message = pending["message"]
            pending["request"].Wait()
            if pending["deadline"] > 0:
                self.emulated_seconds += self._timeline.wait(pending["deadline"])
            total = float(message[COUNT])
            if total > 0:
                for k, snap in enumerate(pending["snapshot"]):
                    part = message[k * size:(k + 1) * size]
                    part /= total
                    part -= snap   # avg(theta_t) - theta_t
        else:
            message = get_array_module(params_data).zeros(size * pending["count"] + 3, dtype=params_data.dtype)
        self._bcast_from_root("intra", topo.node, message)
        self.comm_seconds += time.perf_counter() - start
        if float(message[COUNT]) <= 0:
            raise RuntimeError("node parameter sync: no node processed a sample since the last sync "
                               "(every rank passed a count of 0); the parameter average is undefined")
        for k, buf in enumerate(buffers):
            buf += message[k * size:(k + 1) * size]
        return float(message[STOP]), float(message[NONFINITE])

    def close(self) -> None:
        """Free the communicator of the overlapped syncs (apply a pending one first with
        :meth:`finish_pending`)."""
        if self._async_comm != MPI.COMM_NULL:
            self._async_comm.Free()
            self._async_comm = MPI.COMM_NULL

    def communicators(self) -> list:
        return super().communicators() + [self._async_comm]

    def sync_due(self, steps_done: int) -> bool:
        return self.topology.num_nodes > 1 and steps_done % self.sync_every == 0

    def finish_pending(self, params_data, state_buffers) -> tuple | None:
        """Apply an overlapped sync in flight now (collective); its flag sums, or None."""
        if self._async is None:
            return None
        return self._finish_async(params_data, state_buffers)

    def synchronize(self, params_data, state_buffers, flags) -> tuple:
        """Average now (a no-op on the parameters when no step was taken since the last sync:
        the replicas are identical then, and only the flags are exchanged)."""
        pending = self.finish_pending(params_data, state_buffers)
        if self.topology.num_nodes == 1 or self.steps_since_sync == 0:
            sums = self._world_flags(flags)
            return sums if pending is None else (sums[0] + pending[0], sums[1] + pending[1])
        sums = self._average_over_nodes(params_data, state_buffers, flags, into=params_data)
        return sums if pending is None else (sums[0] + pending[0], sums[1] + pending[1])

    def consensus(self, params_data):
        """``sum_n v_n theta_n / sum_n v_n`` (collective), leaving the replicas alone."""
        if self.topology.num_nodes == 1 or self.steps_since_sync == 0:
            return params_data.copy()
        out = params_data.copy()
        self._average_over_nodes(params_data, [], (0.0, 0.0), into=out, reset=False)
        return out

    def pending_samples(self) -> int:
        return self.samples_since_sync

    def restore(self, steps_since_sync: int, samples: int) -> None:
        self.steps_since_sync = int(steps_since_sync)
        self.samples_since_sync = int(samples)

    def _average_over_nodes(self, params_data, state_buffers, flags, *, into, reset=True) -> tuple:
        """The leaders' weighted SUM of ``[v_n theta_n | v_n s_n ... | v_n | stop | nonfinite]``,
        broadcast in every node, divided by ``sum v_n`` on every rank."""
        topo = self.topology
        shared = self.shared is not None and into is params_data
        buffers = [params_data, *state_buffers]
        size = params_data.size
        length = size * len(buffers) + 3
        if self._scratch is None or self._scratch.size != length or self._scratch.dtype != params_data.dtype:
            self._scratch = get_array_module(params_data).zeros(length, dtype=params_data.dtype)
        message = self._scratch
        if topo.is_leader:
            weight = self.samples_since_sync if self.weighting == "balanced" else 1
            refs = self._references(buffers) if self.compressor is not None else [None] * len(buffers)
            for k, buf in enumerate(buffers):
                part = message[k * size:(k + 1) * size]
                part[...] = buf
                if refs[k] is not None:
                    part -= refs[k]
                if weight != 1:
                    part *= weight
            message[COUNT] = weight
            message[STOP] = flags[0]
            message[NONFINITE] = flags[1]
            self.inter_sum(message, key="parameters")
            if self.compressor is not None and message[COUNT] > 0:
                # theta = theta_ref + sum_n v_n (theta_n - theta_ref) / sum_n v_n, finished
                # here (the node's ranks then divide by 1); the result is the next reference
                message[:COUNT] /= message[COUNT]
                for k, ref in enumerate(refs):
                    part = message[k * size:(k + 1) * size]
                    if ref is not None:
                        part += ref
                    if reset:
                        self._refs[k] = part.copy()
                message[COUNT] = 1.0
        if shared:
            return self._finish_shared(message, buffers, reset)
        self._bcast_from_root("intra", topo.node, message)
        total = float(message[COUNT])
        if total <= 0:
            raise RuntimeError("node parameter sync: no node processed a sample since the last sync "
                               "(every rank passed a count of 0); the parameter average is undefined")
        targets = [into, *state_buffers]
        for k, buf in enumerate(targets):
            part = message[k * size:(k + 1) * size]
            buf[...] = part
            buf /= total
        if reset:
            self.samples_since_sync = 0
            self.steps_since_sync = 0
        return float(message[STOP]), float(message[NONFINITE])


    def set_reference(self, params_data, state_buffers=()) -> None:
        """Compressed syncs: the common reference ``theta_ref`` (and state references), the
        same on every leader (the broadcast start, a checkpoint's consensus); a state without
        one is sent whole. Uncompressed syncs send the parameters themselves: nothing to keep."""
        if self.compressor is None:
            return
        self._refs = {0: params_data.copy()}
        for k, buf in enumerate(state_buffers, start=1):
            self._refs[k] = buf.copy()

    def _references(self, buffers) -> list:
        return [self._refs.get(k) if self._refs.get(k) is not None and self._refs[k].shape == b.shape else None
                for k, b in enumerate(buffers)]

    def _finish_shared(self, message, buffers, reset) -> tuple:
        """intra='shm': the leader divides the leaders' sum into the node's one copy of the
        parameters and state and writes ``[count | stop | nonfinite]`` into slot 0's tail;
        after a node barrier every rank reads them."""
        shared = self.shared
        size = buffers[0].size
        total = float(message[COUNT]) if self.topology.is_leader else 0.0
        if self.topology.is_leader:
            if total > 0:
                for k, buf in enumerate(buffers):
                    buf[...] = message[k * size:(k + 1) * size]
                    buf /= total
            shared.slots[0, COUNT:] = message[COUNT:]
        shared.barrier()
        total, stop, nonfinite = (float(v) for v in shared.slots[0, COUNT:])
        shared.barrier()  # read by all before rank 0's next step writes its slot again
        if total <= 0:
            raise RuntimeError("node parameter sync: no node processed a sample since the last sync "
                               "(every rank passed a count of 0); the parameter average is undefined")
        if reset:
            self.samples_since_sync = 0
            self.steps_since_sync = 0
        return stop, nonfinite


def check_sync_overlap(sync_overlap, sync_every: int, compress: str = "none") -> int:
    """``sync_overlap`` must be an integer in ``[0, K')``; the overlapped sync sends the
    parameters themselves, so it does not combine with a compressed sync."""
    if isinstance(sync_overlap, bool) or not isinstance(sync_overlap, Integral) \
            or not 0 <= sync_overlap < sync_every:
        raise ValueError(f"sync_overlap must be an integer in [0, sync_every={sync_every}), "
                         f"got {sync_overlap!r}")
    if sync_overlap and compress != "none":
        raise ValueError("sync_overlap works with the uncompressed sync (no compress)")
    return int(sync_overlap)


def check_sync_every(sync_every) -> int:
    """``K'`` must be an integer >= 1."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, Integral) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    return int(sync_every)
