"""Atomic HDF5 checkpoints and saved models.

A checkpoint is written to a temporary file in the target folder, flushed, ``fsync``-ed and
then renamed over the old one with :func:`os.replace`, which is atomic on POSIX file systems:
a job killed mid-write leaves the previous checkpoint intact and readable, never half a file.

Files in a checkpoint folder ``DIR``:

``DIR/checkpoint.h5`` (written by world rank 0)
    ``params`` (the flat parameter buffer of the consensus model), ``buffers/<name>`` (batch-norm
    running statistics), ``optimizer/state<i>`` (the optimizer's flat state buffers, when they
    are global), attributes ``epoch`` (completed epochs), ``step_in_epoch``, ``global_step``,
    ``optimizer_step``, ``batch_sizes``, ``speeds``, ``config`` (JSON), ``model`` and
    ``build_args`` (JSON), ``world_size``.
``DIR/optimizer-node<k>-step<S>.h5`` (written by the leader of node ``k``)
    Only with ``--strategy node`` without ``--sync-optimizer-state``: each node's optimizer
    state is its own, so each node's leader writes it. The leaders write theirs *first*, then
    rank 0 renames the new ``checkpoint.h5`` into place, then older node files are removed:
    at every instant ``checkpoint.h5`` names a step ``S`` whose node files all exist.

Data order needs no saved random state: the permutation of epoch ``e`` is a pure function of
``(seed, e)``, so resuming at ``(epoch, step_in_epoch)`` replays exactly the same batches.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager

import h5py
import numpy as np

CHECKPOINT_NAME = "checkpoint.h5"


def node_optimizer_name(node_id: int, global_step: int) -> str:
    return f"optimizer-node{node_id}-step{global_step}.h5"


def remove_stale_node_files(folder: str, node_id: int, keep_step: int) -> None:
    """Delete this node's optimizer files of steps other than ``keep_step``."""
    prefix = f"optimizer-node{node_id}-step"
    for name in os.listdir(folder):
        if name.startswith(prefix) and name.endswith(".h5") and name != node_optimizer_name(node_id, keep_step):
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


def write_checkpoint(folder: str, *, model, optimizer_state: list | None, meta: dict) -> str:
    """Rank 0: write ``folder/checkpoint.h5`` atomically. ``optimizer_state`` is the list of
    the optimizer's flat state buffers (host arrays), or None when they are per node."""
    path = os.path.join(folder, CHECKPOINT_NAME)
    with atomic_h5(path) as f:
        f.create_dataset("params", data=np.asarray(model.backend.to_host(model.params.data)))
        for name, value in model.buffers_host().items():
            f.create_dataset("buffers/" + name, data=value)
        if optimizer_state is not None:
            _write_state(f, optimizer_state)
        for key, value in meta.items():
            f.attrs[key] = json.dumps(value)
    return path


def write_node_optimizer(folder: str, node_id: int, optimizer_state: list, meta: dict) -> str:
    """A node leader: write that node's optimizer state atomically (``meta`` holds ``global_step``)."""
    path = os.path.join(folder, node_optimizer_name(node_id, meta["global_step"]))
    with atomic_h5(path) as f:
        _write_state(f, optimizer_state)
        for key, value in meta.items():
            f.attrs[key] = json.dumps(value)
    return path


def _write_state(f, state: list) -> None:
    g = f.create_group("optimizer")
    g.attrs["count"] = len(state)
    for i, buf in enumerate(state):
        g.create_dataset(f"state{i}", data=np.asarray(buf))


def _read_state(f) -> list:
    g = f["optimizer"]
    return [g[f"state{i}"][()] for i in range(int(g.attrs["count"]))]


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says which file and why."""


def read_checkpoint(folder: str, node_id: int | None = None) -> dict:
    """Read ``folder/checkpoint.h5`` (and, with ``node_id``, that node's optimizer file).

    Returns ``{"params", "buffers", "optimizer_state" (list or None), "meta"}``.
    """
    path = os.path.join(folder, CHECKPOINT_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"--resume: no checkpoint at {path}")
    try:
        with h5py.File(path, "r") as f:
            meta = {k: json.loads(v) for k, v in f.attrs.items()}
            out = {
                "params": f["params"][()],
                "buffers": {k: f["buffers"][k][()] for k in f["buffers"]} if "buffers" in f else {},
                "optimizer_state": _read_state(f) if "optimizer" in f else None,
                "meta": meta,
            }
    except (OSError, KeyError) as exc:
        raise CheckpointError(f"--resume: {path} is not a readable mpidl checkpoint ({exc})") from None
    if out["optimizer_state"] is None and node_id is not None:
        node_path = os.path.join(folder, node_optimizer_name(node_id, meta["global_step"]))
        if not os.path.isfile(node_path):
            raise CheckpointError(f"--resume: missing per-node optimizer state {node_path}")
        with h5py.File(node_path, "r") as f:
            out["optimizer_state"] = _read_state(f)
    return out
