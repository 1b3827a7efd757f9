"""Shared helpers of the benchmark scripts: launching, statistics, Markdown, machine facts.

Nothing here is timed. The scripts that use it:

* ``benchmarks/experiments.py``  the papers' experiments (HDP, balanced gradient, node-based),
  and the driver that regenerates every table and figure under ``benchmarks/results/``;
* ``benchmarks/comm.py``         reduction strategies on flat buffers (under mpiexec);
* ``benchmarks/scaling.py``      samples/s for 1, 2 and 4 ranks;
* ``benchmarks/peers_torch.py``  the same runs with PyTorch DDP (gloo), when torch is installed;
* ``benchmarks/train_batch.py``  runs several ``python -m mpidl.train`` command lines one after
  another inside one ``mpiexec`` (saves the start-up of a job per row).

Conventions: every timing is reported as the median of repeated measurements with its spread
``[min - max]``; accuracies over seeds as ``mean ± std``; every emulated quantity (slow ranks,
slow links, nodes on one machine) says so where it is reported.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
RESULTS = BENCH_DIR / "results"
PYTHON = sys.executable

def _load_launcher():
    """tests/launcher.py, the one module that knows the launchers' flags (MPICH, Open MPI)."""
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("mpidl_tests_launcher", ROOT / "tests" / "launcher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _load_launcher()
MPIEXEC = launcher.default_mpiexec()
SAMSON_DIR = ROOT.parent / "shared" / "data" / "samson"

#: MPICH progress throttling, set for every benchmark job (see ``THROTTLE_NOTE``).
THROTTLE_ENV = {
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "64",
}
THROTTLE_NOTE = (
    "Every job runs with `MPIR_CVAR_CH4_PROGRESS_THROTTLE=1 "
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=64` (MPICH: a rank waiting in a "
    "collective sleeps 1 us after 64 polls that made no progress). With 4 ranks on 2 cores a "
    "waiting rank otherwise spins and takes CPU from the ranks still computing; on this machine "
    "that made a 4-rank synthetic epoch about 1.3x slower (communication 0.40 s -> 0.14 s per "
    "epoch in one comparison). `--mpich-defaults` turns it off."
)


def bench_env(throttle: bool = True, extra: dict | None = None) -> dict:
    """The environment of a benchmark job: ours, plus MPICH throttling (see THROTTLE_NOTE)."""
    env = dict(os.environ)
    if throttle:
        env.update(THROTTLE_ENV)
    # The checkout must win over any installed copy, also for scripts run by path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


# --------------------------------------------------------------------------------------------
# commands
# --------------------------------------------------------------------------------------------


def mpiexec(ranks: int, program: list[str], two_nodes: bool = False) -> list[str]:
    """``mpiexec -n RANKS ... PROGRAM...`` for this MPI (tests/launcher.py); ``two_nodes``: the
    ranks as 2 emulated nodes (MPICH ``-hosts localhost:2,127.0.0.1:2 -launcher fork``, Open MPI
    ``MPIDL_RANKS_PER_NODE``)."""
    return launcher.mpiexec(ranks, list(program), 2 if two_nodes else None, exe=MPIEXEC)


def shown(cmd: list[str]) -> str:
    """A command as a reader would type it: ``python`` / ``mpiexec`` for the interpreter and
    the launcher, paths inside the checkout made relative to it."""
    words = []
    for word in cmd:
        word = str(word)
        if word == PYTHON:
            word = "python"
        elif word == MPIEXEC:
            word = "mpiexec"
        elif word.startswith(str(ROOT) + os.sep):
            word = os.path.relpath(word, ROOT)
        words.append(shlex.quote(word))
    return " ".join(words)


def run(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int, float]:
    """Run ``cmd`` in the checkout, stdout+stderr to ``log``; returns (exit code, seconds).

    A command that runs past ``timeout`` is killed (its whole process group) and returns 124.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        out.write(f"$ {shown(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=env if env is not None else bench_env(),
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
            out.write(f"\n[killed after {timeout:.0f} s]\n")
            code = 124
    return code, time.perf_counter() - start


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------
# batches of training runs in one mpiexec
# --------------------------------------------------------------------------------------------


class TrainBatch:
    """Several ``python -m mpidl.train`` runs executed one after another in one ``mpiexec``
    (``benchmarks/train_batch.py``): the same code path as the command line
    (``mpidl.train.main(argv)``), without a job start-up per run.

    ``add(name, argv)`` returns the metrics path the run will write; ``launch()`` runs them all
    and returns ``{name: (start, epochs, end) or None}``.
    """

    def __init__(self, work: Path, tag: str, ranks: int = 4, two_nodes: bool = False,
                 throttle: bool = True, warmup: list[str] | None = None):
        self.work, self.tag, self.ranks, self.two_nodes, self.throttle = work, tag, ranks, two_nodes, throttle
        self.runs: list[dict] = []
        if warmup is not None:
            # JIT compilation and caches: paid once here, not by the first measured run.
            self.add("warmup", warmup)

    def add(self, name: str, argv: list[str]) -> Path:
        metrics = self.work / self.tag / f"{name}.jsonl"
        self.runs.append({"name": name, "argv": [str(a) for a in argv] + ["--quiet", "--metrics", str(metrics)]})
        return metrics

    def train_command(self, name: str) -> str:
        """The single-run equivalent of one row: ``mpiexec ... python -m mpidl.train ...``."""
        run_ = next(r for r in self.runs if r["name"] == name)
        argv = [a for a in run_["argv"]]
        i = argv.index("--metrics")
        argv[i + 1] = f"{name}.jsonl"
        return shown(mpiexec(self.ranks, [PYTHON, "-m", "mpidl.train", *argv], self.two_nodes))

    def command(self) -> list[str]:
        return mpiexec(self.ranks, [PYTHON, str(BENCH_DIR / "train_batch.py"),
                                    str(self.work / self.tag / "runs.json")], self.two_nodes)

    def launch(self, timeout: float) -> dict:
        folder = self.work / self.tag
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "runs.json").write_text(json.dumps(self.runs, indent=1))
        log = folder / "batch.log"
        code, seconds = run(self.command(), log, timeout, bench_env(self.throttle, getattr(self, "extra_env", None)))
        self.seconds, self.code, self.log = seconds, code, log
        results = {}
        for r in self.runs:
            path = Path(r["argv"][r["argv"].index("--metrics") + 1])
            try:
                results[r["name"]] = load_metrics(path)
            except (OSError, ValueError):
                results[r["name"]] = None
        if code != 0:
            print(f"  batch {self.tag} exited with {code}; see {log}\n{tail(log)}", flush=True)
        return results


def load_metrics(path):
    """``(start, epochs, end)`` of a metrics file (see :func:`mpidl.plot.load_metrics`)."""
    from mpidl.plot import load_metrics as _load  # noqa: PLC0415

    return _load(path)


# --------------------------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------------------------


def finite(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(float(v))]


def median(values) -> float:
    values = finite(values)
    return statistics.median(values) if values else math.nan


def med_spread(values, scale: float = 1.0, digits: int = 2) -> str:
    """``median [min - max]`` of the values times ``scale``."""
    values = [v * scale for v in finite(values)]
    if not values:
        return "n/a"
    m = statistics.median(values)
    if len(values) == 1:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def mean_std(values, scale: float = 100.0, digits: int = 2) -> str:
    """``mean ± std`` (sample std) of the values times ``scale`` (percent by default)."""
    values = [v * scale for v in finite(values)]
    if not values:
        return "n/a"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_size(n: int) -> str:
    """Buffer sizes in binary units, as they are chosen (4 KiB ... 64 MiB)."""
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


# --------------------------------------------------------------------------------------------
# per-epoch quantities from the metrics records
# --------------------------------------------------------------------------------------------


def epoch_samples(record: dict, previous_step: int, num_samples: int, global_batch: int) -> list[int]:
    """Samples each rank computed in the epoch of ``record``: full global batches split as
    ``record['batch_sizes']`` and, for a complete epoch, the last smaller batch split in the
    same proportions (as the trainer does, :func:`mpidl.distributed.split.balance.split_counts`)."""
    from mpidl.distributed.split.balance import split_counts  # noqa: PLC0415

    if "samples" in record:  # the trainer records them (the split may change inside an epoch)
        return list(record["samples"])
    sizes = record["batch_sizes"]
    steps = record["step"] - previous_step
    full, rest = divmod(num_samples, global_batch)
    if rest == 0 or steps <= full:  # only full global batches (or an epoch cut by --max-steps)
        return [steps * b for b in sizes]
    last = split_counts(rest, sizes)
    return [full * b + extra for b, extra in zip(sizes, last)]


def ideal_epoch_s(record: dict, factors) -> float:
    """The ideal epoch time of ``record`` under EMULATED slowdowns ``F_i``: the total work the
    ranks did, unslowed, over the sum of their speeds::

        ideal = sum_i (comp_s_i / F_i) / sum_i (1 / F_i)

    ``comp_s_i / F_i`` is rank ``i``'s compute time without its emulated sleep, so the numerator
    is the epoch's compute (fixed per-step parts included) as one rank of speed 1 would do it,
    and the whole is the epoch time of a split that kept every rank busy the whole epoch with
    no communication. (A per-sample cost averaged over the ranks would not do: a rank with 1
    sample per step has a per-sample cost equal to its fixed cost, and would inflate the ideal.)"""
    return (sum(comp / f for comp, f in zip(record["comp_s"], factors))
            / sum(1.0 / f for f in factors))


def ideal_ratio_factors(record: dict, factors) -> tuple[float, float, float]:
    """``epoch / ideal`` of ``record`` as the product of three factors, each ``>= 1``::

        split     = max_i comp_i / ideal        the ranks' compute totals differ: the split's error
        variation = S / max_i comp_i            each step waits for that step's slowest rank
        rest      = time_s / S                  exchange, optimizer, epoch-end collectives

    with ``S = sum_t max_i c_it`` the sum over steps of the slowest rank's compute, which is
    ``comp_i + idle_i`` for every rank ``i`` (the trainer's ``idle_i = sum_t (max_j c_jt -
    c_it)``). A split right on average has ``split = 1`` and still pays ``variation``: on a shared
    machine the ranks' step times vary independently, and no fixed split removes that."""
    ideal = ideal_epoch_s(record, factors)
    slowest_total = max(record["comp_s"])
    critical = statistics.fmean(c + i for c, i in zip(record["comp_s"], record["idle_s"]))
    return slowest_total / ideal, critical / slowest_total, record["time_s"] / critical


def unslowed_cost_per_sample(record: dict, factors, samples) -> float:
    """Seconds of unslowed compute per sample of the epoch: ``sum_i comp_s_i / F_i / sum_i n_i``."""
    return sum(comp / f for comp, f in zip(record["comp_s"], factors)) / max(sum(samples), 1)


def timed_epochs(epochs: list[dict], skip_first: bool = True) -> list[dict]:
    """The epochs whose time is reported: all but the first (speed probe effects, caches,
    allocation) when there are at least two."""
    return epochs[1:] if skip_first and len(epochs) > 1 else epochs


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------


def md_table(headers: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def code_block(lines) -> str:
    return "```\n" + "\n".join(lines) + "\n```"


def machine_info() -> dict:
    """Cores, CPU, MPI library, Python, NumPy (and PyTorch when installed), date."""
    from mpi4py import MPI  # noqa: PLC0415
    import numpy  # noqa: PLC0415

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = "%.1f %.1f %.1f" % os.getloadavg()
    except OSError:
        load = "n/a"
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cores": affinity,
        "cpu": cpu,
        "mpi": MPI.Get_library_version().splitlines()[0].strip(),
        "mpi4py": __import__("mpi4py").__version__,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "torch": torch_version(),
        "load_average": load,
        "commit": _git_commit(),
    }
    return info


def torch_version() -> str | None:
    """PyTorch's version if it is installed, found without importing it (importing takes seconds)."""
    try:
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

        return version("torch")
    except PackageNotFoundError:
        return None


def _git_commit() -> str:
    """The checkout's commit (read-only ``git rev-parse``), marked when the tree has changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return f"{head}{' + uncommitted changes' if dirty else ''}" if head else "n/a"
    except (OSError, subprocess.SubprocessError):
        return "n/a"


def machine_md(info: dict) -> str:
    rows = [
        ["date", info["date"]],
        ["cores", f"{info['cores']} ({info['cpu']})"],
        ["MPI", info["mpi"]],
        ["mpi4py / Python / NumPy", f"{info['mpi4py']} / {info['python']} / {info['numpy']}"],
        ["PyTorch (peers only)", info["torch"] or "not installed: peer columns skipped"],
        ["load average at start (1/5/15 min)", info["load_average"]],
        ["commit", info["commit"]],
    ]
    return md_table(["machine", ""], rows)


def write_markdown(path: Path, title: str, generated_by: str, info: dict, body: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = [f"# {title}", "", f"Generated by `{generated_by}`.", "", machine_md(info), "", *body, ""]
    path.write_text("\n".join(text), encoding="utf-8")
    return path


def matplotlib_figure(width: float = 7.0, height: float = 4.0):
    """A matplotlib Figure with the Agg canvas (no pyplot, no window), or None without matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError:
        return None
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig


# --------------------------------------------------------------------------------------------
# PyTorch (optional peer)
# --------------------------------------------------------------------------------------------


def init_torch_gloo(world, skip: bool = False, timeout_s: float = 60.0):
    """``(torch.distributed, None)`` with a gloo process group over the ranks of the MPI
    communicator ``world`` (same ranks, same order), or ``(None, reason)``.

    Collective over ``world``, and every rank ends with the same answer: an import or
    initialisation failure on any rank means no torch column on any rank. PyTorch is never a
    dependency of mpidl; it is only compared against.
    """
    import datetime  # noqa: PLC0415
    import socket  # noqa: PLC0415

    reason = "skipped (--no-torch)" if skip else None
    dist = None
    if reason is None:
        try:
            import torch.distributed as dist  # noqa: PLC0415
            if not dist.is_available():
                reason = "torch.distributed is not available in this PyTorch build"
        except ImportError as exc:
            reason = f"PyTorch not installed ({exc})"
    reasons = world.allgather(reason)
    if any(reasons):
        return None, next(r for r in reasons if r)
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:  # a free port for the rendezvous; rank 0 listens on it
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are on this machine
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.Get_rank(),
                                world_size=world.Get_size(), timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - any failure means: no torch column, and why
        reason = f"torch.distributed gloo init failed: {type(exc).__name__}: {exc}"
    reasons = world.allgather(reason)
    if any(reasons):
        if reason is None:
            dist.destroy_process_group()
        return None, next(r for r in reasons if r)
    return dist, None


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def prepare_samson(work: Path, train_size: int | None, test_size: int | None, seed: int = 0,
                   data_dir: Path = SAMSON_DIR, timeout: float = 300) -> tuple[Path | None, str, list[str]]:
    """Convert the real Samson scene with the project's converter, then (optionally) keep a
    stratified random subset of each split for time's sake.

    Returns ``(path or None, a sentence for the report, the commands run)``; None when the
    scene is absent or the conversion fails (the sentence says why).
    """
    cube, ends = data_dir / "Samson.mat", data_dir / "_EndSamson.mat"
    if not (cube.is_file() and ends.is_file()):
        return None, f"Samson skipped: {data_dir} has no Samson.mat / _EndSamson.mat.", []
    work.mkdir(parents=True, exist_ok=True)
    full = work / "samson.h5"
    cmd = [PYTHON, "-m", "mpidl.data_tools", "hsi", "--cube", str(cube), "--abundances", str(ends),
           "--patch", "7", "--train-fraction", "0.2", "--out", str(full)]
    commands = [shown(cmd).replace(str(ROOT.parent), "..")]
    if not full.is_file():
        code, _ = run(cmd, work / "convert.log", timeout)
        if code != 0 or not full.is_file():
            return None, f"Samson skipped: the converter failed ({tail(work / 'convert.log', 3)}).", commands
    if train_size is None and test_size is None:
        return full, "Samson: the whole converted scene (patch 7, 20% of each class for training).", commands
    small = work / f"samson_{train_size}_{test_size}.h5"
    subset_layout(full, small, {"train": train_size, "test": test_size}, seed)
    commands.append(f"benchmarks.common.subset_layout(samson.h5, {small.name}, "
                    f"train={train_size}, test={test_size}, seed={seed})")
    return small, (f"Samson: converted by the project's converter (patch 7, 20% of each class for "
                   f"training: 1805 train / 7220 test), then a stratified random subset of "
                   f"{train_size} train / {test_size} test samples (seed {seed}) to fit the time budget "
                   f"on 2 cores."), commands


def subset_layout(src: Path, dst: Path, sizes: dict, seed: int = 0) -> Path:
    """Write ``dst``: a stratified random subset of each split of the layout file ``src``
    (``sizes[split]`` samples, None = all), through the project's layout writer."""
    import h5py  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from mpidl.data.layout import SCENE_KIND, write_layout, write_scene_layout  # noqa: PLC0415

    if dst.is_file():
        return dst
    rng = np.random.default_rng(seed)
    splits = {}
    with h5py.File(src, "r") as f:
        scene = f.attrs.get("layout_kind", b"") in (SCENE_KIND, SCENE_KIND.encode())
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in f.attrs["class_names"]]
        for split, size in sizes.items():
            y = f[f"{split}/y"][()]
            n = len(y) if size is None else min(int(size), len(y))
            keep = []
            counts = np.bincount(y, minlength=len(names))
            # The classes' proportions are kept, rounded by largest remainder so that the
            # subset has exactly n samples (a benchmark may need N to be a multiple of its batch).
            exact = n * counts / len(y)
            shares = np.floor(exact).astype(int)
            for k in np.argsort(-(exact - shares), kind="stable")[: n - int(shares.sum())]:
                shares[k] += 1
            for k in range(len(names)):
                members = np.flatnonzero(y == k)
                keep.append(rng.choice(members, size=min(int(shares[k]), len(members)), replace=False))
            keep = np.sort(np.concatenate(keep))
            # A scene-backed source keeps its cube and loses pixels; a patch file its patches.
            splits[split] = (f[f"{split}/pos"][()][keep] if scene else f[f"{split}/x"][keep], y[keep])
        source = str(f.attrs.get("source", src.name))
        if scene:
            write_scene_layout(dst, f["scene/cube"][()], splits, names,
                               patch_size=int(f.attrs["patch_size"]), row_chunk=int(f.attrs["row_chunk"]),
                               source=f"{source} (stratified subset, seed {seed})", split_seed=seed)
            return dst
    write_layout(dst, splits, names, source=f"{source} (stratified subset, seed {seed})",
                 patch_size=splits["train"][0].shape[-1], split_seed=seed)
    return dst
