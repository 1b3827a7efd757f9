"""Node-based reduction (the TNNLS scheme): exact inside a node, periodic between nodes.

Every step the ranks of a node average their gradients (fast shared-memory traffic); the
nodes train independently for ``K'`` steps, then the leaders average the PARAMETERS,
weighted by how many samples each node processed since the last sync, and broadcast them in
their node. Inter-node traffic falls by a factor of about ``K'`` times the ranks per node.
"""

from __future__ import annotations

from numbers import Integral

from mpidl.backend import get_array_module
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
    """

    name = "node"

    def __init__(self, topology, weighting="balanced", sync_every: int = 50, emulate_link=None):
        super().__init__(topology, weighting, emulate_link)
        self.sync_every = check_sync_every(sync_every)
        #: samples this rank's node processed since the last parameter sync (S_n)
        self.samples_since_sync = 0
        #: optimizer steps since the last parameter sync (the same on every rank)
        self.steps_since_sync = 0
        self._scratch = None
        #: the node's SharedNode under intra='shm' (set by DataParallel): the parameter sync
        #: then reads and writes the one copy in the window
        self.shared = None

    @property
    def step_is_global(self) -> bool:
        return self.topology.num_nodes == 1

    @property
    def exact(self) -> bool:
        """One node is the flat scheme; several differ between syncs."""
        return self.topology.num_nodes == 1

    def describe(self) -> str:
        return super().describe() + f", parameter sync every {self.sync_every} steps"

    def reduce_gradients(self, message, count: int) -> None:
        check_message(message)
        total = self._weighted_sum("intra", self.topology.node, message, count, self._allreduce)
        self.samples_since_sync += int(round(total)) if self.weighting == "balanced" else 0

    def after_step(self, params_data, state_buffers, flags, steps_done: int) -> tuple | None:
        """Sync the parameters when ``steps_done`` is a multiple of ``sync_every``."""
        self.steps_since_sync += 1
        if self.topology.num_nodes == 1 or steps_done % self.sync_every != 0:
            return None
        return self._average_over_nodes(params_data, state_buffers, flags, into=params_data)

    def synchronize(self, params_data, state_buffers, flags) -> tuple:
        """Average now (a no-op on the parameters when no step was taken since the last sync:
        the replicas are identical then, and only the flags are exchanged)."""
        if self.topology.num_nodes == 1 or self.steps_since_sync == 0:
            return self._world_flags(flags)
        return self._average_over_nodes(params_data, state_buffers, flags, into=params_data)

    def consensus(self, params_data):
        """``sum_n v_n theta_n / sum_n v_n`` (collective), leaving the replicas alone."""
        if self.topology.num_nodes == 1 or self.steps_since_sync == 0:
            return params_data.copy()
        out = params_data.copy()
        self._average_over_nodes(params_data, [], (0.0, 0.0), into=out, reset=False)
        return out

    def pending_samples(self) -> int:
        return self.samples_since_sync

    def set_pending_samples(self, samples: int) -> None:
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
            for k, buf in enumerate(buffers):
                part = message[k * size:(k + 1) * size]
                part[...] = buf
                if weight != 1:
                    part *= weight
            message[COUNT] = weight
            message[STOP] = flags[0]
            message[NONFINITE] = flags[1]
            self._allreduce("inter", topo.leaders, message)
            if self.emulate_link is not None:
                self._emulate_inter_node(self.emulate_link.allreduce_seconds(message.nbytes, topo.num_nodes))
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


def check_sync_every(sync_every) -> int:
    """``K'`` must be an integer >= 1."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, Integral) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    return int(sync_every)
