"""A DataParallel's state as a dict, and back: what a run must save to continue exactly.

:func:`state_dict` gathers onto rank 0 what differs between nodes (the ``node`` strategy's
replicas between two syncs, node-local optimizer state); :func:`load_state_dict` gives every
rank its part back, after every rank has checked it and the ranks have agreed. The file
format around it is :mod:`mpidl.app.checkpoint`.
"""

from __future__ import annotations

import numpy as np

from mpidl.engine.backend import get_array_module, to_host
from mpidl.distributed.split.balance import RankCost

__all__ = ["state_dict", "load_state_dict"]


def _host(array) -> np.ndarray:
    return np.array(to_host(array), copy=True)


def state_dict(dp) -> dict | None:
    """Everything a checkpoint needs to continue ``dp`` exactly (collective); the dict on rank
    0, None elsewhere.

    Keys: ``strategy``, ``weighting``, ``world_size``, ``num_nodes``, ``steps``,
    ``steps_since_sync``, ``costs`` (``[a_i, c_i]`` per rank), ``batch_sizes``, ``params`` (the
    consensus, ``theta = sum_n v_n theta_n / sum_n v_n`` between the node strategy's syncs),
    ``optimizer`` (``{"step_count", "state": [arrays] or None when it is per node}``),
    ``nodes`` (None, or per node ``{"params", "state", "samples"}`` (``samples`` = ``v_n``) when
    the nodes' parameters or optimizer state differ), ``buffers`` (the world average) and
    ``rank_buffers`` (each rank's own).
    """
    topo, exchange = dp.topology, dp.exchange
    own_state = exchange.state()
    since_sync = int(own_state.get("steps_since_sync", 0))
    params_differ = not exchange.exact and since_sync > 0
    state_differs = not exchange.exact and (params_differ or not getattr(exchange, "sync_optimizer_state", False))
    state = [_host(b) for b in dp.optimizer.state_buffers()]
    nodes = None
    if params_differ or state_differs:
        own = {"params": _host(dp.params.data) if params_differ else None,
               "state": state if state_differs else None,
               "samples": float(own_state.get("weight_since_sync", 0.0))}
        if topo.is_leader:
            nodes = topo.leaders.gather(own, root=0) if topo.num_nodes > 1 else [own]
    buffers_own = dp.buffers_host()
    rank_buffers = dp.all_gather_object(buffers_own) if buffers_own else None
    if dp.rank != 0:
        return None
    params = _host(dp.params.data)
    if params_differ:
        weights = [n["samples"] for n in nodes]
        params = sum(w * n["params"].astype(np.float64) for w, n in zip(weights, nodes)) / sum(weights)
        params = params.astype(nodes[0]["params"].dtype)
    averaged = ({name: sum(b[name] for b in rank_buffers) / len(rank_buffers) for name in buffers_own}
                if rank_buffers else {})
    return {"strategy": exchange.name, "weighting": dp.weighting, "world_size": topo.size,
            "num_nodes": topo.num_nodes, "steps": dp.steps, "steps_since_sync": since_sync,
            "costs": [[c.a, c.c] for c in dp.split.costs], "batch_sizes": list(dp.split.batch_sizes),
            "params": params,
            "optimizer": {"step_count": int(dp.optimizer.step_count), "state": None if state_differs else state},
            "nodes": nodes, "buffers": averaged, "rank_buffers": rank_buffers}


def load_state_dict(dp, state: dict) -> None:
    """Continue ``dp`` from :func:`state_dict`'s dict (collective: every rank passes it, or the
    parts of it its node needs; see :func:`mpidl.app.checkpoint.read_checkpoint`).

    Everything is checked first on every rank and the ranks agree: a problem on any rank
    raises the same ValueError on every rank, before anything is changed. The split and the
    cost models are restored when the world size is the same (the run continues exactly);
    otherwise this run's own are kept."""
    problem = None
    try:
        params, opt_state, weight, buffers = _state_for_this_rank(dp, state)
    except (KeyError, ValueError, TypeError) as exc:
        problem = str(exc)
    problem = dp.agree_on_error(problem)
    if problem is not None:
        raise ValueError(problem)
    dp.optimizer.load_state_dict_host({"state": opt_state, "step_count": state["optimizer"]["step_count"]})
    dp.params.data[...] = get_array_module(dp.params.data).asarray(params)
    if buffers and dp.model is not None:
        dp.model.load_buffers_host(buffers)
    dp.steps = int(state["steps"])
    dp.exchange.load_state({"steps_since_sync": int(state.get("steps_since_sync", 0)),
                            "weight_since_sync": weight})
    if state["world_size"] == dp.size:
        dp.split.costs = [RankCost(a, c) for a, c in state["costs"]]
        dp.split.batch_sizes = list(state["batch_sizes"])


def _moved_optimizer_state(dp, state: dict, nodes: list):
    """The optimizer state for a run on another strategy or number of nodes than the ``node``
    checkpoint's: movable only when it was written right after a parameter sync (an epoch's
    end), when the parameters are the consensus and the state is the nodes' average."""
    if state.get("steps_since_sync", 0) or any(n.get("params") is not None for n in nodes):
        raise ValueError(
            f"it was written {state.get('steps_since_sync')} step(s) after the last parameter sync of "
            f"its {state['num_nodes']} nodes (strategy {state['strategy']}), while their parameters "
            f"differed, so it continues only with strategy node on {state['num_nodes']} node(s) (this "
            f"run: strategy {dp.exchange.name} on {dp.topology.num_nodes}); resume it so until an epoch's end "
            "(the checkpoint there follows a parameter sync), then change the strategy or node count")
    per_node = [n.get("state") for n in nodes]
    if any(s is None for s in per_node):
        return state["optimizer"]["state"]
    return [(sum(np.asarray(s[i], dtype=np.float64) for s in per_node) / len(per_node))
            .astype(np.asarray(per_node[0][i]).dtype) for i in range(len(per_node[0]))]


def _state_for_this_rank(dp, state: dict):
    """(params, optimizer state, node weight, buffers) of this rank; ValueError names a mismatch."""
    topo = dp.topology
    for key in ("strategy", "world_size", "num_nodes", "steps", "params", "optimizer"):
        if key not in state:
            raise KeyError(f"state dict lacks {key!r}")
    nodes = state.get("nodes")
    common_state = state["optimizer"]["state"]
    if nodes is not None and (dp.exchange.name != "node" or dp.exchange.exact or state["num_nodes"] != topo.num_nodes):
        nodes, common_state = None, _moved_optimizer_state(dp, state, nodes)
    mine = nodes[topo.node_id] if nodes is not None else {}
    params = np.asarray(mine.get("params") if mine.get("params") is not None else state["params"])
    if params.shape != (dp.params.size,):
        raise ValueError(f"the state has {params.size} parameters, the model {dp.params.size}")
    opt_state = mine.get("state") if mine.get("state") is not None else common_state
    if opt_state is None:
        raise ValueError("the state holds no optimizer state for this node")
    expected = [tuple(b.shape) for b in dp.optimizer.state_buffers()]
    got = [tuple(np.shape(b)) for b in opt_state]
    if got != expected:
        raise ValueError(f"optimizer state of shapes {got} does not fit {type(dp.optimizer).__name__} "
                         f"(expects {expected})")
    rank_buffers = state.get("rank_buffers")
    if rank_buffers is not None and len(rank_buffers) == dp.size and rank_buffers[dp.rank] is not None:
        buffers = rank_buffers[dp.rank]
    else:
        buffers = state.get("buffers") or {}
    if set(buffers) != set(dp.buffers_host()):
        raise ValueError(f"buffers {sorted(buffers)} do not match the model's {sorted(dp.buffers_host())}")
    return params, opt_state, float(mine.get("samples", 0.0)), buffers
