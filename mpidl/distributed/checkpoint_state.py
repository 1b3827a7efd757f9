"""The checkpoint state of :class:`~mpidl.distributed.DataParallel`: what a run must save to
continue exactly, and restoring it on every rank alike.

A part of :class:`~mpidl.distributed.DataParallel` (its base class), kept in its own file
so that the step reads on its own.
"""

from __future__ import annotations

import numpy as np

from mpidl.backend import to_host
from mpidl.distributed import balance


class CheckpointState:
    """:meth:`state_dict` and :meth:`load_state_dict` of a DataParallel."""

    def state_dict(self) -> dict | None:
        """Everything a checkpoint needs to continue exactly (collective); the full dict on
        rank 0, None elsewhere.

        Keys: ``strategy``, ``weighting``, ``world_size``, ``num_nodes``, ``steps``,
        ``steps_since_sync``, ``costs`` (``[a_i, c_i]`` per rank), ``batch_sizes``, ``params``
        (the consensus),
        ``optimizer`` (``{"step_count", "state": [arrays]}``, the replicas' common state, or
        None when it is per node), ``nodes`` (None, or per node ``{"params": array or None,
        "state": [arrays] or None, "samples": int}`` when the nodes' parameters or optimizer
        state differ: ``node`` strategy between syncs, or with node-local optimizer state),
        ``buffers`` (the world average) and ``rank_buffers`` (each rank's own).
        """
        topo = self.topology
        # An overlapped sync in flight is applied first: a checkpoint cannot hold it.
        sums = self.exchange.finish_pending(self.params.data, self._synced_state())
        if sums is not None:
            self._agree(sums)
        since_sync = self.exchange.steps_since_sync
        params_differ = not self.exact and since_sync > 0
        state_differs = not self.exact and (params_differ or not self.sync_optimizer_state)
        params = self.consensus()
        state = [np.array(to_host(b), copy=True) for b in self.optimizer.state_buffers()]
        nodes = None
        if params_differ or state_differs:
            own = {"params": np.array(to_host(self.params.data), copy=True) if params_differ else None,
                   "state": state if state_differs else None,
                   "samples": int(self.exchange.pending_samples())}
            nodes = self._gather_from_leaders(own)
        buffers_own = self.buffers_host()
        rank_buffers = self.all_gather_object(buffers_own) if buffers_own else None
        if self.rank != 0:
            return None
        averaged = ({name: sum(b[name] for b in rank_buffers) / len(rank_buffers) for name in buffers_own}
                    if rank_buffers else {})
        return {
            "strategy": self.strategy, "weighting": self.weighting, "world_size": topo.size,
            "num_nodes": topo.num_nodes, "steps": self.steps, "steps_since_sync": since_sync,
            "costs": [[c.a, c.c] for c in self.costs], "batch_sizes": list(self.batch_sizes),
            "params": params,
            "optimizer": {"step_count": int(self.optimizer.step_count),
                          "state": None if state_differs else state},
            "nodes": nodes, "buffers": averaged, "rank_buffers": rank_buffers,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s dict (collective: every rank passes it, or the
        parts of it its node needs; see :func:`mpidl.checkpoint.read_checkpoint`).

        Everything is checked first on every rank and the ranks agree: a problem on any rank
        raises the same ValueError on every rank, before anything is changed. The split and
        the cost models are restored when the world size is the same (the run continues exactly);
        otherwise this run's own are kept.
        """
        problem = None
        try:
            parts = self._state_for_this_rank(state)
        except (KeyError, ValueError, TypeError) as exc:
            problem, parts = str(exc), None
        problem = self.agree_on_error(problem)
        if problem is not None:
            raise ValueError(problem)
        params, opt_state, samples, buffers = parts
        with self.exchange.writing_parameters():
            self.optimizer.load_state_dict_host({"state": opt_state, "step_count": state["optimizer"]["step_count"]})
            self.params.data[...] = self._backend.asarray(params) if self._backend else params
            if buffers and self.model is not None:
                self.model.load_buffers_host(buffers)
        self.steps = int(state["steps"])
        self.exchange.restore(int(state.get("steps_since_sync", 0)), samples)
        common = np.asarray(state["params"])  # the consensus: the same on every node
        self.exchange.set_reference(self._backend.asarray(common) if self._backend else common)
        if state["world_size"] == self.size:
            self.costs = [balance.RankCost(a, c) for a, c in state["costs"]]
            self.batch_sizes = list(state["batch_sizes"])

    def _gather_from_leaders(self, own: dict) -> list | None:
        """Rank 0 receives every node's ``own`` dict (from its leader), in node order."""
        topo = self.topology
        gathered = None
        if topo.is_leader:
            gathered = topo.leaders.gather(own, root=0) if topo.num_nodes > 1 else [own]
            self.exchange.counters["control"]["calls"] += 1
        return gathered if self.rank == 0 else None

    def _moved_optimizer_state(self, state: dict, nodes: list):
        """The optimizer state for a run on another strategy or number of nodes than the
        ``node`` checkpoint's. Movable only when it was written right after a parameter sync
        (an epoch's end): the parameters are then the consensus, and the optimizer state is
        the nodes' average (what ``sync_optimizer_state`` keeps at every sync). Otherwise a
        ValueError says why and what would work."""
        topo = self.topology
        if state.get("steps_since_sync", 0) or any(n.get("params") is not None for n in nodes):
            raise ValueError(
                f"it was written {state.get('steps_since_sync')} step(s) after the last parameter sync of "
                f"its {state['num_nodes']} nodes (strategy {state['strategy']}), while their parameters "
                f"differed, so it continues only with strategy node on {state['num_nodes']} node(s) (this "
                f"run: strategy {self.strategy} on {topo.num_nodes}); resume it so until an epoch's end "
                "(the checkpoint there follows a parameter sync), then change the strategy or node count")
        per_node = [n.get("state") for n in nodes]
        if any(s is None for s in per_node):
            return state["optimizer"]["state"]
        return [(sum(np.asarray(s[i], dtype=np.float64) for s in per_node) / len(per_node))
                .astype(np.asarray(per_node[0][i]).dtype) for i in range(len(per_node[0]))]

    def _state_for_this_rank(self, state: dict):
        """(params, optimizer state, node samples, buffers) of this rank from a state dict;
        raises ValueError naming the mismatch."""
        topo = self.topology
        for key in ("strategy", "world_size", "num_nodes", "steps", "params", "optimizer"):
            if key not in state:
                raise KeyError(f"state dict lacks {key!r}")
        nodes = state.get("nodes")
        common_state = state["optimizer"]["state"]
        if nodes is not None and (self.strategy != "node" or self.exact or state["num_nodes"] != topo.num_nodes):
            nodes, common_state = None, self._moved_optimizer_state(state, nodes)
        mine = nodes[topo.node_id] if nodes is not None else {}
        params = mine.get("params") if mine.get("params") is not None else state["params"]
        params = np.asarray(params)
        if params.shape != (self.params.size,):
            raise ValueError(f"the state has {params.size} parameters, the model {self.params.size}")
        opt_state = mine.get("state") if mine.get("state") is not None else common_state
        if opt_state is None:
            raise ValueError("the state holds no optimizer state for this node")
        expected = [tuple(b.shape) for b in self.optimizer.state_buffers()]
        got = [tuple(np.shape(b)) for b in opt_state]
        if got != expected:
            raise ValueError(f"optimizer state of shapes {got} does not fit {type(self.optimizer).__name__} "
                             f"(expects {expected})")
        rank_buffers = state.get("rank_buffers")
        if rank_buffers is not None and len(rank_buffers) == self.size and rank_buffers[self.rank] is not None:
            buffers = rank_buffers[self.rank]
        else:
            buffers = state.get("buffers") or {}
        own_buffers = self.buffers_host()
        if set(buffers) != set(own_buffers):
            raise ValueError(f"buffers {sorted(buffers)} do not match the model's {sorted(own_buffers)}")
        return params, opt_state, int(mine.get("samples", 0)), buffers
