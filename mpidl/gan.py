# mpiexec -n 4 python -m mpidl.gan --data samson.h5 --strategy node --ranks-per-node 2
"""A conditional GAN that generates pixel spectra of a hyperspectral scene, data-parallel.

Built only on the public distributed API: the generator ``G`` and the discriminator ``D`` are
each a :class:`mpidl.distributed.DataParallel` over one topology, each with its own exchange of
the same strategy (:func:`mpidl.distributed.make_exchange`) and the equal split of the global
batch, and every rank runs the loop below on its slice of each global batch. No MPI call is
made here. ``--ranks-per-node`` (else ``MPIDL_RANKS_PER_NODE``, read by :mod:`mpidl.settings`)
emulates nodes.

Data. A pixel's spectrum is the centre pixel of a layout file's patch (``--data FILE.h5``,
e.g. Samson through ``python -m mpidl.data_tools hsi``), or of the built-in synthetic scene
(no ``--data``): ``x in R^C``, normalized per band with the file's training statistics, and
its class ``y in {0..K-1}``. Every rank holds all the (small) training spectra in memory.

Models (hand-written layers, float64 or float32)::

    G([z, onehot(y)]) : Linear(Z + K, H) - ReLU - Linear(H, H) - ReLU - Linear(H, C)
    D([x, onehot(y)]) : Linear(C + K, H) - LeakyReLU(0.2) - Linear(H, H) - LeakyReLU(0.2) - Linear(H, 1)

with ``z ~ N(0, I_Z)``. One step on a global batch ``{(x_n, y_n)}`` of ``B`` real spectra
(``BCE`` is :class:`mpidl.engine.nn.BCEWithLogits`, the mean over its elements)::

    D step:  L_D = BCE(D([x_real; G(z, y)], [y; y]), [1; 0])            (2 b_i rows on rank i)
    G step:  L_G = BCE(D(G(z', y), y), 1)                                (non-saturating loss)

``dL_G/dG`` is the first ``C`` columns of D's input gradient. Each rank's losses are the
means over its own rows, and ``DataParallel.step(b_i)`` weights them by ``b_i``: the reduced
gradient is the global batch's. The noise of global batch position ``n`` at step ``t`` is
drawn from a generator seeded by ``(seed, t)``, the same on every rank, so a run's numbers do
not depend on the number of ranks (``flat`` on P ranks equals one process up to rounding).

Quality, as numbers (rank 0, after a final sync; :func:`evaluate`):

* ``gen_accuracy_mlp``: accuracy with which a classifier trained on REAL training spectra
  (Linear(C, 64) - ReLU - Linear(64, K), Adam, seeded) assigns generated spectra to their
  conditioning class; ``gen_accuracy_ncm``: the same with the nearest real class mean.
  ``real_test_accuracy_*`` is each classifier's accuracy on real test spectra (the ceiling).
* ``sam_deg``: the spectral angle ``arccos(a.b / |a||b|)`` in degrees between the generated
  and the real (test) class-mean spectra in the file's original units, averaged over the
  classes; ``rmse``: their root-mean-square difference (original units) and ``rmse_z``
  (normalized units). ``sam_floor_deg`` is the same angle between the real train and test
  means: what sampling alone gives.

Output: a metrics JSON Lines file (``--metrics``: one ``start``, one ``epoch`` per epoch and
one ``end`` record with the numbers above) and a PNG of real vs generated mean spectra per
class (``--plot``; needs matplotlib, ``pip install 'mpidl[plot]'``; skipped with a note
otherwise).

Failures (:func:`main`) keep the trainer's promises with the trainer's means: the options,
the outputs (:func:`mpidl.app.outputs.check_output_file` on rank 0), the data file and its values
(:func:`mpidl.data.layout.check_trainable`, :func:`mpidl.data.layout.check_values`) are checked before
training and agreed by the ranks (one ``error:`` line, exit code 2); a metrics write that
fails during training stops every rank after that epoch, and a plot that cannot be written
is reported after the quality numbers are printed and recorded (one ``error:`` line naming
the user's path, exit code 1; the figure's temporary file is removed).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields

import numpy as np

__all__ = ["GanConfig", "GanConfigError", "Spectra", "ConditionalGAN", "load_spectra", "evaluate",
           "plot_spectra", "parse_config", "main"]

#: spectra read per HDF5 call when the centre pixels are extracted
READ_CHUNK = 512
#: real spectra every rank gets at least of a full global batch (the split's minimum)
MIN_LOCAL_BATCH = 1


class GanConfigError(ValueError):
    """A bad option of ``python -m mpidl.gan``, with a one-line message naming it."""


@dataclass
class GanConfig:
    """The options of ``python -m mpidl.gan`` (see :func:`build_parser` for their help)."""

    data: str | None = None
    epochs: int = 30
    batch_size: int = 64
    noise_dim: int = 16
    hidden: int = 128
    optimizer: str = "adam"
    lr: float = 1e-3
    beta1: float = 0.5
    seed: int = 0
    dtype: str = "float32"
    strategy: str = "flat"
    sync_every: int = 50
    sync_optimizer_state: bool = False
    ranks_per_node: int | None = None
    emulate_link: str | None = None
    eval_per_class: int = 256
    metrics: str | None = None
    plot: str | None = None
    quiet: bool = False

    def validate(self, world_size: int = 1) -> "GanConfig":
        """Check every value (no MPI call); raise :class:`GanConfigError` with a one-line message."""
        from mpidl import settings  # noqa: PLC0415
        from mpidl.distributed.build import STRATEGIES  # noqa: PLC0415
        from mpidl.distributed.emulation import parse_link  # noqa: PLC0415
        from mpidl.distributed.split import check_batch_fits  # noqa: PLC0415
        from mpidl.engine.optim import OPTIMIZERS  # noqa: PLC0415

        for name, allowed in (("--optimizer", OPTIMIZERS), ("--strategy", STRATEGIES),
                              ("--dtype", ("float32", "float64"))):
            value = getattr(self, name[2:].replace("-", "_"))
            if value not in allowed:
                raise GanConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        for name in ("epochs", "batch_size", "noise_dim", "hidden", "sync_every", "eval_per_class"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GanConfigError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.ranks_per_node is not None:
            if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) \
                    or self.ranks_per_node < 1:
                raise GanConfigError(f"--ranks-per-node must be an integer >= 1, got {self.ranks_per_node}")
        else:  # the environment's value, read once by mpidl.settings, refused here before any MPI
            try:
                settings.SETTINGS.ranks_per_node
            except ValueError as exc:
                raise GanConfigError(str(exc)) from None
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise GanConfigError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.beta1 < 1:
            raise GanConfigError(f"--beta1 must be in [0, 1), got {self.beta1}")
        try:  # the split's one rule (mpidl/distributed/split); the GAN's loop needs a sample per rank
            check_batch_fits(self.batch_size, MIN_LOCAL_BATCH, world_size)
        except ValueError as exc:
            raise GanConfigError(f"--batch-size: {exc}") from None
        if self.emulate_link is not None:
            try:
                parse_link(self.emulate_link)
            except ValueError as exc:
                raise GanConfigError(f"--emulate-link: {exc}") from None
        if self.data is not None and not os.path.isfile(self.data):
            raise GanConfigError(f"--data {self.data}: no such file (make one with python -m mpidl.data_tools hsi, "
                                 "see the README)")
        if self.plot is not None and not self.plot.lower().endswith(".png"):
            raise GanConfigError(f"--plot must name a .png file, got {self.plot!r}")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


def build_parser() -> argparse.ArgumentParser:
    """The options; a bad one raises :class:`mpidl.app.cli.UsageError` (a ValueError), so that the
    ranks report it once, like every other set-up error."""
    from mpidl.app.cli import Parser  # noqa: PLC0415

    d = GanConfig()
    p = Parser(
        prog="python -m mpidl.gan",
        description="Train a conditional GAN on the pixel spectra of a hyperspectral scene, the "
                    "generator and the discriminator each data-parallel (run under mpiexec -n N).",
    )
    p.add_argument("--data", default=None, metavar="FILE.h5",
                   help="layout file (python -m mpidl.data_tools hsi ...); default: the built-in synthetic scene")
    p.add_argument("--epochs", type=int, default=d.epochs, help=f"passes over the training spectra (default {d.epochs})")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"the GLOBAL batch of real spectra, split over the ranks (default {d.batch_size})")
    p.add_argument("--noise-dim", type=int, default=d.noise_dim, help=f"Z, the noise size (default {d.noise_dim})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"H, the hidden width of G and D (default {d.hidden})")
    p.add_argument("--optimizer", default=d.optimizer, help=f"for G and D, from mpidl.engine.optim.OPTIMIZERS (default {d.optimizer})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate of G and D (default {d.lr})")
    p.add_argument("--beta1", type=float, default=d.beta1,
                   help=f"betas[0] of the Adam-family optimizers, momentum of sgd (default {d.beta1})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"initial weights, batch order and noise (default {d.seed})")
    p.add_argument("--dtype", default=d.dtype, help=f"float32 or float64 (default {d.dtype})")
    p.add_argument("--strategy", default=d.strategy, help=f"flat, hierarchical or node (default {d.strategy})")
    p.add_argument("--sync-every", type=int, default=d.sync_every,
                   help=f"K', steps between the node strategy's parameter syncs (default {d.sync_every})")
    p.add_argument("--sync-optimizer-state", action="store_true",
                   help="node strategy: average the optimizer state too at each sync (default off)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="emulated nodes of K consecutive ranks (default: real nodes; env MPIDL_RANKS_PER_NODE)")
    p.add_argument("--emulate-link", default=None, metavar="LATENCY_US,GBIT_S",
                   help="EMULATION: add the alpha-beta time of each inter-node collective (default none)")
    p.add_argument("--eval-per-class", type=int, default=d.eval_per_class,
                   help=f"generated spectra per class for the quality numbers (default {d.eval_per_class})")
    p.add_argument("--metrics", default=None, metavar="PATH", help="JSON Lines metrics file (default none)")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="real vs generated mean spectra per class (needs matplotlib; default none)")
    p.add_argument("--quiet", action="store_true", help="print only errors and the final summary (default off)")
    return p


def parse_config(argv=None, world_size: int = 1, rank: int = 0) -> GanConfig:
    """Parse and validate a command line (``--help`` printed by rank 0 only); every error
    raises a ValueError with a one-line message."""
    from mpidl.app.cli import parse_args  # noqa: PLC0415

    ns = parse_args(build_parser(), argv, rank)
    names = {f.name for f in fields(GanConfig)}
    return GanConfig(**{k: v for k, v in vars(ns).items() if k in names}).validate(world_size)


def check_outputs(cfg: GanConfig, rank: int) -> list[str]:
    """On rank 0, which writes them: ``--metrics`` and ``--plot`` can be written in their
    (existing) folders, as the writers will write them (raises
    :class:`mpidl.app.outputs.OutputError`); returns the stale temporaries removed."""
    from mpidl.app.outputs import check_output_file  # noqa: PLC0415

    removed = []
    if rank == 0:
        for option, path in (("--metrics", cfg.metrics), ("--plot", cfg.plot)):
            if path is not None:
                removed += check_output_file(option, path, create_folder=False)
    return removed


# ---------------------------------------------------------------------------- data
@dataclass
class Spectra:
    """Centre-pixel spectra: ``train_x`` (N, C) / ``test_x`` (M, C) normalized, float64 on
    the host; ``train_y`` / ``test_y`` int64; ``mean``, ``std`` (C,) the normalization, so
    ``x * std + mean`` is in the file's units."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    class_names: list
    description: str

    @property
    def bands(self) -> int:
        return int(self.train_x.shape[1])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


def _centres(dataset) -> tuple[np.ndarray, np.ndarray]:
    n = dataset.num_samples
    xs, ys = [], []
    for lo in range(0, n, READ_CHUNK):
        x, y = dataset.read(np.arange(lo, min(n, lo + READ_CHUNK)))
        h, w = x.shape[2] // 2, x.shape[3] // 2
        xs.append(np.asarray(x[:, :, h, w], dtype=np.float64))
        ys.append(np.asarray(y, dtype=np.int64))
    return np.concatenate(xs), np.concatenate(ys)


def load_spectra(path: str | None, seed: int = 0) -> Spectra:
    """The centre-pixel spectra of a layout file, or of the built-in synthetic scene (patch 1).
    A file must be one the trainer takes (:func:`mpidl.data.layout.check_trainable`: the quality
    numbers need test spectra); its values are checked by the command line
    (:func:`mpidl.data.layout.check_values`, over the ranks)."""
    from mpidl import data  # noqa: PLC0415
    from mpidl.data.layout import LayoutError, check_trainable  # noqa: PLC0415

    if path is None:
        train, test, meta = data.synthetic_splits(seed=seed, patch=1)
        desc = f"built-in synthetic scene ({meta['source']})"
    else:
        train, test, meta = data.load_splits(path)
        desc = meta["description"]
        try:
            check_trainable(meta)
        except LayoutError as exc:
            raise ValueError(f"--data {path}: {exc.problem}") from None
    train_x, train_y = _centres(train)
    test_x, test_y = _centres(test)
    for dataset in (train, test):
        if hasattr(dataset, "close"):
            dataset.close()
    return Spectra(train_x, train_y, test_x, test_y, np.asarray(meta["mean"], np.float64),
                   np.asarray(meta["std"], np.float64), list(meta["class_names"]), desc)


# ---------------------------------------------------------------------------- models
def _mlp(sizes, activation, backend, seed):
    """``Linear - act - ... - Linear`` over ``sizes`` and its flat parameters."""
    from mpidl.engine.nn import Linear, Sequential  # noqa: PLC0415
    from mpidl.engine.params import FlatParameters  # noqa: PLC0415

    layers = []
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(Linear(a, b))
        if k < len(sizes) - 2:
            layers.append(activation())
    net = Sequential(*layers)
    params = FlatParameters(net.named_parameters(), backend, seed)
    net.to(backend)
    return net, params


def one_hot(labels: np.ndarray, classes: int, dtype) -> np.ndarray:
    out = np.zeros((len(labels), classes), dtype=dtype)
    out[np.arange(len(labels)), labels] = 1
    return out


class ConditionalGAN:
    """G and D, their optimizers and their :class:`DataParallel` objects over one topology,
    each with its own exchange (``cfg.strategy``) and the equal split of ``cfg.batch_size``.

    Parameters
    ----------
    spectra : Spectra
    cfg : GanConfig (validated)
    topology : mpidl.distributed.Topology (collective construction, like DataParallel's)
    """

    def __init__(self, spectra: Spectra, cfg: GanConfig, topology):
        from mpidl.engine.backend import get_backend  # noqa: PLC0415
        from mpidl.distributed import DataParallel, FixedSplit, make_exchange  # noqa: PLC0415
        from mpidl.engine.nn import BCEWithLogits, LeakyReLU, ReLU  # noqa: PLC0415
        from mpidl.engine.optim import build_optimizer  # noqa: PLC0415

        self.cfg, self.spectra = cfg, spectra
        self.backend = get_backend("cpu", cfg.dtype)
        c, k, z, h = spectra.bands, spectra.num_classes, cfg.noise_dim, cfg.hidden
        self.G, self.g_params = _mlp([z + k, h, h, c], ReLU, self.backend, cfg.seed)
        self.D, self.d_params = _mlp([c + k, h, h, 1], lambda: LeakyReLU(0.2), self.backend, cfg.seed + 1)
        self.loss = BCEWithLogits()

        def optimizer(params):
            extra = ({"momentum": cfg.beta1} if cfg.optimizer == "sgd"
                     else {"betas": (cfg.beta1, 0.999)})
            return build_optimizer(cfg.optimizer, params, lr=cfg.lr, **extra)

        def data_parallel(params):
            exchange = make_exchange(topology, cfg.strategy, sync_every=cfg.sync_every,
                                     sync_optimizer_state=cfg.sync_optimizer_state, emulate_link=cfg.emulate_link)
            split = FixedSplit(cfg.batch_size, topology.size, min_local_batch=MIN_LOCAL_BATCH)
            return DataParallel(params, optimizer(params), batch_size=cfg.batch_size, exchange=exchange, split=split)

        self.dp_g = data_parallel(self.g_params)
        self.dp_d = data_parallel(self.d_params)
        self.x = spectra.train_x.astype(self.backend.dtype)
        self.y = spectra.train_y
        self.steps = 0

    # -- one step ---------------------------------------------------------------------
    def _slice(self, dp, batch):
        """This rank's indices of the global batch and their positions ``lo:hi`` in it."""
        local = dp.local_indices(batch)
        lo = sum(dp.split.counts(len(batch))[: dp.rank])
        return local, lo, lo + len(local)

    def noise(self, step: int, stream: int, n: int) -> np.ndarray:
        """(n, Z) noise of a global batch of n at ``step`` (the same on every rank)."""
        rng = np.random.default_rng([self.cfg.seed, step, stream])
        return rng.standard_normal((n, self.cfg.noise_dim)).astype(self.backend.dtype)

    def generate(self, z: np.ndarray, labels: np.ndarray) -> np.ndarray:
        k = self.spectra.num_classes
        return self.G.forward(np.concatenate([z, one_hot(labels, k, z.dtype)], axis=1))

    def step(self, batch: np.ndarray) -> tuple[float, float, int]:
        """One D step and one G step on the global batch; returns this rank's local mean
        losses ``(L_D, L_G)`` and its sample count."""
        k, c, n = self.spectra.num_classes, self.spectra.bands, len(batch)
        dtype = self.backend.dtype
        t = self.steps
        # D: real rows (target 1) and fake rows (target 0) in one pass.
        local, lo, hi = self._slice(self.dp_d, batch)
        b = len(local)
        d_loss = 0.0
        if b:
            y = self.y[local]
            fake = self.generate(self.noise(t, 0, n)[lo:hi], y)
            onehot = one_hot(y, k, dtype)
            rows = np.concatenate([np.concatenate([self.x[local], onehot], axis=1),
                                   np.concatenate([fake, onehot], axis=1)])
            target = np.concatenate([np.ones((b, 1), dtype), np.zeros((b, 1), dtype)])
            d_loss = self.loss.forward(self.D.forward(rows), target)
            self.D.backward(self.loss.backward())
        else:
            self.d_params.grad.fill(0)
        self.dp_d.step(b)
        # G: through the (updated) D, non-saturating target 1; D's gradient is overwritten
        # here and again by the next D step, never applied.
        local, lo, hi = self._slice(self.dp_g, batch)
        b = len(local)
        g_loss = 0.0
        if b:
            y = self.y[local]
            z = self.noise(t, 1, n)[lo:hi]
            fake = self.generate(z, y)
            rows = np.concatenate([fake, one_hot(y, k, dtype)], axis=1)
            g_loss = self.loss.forward(self.D.forward(rows), np.ones((b, 1), dtype))
            d_rows = self.D.backward(self.loss.backward())
            self.G.backward(np.ascontiguousarray(d_rows[:, :c]))
        else:
            self.g_params.grad.fill(0)
        self.dp_g.step(b)
        self.steps += 1
        return d_loss, g_loss, b

    def train_epoch(self, epoch: int) -> dict:
        """One pass in a seeded order (the same on every rank): the global mean losses and
        ``comm``, rank 0's collectives of the epoch per model and level
        (``{"g"|"d": {"intra"|"inter"|"world"|"control": {"calls", "bytes"}}}``)."""
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.y))
        sums = np.zeros(3)
        self.dp_g.reset_counters()
        self.dp_d.reset_counters()
        for start in range(0, len(order), self.cfg.batch_size):
            d_loss, g_loss, b = self.step(order[start:start + self.cfg.batch_size])
            sums += (d_loss * b, g_loss * b, b)
        total = self.dp_d.sum(sums)
        comm = {name: {level: dict(c) for level, c in dp.counters.items()}
                for name, dp in (("g", self.dp_g), ("d", self.dp_d))}
        return {"d_loss": float(total[0] / total[2]), "g_loss": float(total[1] / total[2]), "comm": comm}

    def sync(self) -> None:
        """Every replica of G and D identical (the node strategy's average)."""
        self.dp_g.sync()
        self.dp_d.sync()


# ---------------------------------------------------------------------------- quality
def _train_classifier(spectra: Spectra, seed: int, epochs: int = 40, hidden: int = 64):
    """Linear(C, 64) - ReLU - Linear(64, K) trained on the real training spectra (one process)."""
    from mpidl.engine.backend import get_backend  # noqa: PLC0415
    from mpidl.engine.nn import ReLU, SoftmaxCrossEntropy  # noqa: PLC0415
    from mpidl.engine.optim import Adam  # noqa: PLC0415

    net, params = _mlp([spectra.bands, hidden, spectra.num_classes], ReLU, get_backend("cpu", "float64"), seed)
    opt, loss = Adam(params, lr=3e-3), SoftmaxCrossEntropy()
    x, y = spectra.train_x, spectra.train_y
    for epoch in range(epochs):
        order = np.random.default_rng([seed, 7, epoch]).permutation(len(y))
        for start in range(0, len(y), 64):
            idx = order[start:start + 64]
            loss.forward(net.forward(x[idx]), y[idx])
            net.backward(loss.backward())
            opt.step()
    return net


def _angle_deg(a: np.ndarray, b: np.ndarray) -> float:
    cos = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))
    return math.degrees(math.acos(min(1.0, max(-1.0, cos))))


def evaluate(gan: ConditionalGAN, per_class: int, seed: int) -> dict:
    """The quality numbers of the module docstring (no MPI; run on one rank after a sync)."""
    s = gan.spectra
    k = s.num_classes
    labels = np.repeat(np.arange(k), per_class)
    z = np.random.default_rng([seed, 1 << 20]).standard_normal((len(labels), gan.cfg.noise_dim))
    generated = np.asarray(gan.generate(z.astype(gan.backend.dtype), labels), dtype=np.float64)

    classifier = _train_classifier(s, seed)
    pred_gen = classifier.forward(generated).argmax(axis=1)
    pred_test = classifier.forward(s.test_x).argmax(axis=1)
    means_train = np.stack([s.train_x[s.train_y == c].mean(axis=0) for c in range(k)])

    def ncm(x):
        return ((x[:, None, :] - means_train[None]) ** 2).sum(axis=2).argmin(axis=1)

    real_means = np.stack([s.test_x[s.test_y == c].mean(axis=0) for c in range(k)])
    gen_means = np.stack([generated[labels == c].mean(axis=0) for c in range(k)])
    units = lambda m: m * s.std + s.mean  # noqa: E731
    sam = [_angle_deg(units(gen_means[c]), units(real_means[c])) for c in range(k)]
    floor = [_angle_deg(units(means_train[c]), units(real_means[c])) for c in range(k)]
    rmse = [float(np.sqrt(np.mean((units(gen_means[c]) - units(real_means[c])) ** 2))) for c in range(k)]
    rmse_z = [float(np.sqrt(np.mean((gen_means[c] - real_means[c]) ** 2))) for c in range(k)]
    per_class_acc = [float((pred_gen[labels == c] == c).mean()) for c in range(k)]
    return {
        "gen_accuracy_mlp": float((pred_gen == labels).mean()),
        "gen_accuracy_ncm": float((ncm(generated) == labels).mean()),
        "real_test_accuracy_mlp": float((pred_test == s.test_y).mean()),
        "real_test_accuracy_ncm": float((ncm(s.test_x) == s.test_y).mean()),
        "sam_deg": float(np.mean(sam)), "sam_floor_deg": float(np.mean(floor)),
        "rmse": float(np.mean(rmse)), "rmse_z": float(np.mean(rmse_z)),
        "per_class": {"gen_accuracy_mlp": per_class_acc, "sam_deg": sam, "rmse": rmse},
        "eval_per_class": per_class,
        "_curves": {"real_mean": units(real_means), "real_std": np.stack(
            [s.test_x[s.test_y == c].std(axis=0) * s.std for c in range(k)]),
            "gen_mean": units(gen_means), "gen_std": np.stack(
            [generated[labels == c].std(axis=0) * s.std for c in range(k)])},
    }


def plot_spectra(quality: dict, class_names, path: str, title: str) -> str | None:
    """Real (test) vs generated mean spectra +- one std, one panel per class; returns a note
    instead of writing when matplotlib is missing. Written atomically."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError:
        return "matplotlib is not installed (pip install 'mpidl[plot]'): no plot written"
    curves = quality["_curves"]
    k = len(class_names)
    cols = min(k, 4)
    rows = -(-k // cols)
    fig = Figure(figsize=(3.6 * cols, 2.8 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    bands = np.arange(curves["real_mean"].shape[1])
    for c in range(k):
        ax = fig.add_subplot(rows, cols, c + 1)
        for key, colour, label in (("real", "tab:blue", "real (test)"), ("gen", "tab:orange", "generated")):
            mean, std = curves[f"{key}_mean"][c], curves[f"{key}_std"][c]
            ax.plot(bands, mean, color=colour, label=label, linewidth=1.2)
            ax.fill_between(bands, mean - std, mean + std, color=colour, alpha=0.2, linewidth=0)
        pc = quality["per_class"]
        ax.set_title(f"{class_names[c]}: SAM {pc['sam_deg'][c]:.2f} deg, acc {100 * pc['gen_accuracy_mlp'][c]:.0f}%",
                     fontsize="small")
        ax.set_xlabel("band")
        ax.grid(alpha=0.3)
        if c == 0:
            ax.legend(fontsize="x-small")
    fig.suptitle(title, fontsize="medium")
    from mpidl.app.outputs import atomic_file  # noqa: PLC0415

    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return None


# ---------------------------------------------------------------------------- command line
def main(argv=None) -> int:
    """The command line. Set-up (options, outputs, data and its values) is checked before any
    training and agreed by the ranks: rank 0 prints ``error: ...`` once and every rank exits
    with code 2. A metrics write that fails during training (a full disk) is agreed after the
    epoch: every rank stops, rank 0 prints ``error: cannot write PATH: cause``, exit code 1;
    so does a plot that cannot be written at the end (the end record is still written)."""
    from mpidl.app.cli import start_process  # noqa: PLC0415

    start_process()  # before MPI starts: OMPI_MCA_osc, the thread policy
    from mpidl.distributed import Topology  # noqa: PLC0415
    from mpidl.distributed.launch import (abort_on_uncaught_exception, agree_on_error,  # noqa: PLC0415
                                          allgather, world)
    from mpidl.data.layout import check_values  # noqa: PLC0415
    from mpidl.app.log import MetricsWriter, Printer  # noqa: PLC0415

    rank, size = world()
    sys.excepthook = abort_on_uncaught_exception
    error, spectra, cfg, removed = None, None, None, []
    try:
        cfg = parse_config(argv, world_size=size, rank=rank)
        removed = check_outputs(cfg, rank)
        spectra = load_spectra(cfg.data, seed=cfg.seed)
    except (ValueError, OSError, KeyError) as exc:
        error = f"{exc}"
    error = agree_on_error(error)
    if error is None and cfg.data is not None:
        error = check_values(cfg.data, rank, size, allgather)  # the trainer's scan, shared
    if error is not None:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2

    printer = Printer(rank, "info", cfg.quiet)
    if removed:
        printer.info(f"removed {len(removed)} temporary file(s) left by an interrupted write: "
                     f"{', '.join(removed)}")
    topology = Topology.from_comm(ranks_per_node=cfg.ranks_per_node)
    gan = ConditionalGAN(spectra, cfg, topology)
    metrics = None

    def write_metrics(record: dict) -> str | None:
        """Rank 0 writes; collective: the agreed write error (None when it worked)."""
        nonlocal metrics
        problem = None
        try:
            if metrics is None:
                metrics = MetricsWriter(cfg.metrics, rank)
            metrics.write(record)
        except OSError as exc:
            problem = str(exc)
        return agree_on_error(problem)

    def stop(problem: str, epochs_done: int) -> int:
        if rank == 0:
            when = (f"after epoch {epochs_done} (the file holds the records before it)" if epochs_done
                    else "before the first epoch")
            print(f"error: {problem}; training stopped {when}", file=sys.stderr, flush=True)
        return 1

    printer.info(f"mpidl.gan: {gan.dp_g.exchange.describe()} (G and D each); {topology.describe()}")
    printer.info(f"data: {spectra.description}: {len(spectra.train_y)} train / {len(spectra.test_y)} test "
                 f"spectra of {spectra.bands} bands, {spectra.num_classes} classes")
    printer.info(f"G {gan.g_params.size} / D {gan.d_params.size} parameters ({cfg.dtype}); "
                 f"{cfg.optimizer} lr {cfg.lr}; global batch {cfg.batch_size}")
    if cfg.emulate_link:
        printer.info(f"EMULATION: inter-node link {cfg.emulate_link} (latency us, Gbit/s)")
    problem = write_metrics({"event": "start", "config": cfg.to_dict(), "world_size": topology.size,
                             "num_nodes": topology.num_nodes, "node_sizes": list(topology.node_sizes),
                             "data": spectra.description, "g_params": int(gan.g_params.size),
                             "d_params": int(gan.d_params.size)})
    if problem is not None:
        return stop(problem, 0)
    started = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        t0 = time.perf_counter()
        record = gan.train_epoch(epoch)
        record.update(event="epoch", epoch=epoch, step=gan.steps, time_s=time.perf_counter() - t0)
        problem = write_metrics(record)
        if problem is not None:
            return stop(problem, epoch)
        printer.info(f"epoch {epoch}: D loss {record['d_loss']:.4f}, G loss {record['g_loss']:.4f}, "
                     f"{record['time_s']:.2f} s")
    gan.sync()
    train_s = time.perf_counter() - started
    if rank != 0:
        return 0
    # Only rank 0 is left: a failed write is reported here, no other rank waits for it.
    failures = []
    quality = evaluate(gan, cfg.eval_per_class, cfg.seed)
    note = None
    if cfg.plot:
        try:
            note = plot_spectra(quality, spectra.class_names, cfg.plot,
                                f"conditional GAN, {cfg.strategy}, {size} rank(s): real vs generated")
        except OSError as exc:  # names --plot's path; its temporary is removed
            failures.append(str(exc))
            note = f"not written: {exc}"
        else:
            if note:
                printer.summary(f"note: {note}")
    end = {k: v for k, v in quality.items() if not k.startswith("_")}
    end.update(event="end", step=gan.steps, time_s=train_s, epoch_time_s=train_s / cfg.epochs,
               plot=None if note or not cfg.plot else cfg.plot, plot_note=note)
    try:
        if metrics is not None:
            metrics.write(end)
            metrics.close()
    except OSError as exc:
        failures.append(str(exc))
    printer.summary(
        f"done: {gan.steps} steps in {train_s:.1f} s; generated spectra classified as their class: "
        f"{100 * end['gen_accuracy_mlp']:.2f}% (MLP; real test {100 * end['real_test_accuracy_mlp']:.2f}%), "
        f"{100 * end['gen_accuracy_ncm']:.2f}% (nearest mean); class-mean spectral angle "
        f"{end['sam_deg']:.3f} deg (real train-test {end['sam_floor_deg']:.3f}), RMSE {end['rmse']:.4g}")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr, flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
