"""Atomic HDF5 checkpoints and saved models.

A checkpoint is written to a temporary file in the target folder, flushed, ``fsync``-ed and
then renamed over the old one with :func:`os.replace`, which is atomic on POSIX file systems:
a job killed mid-write leaves the previous checkpoint intact and readable, never half a file
(at worst a stray ``.checkpoint.h5.*.tmp`` when the process is killed with SIGKILL; an
exception removes it).

Files in a checkpoint folder ``DIR``:

``DIR/checkpoint.h5`` (written by world rank 0)
    ``params`` (the flat parameter buffer of the consensus model), ``buffers/<name>`` (batch-norm
    running statistics, averaged over the replicas), ``rank_buffers/<r>/<name>`` (each rank's
    own batch-norm buffers, in a checkpoint taken inside an epoch, where they are not yet
    averaged; restored when the world size is the same), ``optimizer/state<i>`` (the optimizer's
    flat state buffers, when they are the same on every replica), and JSON attributes
    ``epoch`` (completed epochs), ``step_in_epoch`` (steps done in epoch ``epoch``; 0 at an
    epoch boundary), ``global_step``, ``optimizer_step``, ``batch_sizes``, ``speeds``,
    ``config``, ``model``, ``build_args``, ``world_size``, ``num_nodes``, ``node_samples``,
    ``num_train_samples``, ``node_state`` and ``node_params`` (whether per-node files belong
    to it), ``format_version``.
``DIR/optimizer-node<k>-step<S>.h5`` (written by the leader of node ``k``)
    Only with ``--strategy node`` on more than one node. Between inter-node syncs each node's
    optimizer state (momentum, Adam moments) is its own, so each node's leader writes it
    (``optimizer/state<i>``); with ``--sync-optimizer-state`` it is averaged at epoch ends,
    and a checkpoint taken there keeps it in ``checkpoint.h5`` instead. A checkpoint taken
    between two parameter syncs (``--max-steps``) also holds the node's parameters
    (``params``), so that the resumed run continues exactly.

Consistency rule: the leaders write their node files *first* (a barrier), then rank 0 renames
the new ``checkpoint.h5`` into place (a barrier), then each leader removes its node's files of
other steps. At every instant ``checkpoint.h5`` names a step ``S`` whose node files all exist.

Data order needs no saved random state: the permutation of epoch ``e`` is a pure function of
``(seed, e)``, so resuming at ``(epoch, step_in_epoch)`` replays exactly the same batches.
(Not restored: the generator of a ``Dropout`` layer, which restarts from its seed.)
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager

import h5py
import numpy as np

CHECKPOINT_NAME = "checkpoint.h5"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says which file and why."""


def node_optimizer_name(node_id: int, global_step: int) -> str:
    return f"optimizer-node{node_id}-step{global_step}.h5"


def remove_stale_node_files(folder: str, node_id: int, keep_step: int | None) -> None:
    """Delete this node's files of steps other than ``keep_step`` (all of them when None)."""
    prefix = f"optimizer-node{node_id}-step"
    keep = None if keep_step is None else node_optimizer_name(node_id, keep_step)
    for name in os.listdir(folder):
        if name.startswith(prefix) and name.endswith(".h5") and name != keep:
            os.remove(os.path.join(folder, name))


@contextmanager
def atomic_h5(path: str):
    """Yield an ``h5py.File`` open for writing at a temporary name beside ``path``; on success
    flush, fsync and rename it to ``path``; on any error remove the temporary file."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            yield f
            f.flush()
        with open(tmp, "rb+") as raw:  # h5py has no fsync; do it on the closed file
            os.fsync(raw.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # make the rename itself durable
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_model(path: str, model) -> None:
    """Write the final model: one dataset per parameter, named by its registered name, the
    batch-norm buffers under ``buffers/``, and the model name and build arguments as attributes
    (enough for :func:`load_model` to rebuild it)."""
    with atomic_h5(path) as f:
        for p in model.params:
            f.create_dataset(p.name, data=np.asarray(model.backend.to_host(p.data)))
        for name, value in model.buffers_host().items():
            f.create_dataset("buffers/" + name, data=value)
        f.attrs["model"] = model.name
        f.attrs["build_args"] = json.dumps(model.build_args)
        f.attrs["param_order"] = json.dumps([p.name for p in model.params])


def load_model(path: str, backend=None):
    """Rebuild a model written by :func:`save_model`."""
    from mpidl.models import build_model  # noqa: PLC0415 - keep checkpoint import-light

    with h5py.File(path, "r") as f:
        args = json.loads(f.attrs["build_args"])
        model = build_model(backend=backend, **args)
        model.params.load_host({p.name: f[p.name][()] for p in model.params})
        if "buffers" in f:
            model.load_buffers_host({k: f["buffers"][k][()] for k in f["buffers"]})
    return model


def write_checkpoint(folder: str, *, params, buffers: dict, optimizer_state: list | None,
                     meta: dict, rank_buffers: list | None = None) -> str:
    """Rank 0: write ``folder/checkpoint.h5`` atomically.

    ``params`` : (P,) host array, the consensus parameters; ``buffers`` : name -> host array;
    ``optimizer_state`` : the optimizer's flat state buffers (host arrays, each (P,)), or None
    when they are per node; ``meta`` : JSON-serializable attributes; ``rank_buffers`` : one
    buffer dict per rank (inside an epoch) or None.
    """
    path = os.path.join(folder, CHECKPOINT_NAME)
    with atomic_h5(path) as f:
        f.create_dataset("params", data=np.asarray(params))
        for name, value in buffers.items():
            f.create_dataset("buffers/" + name, data=np.asarray(value))
        for rank, rank_dict in enumerate(rank_buffers or []):
            for name, value in rank_dict.items():
                f.create_dataset(f"rank_buffers/{rank}/{name}", data=np.asarray(value))
        if optimizer_state is not None:
            _write_state(f, optimizer_state)
        for key, value in meta.items():
            f.attrs[key] = json.dumps(value)
    return path


def write_node_file(folder: str, node_id: int, *, optimizer_state: list | None, params, meta: dict) -> str:
    """A node leader: write that node's optimizer state and/or parameters atomically
    (``meta`` holds ``global_step``, which names the file)."""
    path = os.path.join(folder, node_optimizer_name(node_id, meta["global_step"]))
    with atomic_h5(path) as f:
        if optimizer_state is not None:
            _write_state(f, optimizer_state)
        if params is not None:
            f.create_dataset("params", data=np.asarray(params))
        for key, value in meta.items():
            f.attrs[key] = json.dumps(value)
    return path


def write_node_optimizer(folder: str, node_id: int, optimizer_state: list, meta: dict) -> str:
    """A node leader: write that node's optimizer state atomically (see :func:`write_node_file`)."""
    return write_node_file(folder, node_id, optimizer_state=optimizer_state, params=None, meta=meta)


def _write_state(f, state: list) -> None:
    g = f.create_group("optimizer")
    g.attrs["count"] = len(state)
    for i, buf in enumerate(state):
        g.create_dataset(f"state{i}", data=np.asarray(buf))


def _read_state(f) -> list:
    g = f["optimizer"]
    return [g[f"state{i}"][()] for i in range(int(g.attrs["count"]))]


def _read_rank_buffers(f) -> list | None:
    if "rank_buffers" not in f:
        return None
    g = f["rank_buffers"]
    return [{k: g[str(r)][k][()] for k in g[str(r)]} for r in range(len(g))]


def read_checkpoint_meta(folder: str) -> dict:
    """The attributes of ``folder/checkpoint.h5`` (cheap: no arrays are read)."""
    path = os.path.join(folder, CHECKPOINT_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume: no checkpoint at {path}")
    try:
        with h5py.File(path, "r") as f:
            return _meta(f)
    except (OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"--resume: {path} is not a readable mpidl checkpoint ({exc})") from None


def _meta(f) -> dict:
    meta = {k: json.loads(v) for k, v in f.attrs.items()}
    missing = [k for k in ("epoch", "step_in_epoch", "global_step", "optimizer_step", "build_args")
               if k not in meta]
    if missing:
        raise KeyError(f"attributes {missing} missing")
    return meta


def read_checkpoint(folder: str, node_id: int | None = None) -> dict:
    """Read ``folder/checkpoint.h5`` and, when it has per-node files, node ``node_id``'s.

    Returns ``{"params", "buffers", "rank_buffers" (list of dicts, or None), "optimizer_state"
    (list), "meta"}``: the parameters are the
    node's own when its file holds them (a checkpoint between two inter-node syncs), else the
    consensus. Raises :class:`CheckpointError` for a missing or unreadable file, or a
    checkpoint with per-node state read without ``node_id``.
    """
    path = os.path.join(folder, CHECKPOINT_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume: no checkpoint at {path}")
    try:
        with h5py.File(path, "r") as f:
            meta = _meta(f)
            out = {
                "params": f["params"][()],
                "buffers": {k: f["buffers"][k][()] for k in f["buffers"]} if "buffers" in f else {},
                "rank_buffers": _read_rank_buffers(f),
                "optimizer_state": _read_state(f) if "optimizer" in f else None,
                "meta": meta,
            }
    except (OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"--resume: {path} is not a readable mpidl checkpoint ({exc})") from None
    if meta.get("node_state") or meta.get("node_params"):
        nodes = meta.get("num_nodes")
        if node_id is None:
            raise CheckpointError(
                f"--resume: {path} holds per-node state of {nodes} nodes (--strategy node); "
                f"resume it with --strategy node on {nodes} nodes"
            )
        node_path = os.path.join(folder, node_optimizer_name(node_id, meta["global_step"]))
        if not os.path.isfile(node_path):
            raise CheckpointError(f"--resume: missing per-node state {node_path}")
        try:
            with h5py.File(node_path, "r") as f:
                if meta.get("node_state"):
                    out["optimizer_state"] = _read_state(f)
                if meta.get("node_params"):
                    out["params"] = f["params"][()]
        except (OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"--resume: {node_path} is not readable ({exc})") from None
    if out["optimizer_state"] is None:
        raise CheckpointError(f"--resume: {path} holds no optimizer state")
    return out
