"""Atomic HDF5 checkpoints and saved models, and the protocol that writes and resumes them.

Every file is written to a temporary name in the target folder, flushed, ``fsync``-ed and then
renamed over the old one with :func:`os.replace`, which is atomic on POSIX file systems: a job
killed mid-write leaves the previous file intact and readable, never half a file (at worst a
stray ``.<name>.XXXXXXXX.tmp`` when the process is killed with SIGKILL, which the next start
in that folder removes; an exception removes it at once). See :mod:`mpidl.app.outputs`.

A checkpoint is ONE file, ``DIR/checkpoint.h5``, written by world rank 0 from
:func:`mpidl.distributed.checkpoint.state_dict` (which gathers
what differs between nodes onto rank 0), so one rename makes a complete checkpoint visible:

``params``
    the consensus parameters (the average of the nodes' under the ``node`` strategy)
``optimizer/state<i>``
    the optimizer's flat state buffers, when every replica holds the same
``nodes/<k>/params``, ``nodes/<k>/optimizer/state<i>``
    node ``k``'s own parameters (``node`` strategy, between two inter-node syncs) and its
    optimizer state (when it is node-local), so that a resumed run continues exactly
``buffers/<name>``, ``rank_buffers/<r>/<name>``
    batch-norm running statistics: the world average, and each rank's own (restored when
    the world size is the same)
attributes (JSON)
    the training loop's own (``epoch``, ``step_in_epoch``, ``config``, ``model``,
    ``build_args``, ``num_train_samples``, ...), ``distributed`` (strategy, world size,
    nodes, steps, the ranks' cost models, split, each node's samples since the last sync) and
    ``format_version``.

Rank 0 holds one copy of the per-node state of every node while it writes (``num_nodes``
times the model's size, only between syncs or with node-local optimizer state).

Data order needs no saved random state: the permutation of epoch ``e`` is a pure function of
``(seed, e)``, so resuming at ``(epoch, step_in_epoch)`` replays exactly the same batches.
(Not restored: the generator of a ``Dropout`` layer, which restarts from its seed.)
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import h5py
import numpy as np

from mpidl.app.outputs import atomic_h5  # noqa: F401 - the writer of every file here
from mpidl.app.outputs import cause
from mpidl.distributed.checkpoint import load_state_dict, state_dict

CHECKPOINT_NAME = "checkpoint.h5"
FORMAT_VERSION = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says which file and why."""


# ----------------------------------------------------------------------------------- models
def save_model(path: str, model) -> None:
    """Write a model: one dataset per parameter, named by its registered name, the batch-norm
    buffers under ``buffers/``, and the model name and build arguments as attributes (enough
    for :func:`load_model` to rebuild it)."""
    with atomic_h5(path) as f:
        for p in model.params:
            f.create_dataset(p.name, data=np.asarray(model.backend.to_host(p.data)))
        for name, value in model.buffers_host().items():
            f.create_dataset("buffers/" + name, data=value)
        f.attrs["model"] = model.name
        f.attrs["build_args"] = json.dumps(model.build_args)
        f.attrs["param_order"] = json.dumps([p.name for p in model.params])


def load_model(path: str, backend=None):
    """Rebuild a model written by :func:`save_model`. A file that is not one raises
    ValueError whose message starts with ``path`` and says what the file is instead (a
    checkpoint, which ``--resume`` reads)."""
    from mpidl.engine.models import build_model  # noqa: PLC0415 - keep checkpoint import-light

    with h5py.File(path, "r") as f:
        if "build_args" not in f.attrs or "param_order" not in f.attrs:
            if "format_version" in f.attrs and "params" in f:
                raise ValueError(f"{path} is a checkpoint (mpidl.train --checkpoint DIR), not a saved "
                                 "model: a run resumes from it with --checkpoint DIR --resume; a model "
                                 "file is what mpidl.train --save PATH writes")
            raise ValueError(f"{path} is not a model written by mpidl.train --save (it has no "
                             "build_args and param_order attributes)")
        args = json.loads(f.attrs["build_args"])
        model = build_model(backend=backend, **args)
        model.params.load_host({p.name: f[p.name][()] for p in model.params})
        if "buffers" in f:
            model.load_buffers_host({k: f["buffers"][k][()] for k in f["buffers"]})
    return model


# ----------------------------------------------------------------------------------- checkpoints
def save_checkpoint(folder: str, dp, meta: dict) -> str:
    """Write ``folder/checkpoint.h5`` (collective over ``dp``'s ranks; rank 0 writes).

    ``dp`` : the :class:`~mpidl.distributed.DataParallel` whose state is saved; ``meta`` : the
    training loop's JSON-serializable attributes (the same on every rank). Returns the path.
    """
    state = state_dict(dp)
    path = os.path.join(folder, CHECKPOINT_NAME)
    if state is None:
        return path
    distributed = {key: state[key] for key in ("strategy", "weighting", "world_size", "num_nodes",
                                               "steps", "steps_since_sync", "costs", "batch_sizes")}
    distributed["optimizer_step"] = state["optimizer"]["step_count"]
    nodes = state["nodes"]
    distributed["node_samples"] = None if nodes is None else [int(n["samples"]) for n in nodes]
    with atomic_h5(path) as f:
        f.create_dataset("params", data=np.asarray(state["params"]))
        if state["optimizer"]["state"] is not None:
            _write_state(f.create_group("optimizer"), state["optimizer"]["state"])
        for k, node in enumerate(nodes or []):
            group = f.create_group(f"nodes/{k}")
            if node["params"] is not None:
                group.create_dataset("params", data=np.asarray(node["params"]))
            if node["state"] is not None:
                _write_state(group.create_group("optimizer"), node["state"])
        for name, value in state["buffers"].items():
            f.create_dataset("buffers/" + name, data=np.asarray(value))
        for rank, buffers in enumerate(state["rank_buffers"] or []):
            for name, value in buffers.items():
                f.create_dataset(f"rank_buffers/{rank}/{name}", data=np.asarray(value))
        for key, value in {**meta, "distributed": distributed, "format_version": FORMAT_VERSION}.items():
            f.attrs[key] = json.dumps(value)
    return path


def read_checkpoint_meta(folder: str) -> dict:
    """The attributes of ``folder/checkpoint.h5`` (cheap: no arrays are read)."""
    path = os.path.join(folder, CHECKPOINT_NAME)
    with _open_checkpoint(path) as f:
        return _meta(f, path)


def read_checkpoint(folder: str, *, node_id: int, rank: int, world_size: int,
                    num_nodes: int | None = None, strategy: str = "node") -> tuple[dict, dict]:
    """``(state, meta)``: the parts of ``folder/checkpoint.h5`` that rank ``rank`` of node
    ``node_id`` needs, as :func:`mpidl.distributed.checkpoint.load_state_dict` takes them (the other nodes'
    and ranks' entries are left empty), and the file's attributes. A run on another
    ``strategy`` or number of nodes (``num_nodes``, None: the same) gets every node's
    optimizer state (their average is its own) and, per node, whether its parameters
    differed (``"params": True``), not the arrays."""
    path = os.path.join(folder, CHECKPOINT_NAME)
    try:
        with _open_checkpoint(path) as f:
            meta = _meta(f, path)
            dist = meta["distributed"]
            node_samples = dist.get("node_samples")
            nodes = None
            if node_samples is not None:
                nodes = [{} for _ in node_samples]
                moved = strategy != "node" or (num_nodes is not None and num_nodes != len(nodes))
                for k in range(len(nodes)) if moved else [node_id] if node_id < len(nodes) else []:
                    group = f[f"nodes/{k}"]
                    nodes[k] = {
                        "params": (("params" in group) or None) if moved
                        else group["params"][()] if "params" in group else None,
                        "state": _read_state(group["optimizer"]) if "optimizer" in group else None,
                        "samples": node_samples[k],
                    }
            rank_buffers = None
            if "rank_buffers" in f and dist["world_size"] == world_size and str(rank) in f["rank_buffers"]:
                rank_buffers = [None] * world_size
                own = f[f"rank_buffers/{rank}"]
                rank_buffers[rank] = {k: own[k][()] for k in own}
            state = {
                **{key: dist[key] for key in ("strategy", "weighting", "world_size", "num_nodes",
                                              "steps", "steps_since_sync", "costs", "batch_sizes")},
                "params": f["params"][()],
                "optimizer": {"step_count": dist["optimizer_step"],
                              "state": _read_state(f["optimizer"]) if "optimizer" in f else None},
                "nodes": nodes,
                "buffers": {k: f["buffers"][k][()] for k in f["buffers"]} if "buffers" in f else {},
                "rank_buffers": rank_buffers,
            }
    except CheckpointError:
        raise  # already says which file and why
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"--resume: {path} is not a readable mpidl checkpoint ({exc})") from None
    return state, meta


def load_checkpoint(folder: str, dp, check) -> dict:
    """Resume ``dp`` from ``folder/checkpoint.h5`` (collective); returns the file's attributes.

    Every rank reads what it needs, ``check(meta, path)`` (the loop's own compatibility test:
    raise :class:`CheckpointError` to refuse) runs on every rank, and the ranks agree: a
    problem on any rank raises the same :class:`CheckpointError` on every rank, before any
    state is changed.
    """
    path = os.path.join(folder, CHECKPOINT_NAME)
    problem, state, meta = None, None, None
    topo = dp.topology
    try:
        state, meta = read_checkpoint(folder, node_id=topo.node_id, rank=topo.rank, world_size=topo.size,
                                      num_nodes=topo.num_nodes, strategy="flat" if dp.exchange.exact else dp.exchange.name)
        check(meta, path)
    except (CheckpointError, OSError) as exc:
        problem = str(exc) if isinstance(exc, CheckpointError) else f"--resume: {exc}"
    problem = dp.agree_on_error(problem)
    if problem is not None:
        raise CheckpointError(problem)
    try:
        load_state_dict(dp, state)
    except ValueError as exc:  # already agreed by every rank
        raise CheckpointError(f"--resume: {path}: {exc}") from None
    return meta


# ----------------------------------------------------------------------------------- helpers
@contextmanager
def _open_checkpoint(path: str):
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume: no checkpoint at {path}")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise CheckpointError(f"--resume: {path} is not a readable mpidl checkpoint: {cause(exc)}") from None
    with f:
        yield f


def _meta(f, path: str) -> dict:
    if "param_order" in f.attrs and "format_version" not in f.attrs:
        raise CheckpointError(
            f"--resume: {path} is a saved model (mpidl.train --save), not a checkpoint: it holds the "
            "weights only, not the optimizer state and the place in the training that --resume "
            f"needs; python -m mpidl.predict --model {path} (or mpidl.app.checkpoint.load_model) reads it, "
            "and a run resumes from the --checkpoint DIR it wrote")
    try:
        meta = {k: json.loads(v) for k, v in f.attrs.items()}
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"--resume: {path} has unreadable attributes ({exc})") from None
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(f"--resume: {path} has checkpoint format {version}; this mpidl reads "
                              f"format {FORMAT_VERSION} (start a new run, or resume with the mpidl "
                              "version that wrote it)")
    missing = [k for k in ("epoch", "step_in_epoch", "build_args", "distributed") if k not in meta]
    if missing:
        raise CheckpointError(f"--resume: {path} lacks the attributes {missing}")
    return meta


def _write_state(group, state: list) -> None:
    group.attrs["count"] = len(state)
    for i, buf in enumerate(state):
        group.create_dataset(f"state{i}", data=np.asarray(buf))


def _read_state(group) -> list:
    return [group[f"state{i}"][()] for i in range(int(group.attrs["count"]))]
