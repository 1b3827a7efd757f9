"""The run configuration: one validated dataclass built from the command line.

Every bad value is refused here, with a message that names the option, *before* any MPI
collective: every rank parses the same arguments and validates them the same way, so every
rank raises the same :class:`ConfigError` and nobody is left waiting in a collective.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field, fields

from mpidl import settings
from mpidl.engine.backend import DEVICES, DTYPES
from mpidl.distributed.build import BUCKET_MB, ON_FAILURE, OptionError, check_options
from mpidl.distributed.watchdog import parse_failure_timeout
from mpidl.distributed.data_parallel import ON_NAN
from mpidl.distributed.emulation import EMULATION_CLOCKS, parse_link, parse_slowdowns
from mpidl.distributed.extras.compress import COMPRESSIONS
from mpidl.distributed.split import check_batch_fits
from mpidl.distributed.split.balance import parse_speeds
from mpidl.app.log import LEVELS
from mpidl.engine.models import MODELS
from mpidl.engine.optim import OPTIMIZERS, SCHEDULES

#: the loop's ``min_local_batch``: the trainer handles an empty local batch (a zero gradient),
#: so the split may be the cost model's min-max optimum and ``B < P`` fits
MIN_LOCAL_BATCH = 0
#: ``--sync-every epoch``: K' = the steps of one epoch (eDNNcomm's default)
SYNC_EVERY_EPOCH = "epoch"

# The allowed names are read, when a configuration is validated, from the registries of the
# modules that own them (models.MODELS, optim.OPTIMIZERS, ...), so a new model, optimizer or
# strategy is one entry in its own module and nothing here.
BALANCES = ("speed", "none")
LOG_LEVELS = tuple(LEVELS)


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the option."""


@dataclass
class Config:
    """Everything a training run needs to know. Field names match the command-line options
    (``--batch-size`` -> ``batch_size``)."""

    # data and model
    data: str | None = None
    model: str = "hsicnn"
    model_args: str | None = None
    augment: bool = False
    cache: bool = False
    # optimisation
    epochs: int = 10
    batch_size: int = 64
    drop_last: bool = False
    lr: float = 0.02
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    optimizer: str = "sgd"
    schedule: str = "cosine"
    warmup_steps: int = 0
    max_steps: int | None = None
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    # distribution
    strategy: str = "flat"
    weighting: str = "balanced"
    #: K' (node strategy): an integer >= 1, or "epoch" (the trainer's steps per epoch)
    sync_every: int | str = 50
    sync_optimizer_state: bool = False
    balance: str = "speed"
    speeds: str = "auto"
    rebalance: bool = False
    rebalance_every: int = 20
    balance_threshold: float = 0.05
    ranks_per_node: int | None = None
    check_replicas: bool = False
    on_failure: str = "restart"
    #: a spare host of the job's allocation that takes the place of a lost host (grow back)
    replace_with: str | None = None
    #: the failure bound (mpidl/distributed/watchdog.py): "auto" or seconds without progress
    failure_timeout: str | float = "auto"
    # communication
    intra: str = "mpi"
    overlap: bool = False
    bucket_mb: float = BUCKET_MB
    compress: str = "none"
    sync_overlap: int = 0
    # emulation (experiments on one machine)
    emulate_slowdown: str | None = None
    emulate_clock: str = "wall"
    emulate_link: str | None = None
    # output
    metrics: str | None = None
    save: str | None = None
    checkpoint: str | None = None
    checkpoint_every: int = 1
    resume: bool = False
    timing_dir: str | None = None
    quiet: bool = False
    log_level: str = "info"
    progress_every_s: float = 5.0
    # what a non-finite reduced gradient does
    on_nan: str = "stop"

    # parsed forms of the string options, filled by validate()
    speed_list: list[float] | None = field(default=None, repr=False)
    slowdown_list: list[float] | None = field(default=None, repr=False)
    link: tuple[float, float] | None = field(default=None, repr=False)
    model_kwargs: dict = field(default_factory=dict, repr=False)

    def validate(self, world_size: int = 1) -> "Config":
        """Check every value; parse list-valued options. Raises :class:`ConfigError`.

        ``world_size`` is the number of ranks, needed for checks such as ``B >= P``.
        """
        _choice("--model", self.model, MODELS)
        if self.model_args is not None:
            try:
                kwargs = json.loads(self.model_args)
            except ValueError:
                kwargs = None
            if not isinstance(kwargs, dict):
                raise ConfigError(f"--model-args must be a JSON object such as '{{\"patch\": 1}}', got {self.model_args!r}")
            self.model_kwargs = kwargs
        _choice("--optimizer", self.optimizer, OPTIMIZERS)
        _choice("--schedule", self.schedule, SCHEDULES)
        if self.cache and self.data is None:
            raise ConfigError("--cache keeps samples of a --data file in memory; the built-in scene "
                              "is in memory already: give --data, or leave --cache out")
        _choice("--emulate-clock", self.emulate_clock, EMULATION_CLOCKS)
        if self.emulate_clock != "wall" and self.emulate_slowdown is None:
            raise ConfigError(f"--emulate-clock {self.emulate_clock} says what --emulate-slowdown "
                              "multiplies: give --emulate-slowdown too")
        self.sync_every = parse_sync_every(self.sync_every)
        # "epoch" is resolved by the trainer once the data (steps per epoch) is known; until
        # then it stands for a K' larger than any sync_overlap (check_sync_every_epoch checks
        # the resolved value).
        self._check_exchange(self.sync_every if self.sync_every != SYNC_EVERY_EPOCH else sys.maxsize)
        _choice("--on-failure", self.on_failure, ON_FAILURE)
        if self.replace_with is not None:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.replace_with):
                raise ConfigError(f"--replace-with takes one host name, got {self.replace_with!r}")
            if self.on_failure != "shrink":
                raise ConfigError("--replace-with starts new ranks in the place of a lost host, which needs "
                                  "--on-failure shrink (the survivors go on first, then the new host joins)")
        try:
            parse_failure_timeout(self.failure_timeout)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _choice("--balance", self.balance, BALANCES)
        if self.rebalance and self.balance == "none":
            raise ConfigError("--balance none keeps the equal split, and --rebalance would re-split it "
                              "by the measured step times: give one of them")
        _choice("--on-nan", self.on_nan, ON_NAN)
        _choice("--log-level", self.log_level, LOG_LEVELS)
        _choice("--dtype", self.dtype, tuple(DTYPES))
        _choice("--device", self.device, DEVICES)
        _positive_int("--epochs", self.epochs)
        _positive_int("--batch-size", self.batch_size)
        _positive_int("--checkpoint-every", self.checkpoint_every)
        _positive_int("--rebalance-every", self.rebalance_every)
        if not (isinstance(self.balance_threshold, (int, float)) and 0 <= self.balance_threshold < 1):
            raise ConfigError(f"--balance-threshold must be a fraction in [0, 1), got {self.balance_threshold}")
        if self.max_steps is not None:
            _positive_int("--max-steps", self.max_steps)
        if self.ranks_per_node is not None:
            _positive_int("--ranks-per-node", self.ranks_per_node)
        else:
            try:
                settings.SETTINGS.ranks_per_node
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.optimizer != "sgd":
            raise ConfigError("--nesterov applies to --optimizer sgd only")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("--nesterov needs --momentum > 0")
        if not self.weight_decay >= 0:
            raise ConfigError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if not self.progress_every_s > 0:
            raise ConfigError(f"--progress-every must be > 0 seconds, got {self.progress_every_s}")
        try:  # the split's one rule (mpidl/distributed/split) with the trainer's minimum
            check_batch_fits(self.batch_size, MIN_LOCAL_BATCH, world_size)
        except ValueError as exc:
            raise ConfigError(f"--batch-size: {exc}") from None
        # The list options are parsed by the distributed package's own parsers (one parser
        # per option in the code base); their errors are re-labelled with the option name.
        if self.speeds != "auto":
            self.speed_list = _parsed("--speeds", "speeds", parse_speeds, self.speeds, world_size)
        if self.emulate_slowdown is not None:
            self.slowdown_list = _parsed("--emulate-slowdown", "slowdowns", parse_slowdowns,
                                         self.emulate_slowdown, world_size)
        if self.emulate_link is not None:
            link = _parsed("--emulate-link", "link", parse_link, self.emulate_link)
            self.link = (link.latency_us, link.gbit_s)
        if self.resume and not self.checkpoint:
            raise ConfigError("--resume needs --checkpoint DIR (the folder to resume from)")
        if self.data is not None and os.path.isdir(self.data):
            raise ConfigError(f"--data {self.data}: is a directory, not an HDF5 layout file")
        if self.data is not None and not os.path.isfile(self.data):
            raise ConfigError(f"--data {self.data}: no such file")
        return self

    def check_sync_every_epoch(self, steps_per_epoch: int) -> None:
        """With ``--sync-every epoch``: the exchange's rules for K' = ``steps_per_epoch``
        (e.g. ``--sync-overlap`` below it); raises :class:`ConfigError`."""
        if self.sync_every == SYNC_EVERY_EPOCH:
            try:
                self._check_exchange(max(steps_per_epoch, 1))
            except ConfigError as exc:
                raise ConfigError(f"{exc} (--sync-every epoch is K'={steps_per_epoch} here)") from None

    def _check_exchange(self, sync_every: int) -> None:
        """The distributed options' own rules (:func:`mpidl.distributed.build.check_options`),
        each error named by its option."""
        emulated = self.ranks_per_node is not None or settings.SETTINGS.raw["MPIDL_RANKS_PER_NODE"].strip() != ""
        try:
            check_options(strategy=self.strategy, weighting=self.weighting, sync_every=sync_every,
                          on_nan=self.on_nan, intra=self.intra, overlap=self.overlap, bucket_mb=self.bucket_mb,
                          compress=self.compress, sync_overlap=self.sync_overlap, on_failure=self.on_failure,
                          host_memory=self.device == "cpu", optimizer=OPTIMIZERS.get(self.optimizer),
                          emulated_nodes=emulated)
        except OptionError as exc:
            message = str(exc)
            if exc.option == "on_failure":  # said of the command line's own options
                message = message.replace("on_failure='shrink'", "shrink").replace("intra='shm'", "--intra shm")
            raise ConfigError(f"--{exc.option.replace('_', '-')}: {message}") from None

    def to_dict(self) -> dict:
        """The user-facing options (JSON-serializable), for metrics, checkpoints and saved models."""
        hidden = {"speed_list", "slowdown_list", "link", "model_kwargs"}
        return {k: v for k, v in asdict(self).items() if k not in hidden}


def _choice(option: str, value: str, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{option} {value!r} is not one of: {', '.join(allowed)}")


def parse_sync_every(value) -> int | str:
    """``--sync-every``: an integer >= 1 (as int or text) or the word ``epoch``; returns the
    int or ``"epoch"``, else raises :class:`ConfigError`."""
    if isinstance(value, str):
        text = value.strip()
        if text == SYNC_EVERY_EPOCH:
            return SYNC_EVERY_EPOCH
        if text.isdigit() and int(text) >= 1:
            return int(text)
    elif isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ConfigError(f"--sync-every: must be an integer >= 1 or '{SYNC_EVERY_EPOCH}', got {str(value)!r}")


def _positive_int(option: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{option} must be a positive integer, got {value!r}")


def _parsed(option: str, what: str, parse, *args):
    """``parse(*args)``, with a ValueError turned into a ConfigError that names ``option``."""
    try:
        return parse(*args)
    except ValueError as exc:
        message = str(exc)
        if message.startswith(what + ":"):
            message = message[len(what) + 1:].lstrip()
        raise ConfigError(f"{option}: {message}") from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" to a help text that does not already say its default."""

    def _get_help_string(self, action):
        if "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors raise :class:`ConfigError` (instead of printing the
    usage and exiting), so that the command line reports them like every other set-up
    error: agreed by the ranks, one ``error:`` line from rank 0, exit code 2."""

    def error(self, message):
        raise ConfigError(f"{message} (python -m mpidl.train --help lists the options)")


def _join_negative_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--speeds -1,1`` -> ``--speeds=-1,1``: argparse takes a value that starts with ``-``
    and is not a plain number for an option, so a list of numbers starting with a negative
    one would be reported as a missing value instead of being validated."""
    takes_value = {opt for a in parser._actions if a.nargs is None and a.option_strings
                   and not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
                   for opt in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if (arg in takes_value and i + 1 < len(argv)
                and re.fullmatch(r"-[0-9.][0-9.,:eE+-]*", argv[i + 1])):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mpidl.train`` (and ``mpiexec -n N python -m mpidl.train``)."""
    d = Config()
    p = _Parser(
        prog="python -m mpidl.train",
        description="Train a model data-parallel over MPI ranks (run under mpiexec -n N). "
        "With no --data, trains on the built-in synthetic hyperspectral scene.",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="HDF5 dataset in the mpidl layout (default: the built-in synthetic scene)")
    g.add_argument("--augment", action="store_true",
                   help="random flips / 90-degree rotations of training patches (default off)")
    g.add_argument("--cache", action="store_true",
                   help="--data: keep each training sample a rank read in memory, so that later "
                        "epochs do not read the file again (up to the whole training split per "
                        "rank, as the shuffle deals every sample to every rank in time; default off)")

    g = p.add_argument_group("model")
    g.add_argument("--model", default=d.model, help=f"one of {', '.join(MODELS)}")
    g.add_argument("--model-args", default=d.model_args, metavar="JSON",
                   help="the model's width arguments as a JSON object, e.g. '{\"patch\": 1, \"depth\": 2}' "
                        "for vit (see mpidl/engine/models.py; default: the model's defaults)")
    g.add_argument("--dtype", default=d.dtype, help="float32 or float64")
    g.add_argument("--device", default=d.device, help="cpu or gpu (CuPy)")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of the model's initial weights, the data order and augmentation")

    g = p.add_argument_group("optimization")
    g.add_argument("--epochs", type=int, default=d.epochs, help="passes over the training split")
    g.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="the GLOBAL batch B, split over the ranks in proportion to their speed")
    g.add_argument("--drop-last", action="store_true",
                   help="skip each epoch's last, smaller global batch (as PyTorch's DataLoader option)")
    g.add_argument("--optimizer", default=d.optimizer, help=f"one of {', '.join(OPTIMIZERS)}")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (of the schedule)")
    g.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum, in [0, 1)")
    g.add_argument("--nesterov", action="store_true", help="Nesterov momentum (--optimizer sgd)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help="L2 weight decay (decoupled for adamw)")
    g.add_argument("--schedule", default=d.schedule, help=f"one of {', '.join(SCHEDULES)}")
    g.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="steps of linear learning-rate warm-up")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many global steps (default: none, every epoch runs)")
    g.add_argument("--on-nan", default=d.on_nan, help="NaN/Inf in the reduced gradient: stop or skip the step")

    g = p.add_argument_group("distribution")
    g.add_argument("--strategy", default=d.strategy,
                   help="gradient exchange: flat (world Allreduce), hierarchical (node Reduce, "
                        "leaders Allreduce, node Bcast), node (node-local every step, nodes every K' steps)")
    g.add_argument("--weighting", default=d.weighting,
                   help="balanced: local mean gradient x b_i/B then SUM (exact); uniform: 1/P average (baseline)")
    g.add_argument("--sync-every", default=d.sync_every, metavar="K",
                   help=f"K': steps between inter-node syncs (node strategy): an integer >= 1, or "
                        f"'{SYNC_EVERY_EPOCH}' for the steps of one epoch (default {d.sync_every})")
    g.add_argument("--sync-optimizer-state", action="store_true",
                   help="node strategy: average optimizer state too at each inter-node sync")
    g.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                   help="group consecutive ranks into emulated nodes of K ranks (default: the real "
                        "nodes, or env MPIDL_RANKS_PER_NODE)")
    g.add_argument("--check-replicas", action="store_true", help="debug: compare parameter checksums after each global sync")
    g.add_argument("--replace-with", default=d.replace_with, metavar="HOST",
                   help="with --on-failure shrink: when a host is lost, start as many new ranks on HOST "
                        "(a spare host of mpiexec's --host list, given no ranks) and go on with them at "
                        "the same global batch (Open MPI with ULFM only; docs/failures.md; default: none, "
                        "the survivors go on alone)")
    g.add_argument("--on-failure", default=d.on_failure,
                   help="a lost rank or host: restart (the job ends; resume from --checkpoint) or "
                        "shrink (the survivors drop it, re-split the batch and go on; needs Open MPI "
                        "under mpiexec --with-ft ulfm, else falls back to restart; docs/failures.md)")
    g.add_argument("--failure-timeout", default=d.failure_timeout, metavar="SECONDS",
                   help="the failure bound: a rank that makes no progress (a step, an evaluation batch, "
                        "a checkpoint) for this long ends the job with exit code 3 and names the host "
                        "it stopped hearing from; 'auto' (default): max(60 s, 10 x the longest step "
                        "seen), 300 s while warming up (docs/failures.md)")

    g = p.add_argument_group("balance (how the global batch is split over the ranks)")
    g.add_argument("--balance", default=d.balance,
                   help="speed: split B by the ranks' speeds (--speeds); none: equal split")
    g.add_argument("--speeds", default=d.speeds,
                   help="'auto': fit each rank's cost t(b) = a + c b from timed passes at several "
                        "batch sizes and split B to minimize the slowest rank's step; or one "
                        "relative speed per rank, e.g. 1,2,2,4")
    g.add_argument("--balance-threshold", type=float, default=d.balance_threshold, metavar="FRACTION",
                   help="keep the equal (or, re-balancing, the current) split unless another is "
                        "predicted to make the step faster by more than this fraction")
    g.add_argument("--rebalance", action="store_true",
                   help="re-fit every rank's cost model from its own steps every --rebalance-every "
                        "steps and re-split when the gain passes --balance-threshold")
    g.add_argument("--rebalance-every", type=int, default=d.rebalance_every, metavar="STEPS",
                   help="steps between re-fits with --rebalance")

    g = p.add_argument_group("communication (how the exchange hides its cost)")
    g.add_argument("--intra", default=d.intra,
                   help=f"how the ranks of a node combine: mpi (MPI collectives on private "
                        f"replicas) or shm (one node-shared MPI-3 window holding the parameters "
                        f"and optimizer state once; elementwise optimizers, cpu) (default {d.intra})")
    g.add_argument("--overlap", action="store_true",
                   help="flat/hierarchical: exchange gradient buckets with non-blocking "
                        "collectives started during the backward pass (default off)")
    g.add_argument("--bucket-mb", type=float, default=d.bucket_mb, metavar="MIB",
                   help=f"largest bucket of --overlap in MiB (default {d.bucket_mb:g}); a smaller "
                        f"gradient is still cut into 8 buckets where its layers allow")
    g.add_argument("--compress", default=d.compress,
                   help=f"inter-node traffic in {', '.join(c for c in COMPRESSIONS if c != 'none')} "
                        f"with error feedback and float32 accumulation, or none (default {d.compress})")
    g.add_argument("--sync-overlap", type=int, nargs="?", const=1, default=d.sync_overlap, metavar="STEPS",
                   help="node strategy: start the inter-node parameter average without waiting and "
                        "apply it STEPS steps later, corrected by the local progress meanwhile "
                        "(--sync-overlap alone: 1 step; default 0: blocking)")

    g = p.add_argument_group("emulation (experiments on one machine; always reported as emulation)")
    g.add_argument("--emulate-slowdown", default=None, metavar="F0,F1,...",
                   help="stretch rank i's compute time by factor f_i >= 1 (default: none)")
    g.add_argument("--emulate-clock", default=d.emulate_clock, choices=EMULATION_CLOCKS,
                   help="what --emulate-slowdown multiplies: each compute's wall time, or its CPU "
                        "time (the compute then lasts max(wall, f x cpu); with more ranks than "
                        f"cores the wall time includes waiting for a core) (default {d.emulate_clock})")
    g.add_argument("--emulate-link", default=None, metavar="LATENCY_US,GBIT_S",
                   help="add the alpha-beta modelled time of each inter-node collective (default: none)")

    g = p.add_argument_group("output")
    g.add_argument("--metrics", default=None, metavar="PATH", help="JSON Lines metrics file, written by rank 0 (default: none)")
    g.add_argument("--save", default=None, metavar="PATH", help="write the final model as HDF5 (default: not saved)")
    g.add_argument("--checkpoint", default=None, metavar="DIR", help="write DIR/checkpoint.h5 (DIR is created if missing; default: no checkpoints)")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="epochs between checkpoints")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint DIR")
    g.add_argument("--timing-dir", default=None, metavar="DIR", help="every rank writes its per-step timing to DIR/rank<r>.jsonl (default: none)")
    g.add_argument("--quiet", action="store_true", help="print only errors and the final summary")
    g.add_argument("--log-level", default=d.log_level, help=f"one of {', '.join(LOG_LEVELS)}")
    g.add_argument("--progress-every", dest="progress_every_s", type=float, default=d.progress_every_s,
                   metavar="SECONDS", help="progress line within an epoch at most this often")
    return p


def parse_config(argv=None, world_size: int = 1) -> Config:
    """Parse and validate a command line. Every error, argparse's own included, raises
    :class:`ConfigError`; ``--help`` prints and exits (SystemExit 0) as usual."""
    parser = build_parser()
    ns = parser.parse_args(_join_negative_values(parser, list(sys.argv[1:] if argv is None else argv)))
    names = {f.name for f in fields(Config)}
    cfg = Config(**{k: v for k, v in vars(ns).items() if k in names})
    return cfg.validate(world_size)
