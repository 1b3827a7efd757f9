# python -m mpidl.plot runs/flat.jsonl runs/node.jsonl --out figures --labels flat,node
"""Figures from the metrics files that ``python -m mpidl.train --metrics PATH`` writes.

Two kinds of figure, both PNG:

``curves.png``
    Training loss and test overall accuracy (OA) per epoch, one line per run file, so that
    several runs (strategies, weightings, rank counts) can be compared on one figure.

``time_breakdown.png`` (one run) or ``time_breakdown_<LABEL>.png`` (several runs)
    For every epoch, each rank's seconds of computation, communication and idle time as one
    stacked bar, the ranks side by side within the epoch's group, and a last group with the
    mean over all epochs (same scale, so it reads like one more epoch). With balanced batches
    the bars have the same height and almost no idle part; with equal batches on unequal
    ranks the fast ranks' bars are mostly idle.
    Emulated runs (``--emulate-slowdown``, ``--emulate-link``) say so in the title.

The metrics file is JSON Lines written by rank 0: one ``{"event": "start", ...}`` record,
one ``{"event": "epoch", ...}`` record per epoch and one ``{"event": "end", ...}`` record
(absent when the run was killed). Records of other kinds are ignored, so the format can
grow. A resumed run appends to the same file: a later record of an epoch replaces an
earlier one, and the last ``start`` record describes the run.

matplotlib is an optional dependency (``pip install 'mpidl[plot]'``). It is imported only
when a figure is drawn, and only its object-oriented API with the Agg canvas is used (no
``pyplot``), so plotting never opens a window, needs no display and leaves the caller's
matplotlib backend alone.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from mpidl.app.outputs import OutputError, atomic_file, check_output_folder

# One colour per kind of time, the same in every figure: the eye learns them once.
TIME_KINDS = (
    ("comp_s", "computation", "#4C72B0"),
    ("comm_s", "communication", "#DD8452"),
    ("idle_s", "idle (waiting for slower ranks, estimated)", "#C0C0C0"),
)
# Beyond this many epochs the per-epoch groups would be slivers; show this many, evenly
# spaced and always including the first and the last, and say so on the axis.
MAX_EPOCH_GROUPS = 24
MATPLOTLIB_MISSING = "plotting needs matplotlib, which is not installed: pip install 'mpidl[plot]'"


@dataclass
class Run:
    """One metrics file, loaded.

    Attributes
    ----------
    path : the metrics file.
    label : the run's name in legends and in ``time_breakdown_<label>.png``.
    start : the ``start`` record, or None when the file has none.
    epochs : the ``epoch`` records, sorted by epoch number, one per epoch.
    end : the ``end`` record, or None when the run did not finish.
    """

    path: Path
    label: str
    start: dict | None
    epochs: list[dict]
    end: dict | None


def load_metrics(path) -> tuple[dict | None, list[dict], dict | None]:
    """Read a metrics JSON Lines file.

    Returns ``(start, epochs, end)``: the last ``start`` record (None if absent), the
    ``epoch`` records sorted by ``epoch`` with one record per epoch (the later of two
    records of the same epoch wins, as after ``--resume``), and the last ``end`` record
    (None if the run did not finish).

    Raises FileNotFoundError for a missing file and ValueError, naming the file, for an
    empty file, a line that is not a JSON object, or a file without any epoch record. A
    last line cut short (the process was killed while writing it) is ignored.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file {path}: no such file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"metrics file {path} is empty (did the run write any record?)")
    lines = text.splitlines()
    start = end = None
    by_epoch: dict[int, dict] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)  # accepts the NaN / Infinity that Python's json writes
        except json.JSONDecodeError as exc:
            truncated_last_line = number == len(lines) and not text.endswith("\n")
            if truncated_last_line:
                break
            raise ValueError(f"metrics file {path}, line {number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"metrics file {path}, line {number}: expected a JSON object")
        event = record.get("event")
        if event == "start":
            start = record
        elif event == "end":
            end = record
        elif event == "epoch":
            epoch = record.get("epoch")
            if not isinstance(epoch, int) or isinstance(epoch, bool):
                raise ValueError(
                    f"metrics file {path}, line {number}: epoch record without an integer 'epoch'"
                )
            by_epoch[epoch] = record
    if not by_epoch:
        raise ValueError(
            f"metrics file {path} has no epoch records (the run stopped before its first epoch ended)"
        )
    epochs = [by_epoch[e] for e in sorted(by_epoch)]
    return start, epochs, end


def load_run(path, label: str | None = None) -> Run:
    """:func:`load_metrics` wrapped in a :class:`Run`; the label defaults to the file's stem."""
    path = Path(path)
    start, epochs, end = load_metrics(path)
    label = label if label is not None else path.stem
    return Run(path=path, label=label, start=start, epochs=epochs, end=end)


def emulation_note(run: Run) -> str | None:
    """``"emulated slowdown 1,1,2,4; emulated link 5 us, 10 Gbit/s"`` for an emulated run, else None
    (``"emulated slowdown 1,1,2,4 (cpu clock)"`` when the slowdown multiplied CPU time).

    Taken from the start record's ``emulation`` field, or from its config when that field is
    missing; a run without a start record is reported as not emulated.
    """
    if run.start is None:
        return None
    emulation = run.start.get("emulation") or {}
    config = run.start.get("config") or {}
    slowdown = emulation.get("slowdown")
    link = emulation.get("link")
    if "emulation" not in run.start:  # older files: fall back to the raw option strings
        slowdown = config.get("emulate_slowdown")
        link = config.get("emulate_link")
    parts = []
    if slowdown:
        clock = emulation.get("clock")
        parts.append("emulated slowdown " + _number_list(slowdown)
                     + (f" ({clock} clock)" if clock and clock != "wall" else ""))
    if link:
        latency_us, gbit_s = _parse_list(link)
        parts.append(f"emulated link {latency_us:g} us, {gbit_s:g} Gbit/s")
    return "; ".join(parts) or None


def plot_curves(runs, out_path) -> Path:
    """Draw the training loss and the test OA per epoch of every run into ``out_path`` (PNG).

    ``runs`` is a sequence of :class:`Run` objects or metrics file paths. Returns the path.
    """
    runs = [_as_run(r) for r in runs]
    if not runs:
        raise ValueError("plot_curves needs at least one run")
    Figure, FigureCanvasAgg = _matplotlib()
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_oa = fig.subplots(1, 2)
    for run in runs:
        epochs = [r["epoch"] for r in run.epochs]
        legend = run.label + _stop_note(run)
        if run_note := emulation_note(run):
            legend += f" ({run_note})"
        loss = [_number(r.get("loss")) for r in run.epochs]  # a NaN loss leaves a gap, not a crash
        (line,) = ax_loss.plot(epochs, loss, marker="o", markersize=3, label=legend)
        # OA is stored as a fraction; people read accuracy tables in percent.
        oa_percent = [100 * _number(r.get("oa")) for r in run.epochs]
        ax_oa.plot(epochs, oa_percent, marker="o", markersize=3, color=line.get_color())
    ax_loss.set(xlabel="epoch", ylabel="training loss (mean over the epoch)", title="Training loss")
    ax_oa.set(xlabel="epoch", ylabel="test OA (%)", title="Test overall accuracy")
    for ax in (ax_loss, ax_oa):
        ax.grid(alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True, min_n_ticks=1)  # whole epochs only
    ax_loss.legend(fontsize="small")
    return _save(fig, out_path)


def plot_time_breakdown(run, out_path) -> Path:
    """Draw each rank's computation / communication / idle seconds per epoch as stacked bars.

    ``run`` is a :class:`Run` or a metrics file path. Every epoch is a group of bars, one
    per rank in rank order; a last group, set apart, holds each rank's mean over all
    epochs (a mean rather than a total keeps it on the epochs' scale). Returns the path.
    Raises ValueError when the epoch records carry no per-rank timing (``comp_s``,
    ``comm_s``, ``idle_s``).
    """
    run = _as_run(run)
    shown = _epochs_to_show(run.epochs)
    timings = [_rank_times(run, record) for record in shown]
    num_ranks = max(len(t["comp_s"]) for t in timings)
    means = {key: [0.0] * num_ranks for key, _, _ in TIME_KINDS}
    for record in run.epochs:  # the mean over every epoch, not just the ones shown
        for key, values in _rank_times(run, record).items():
            for rank, seconds in enumerate(values):
                means[key][rank] += seconds / len(run.epochs)

    Figure, FigureCanvasAgg = _matplotlib()
    # A mean of one epoch would repeat it; it is drawn only when there is more than one.
    with_mean = len(run.epochs) > 1
    groups = [*timings, means] if with_mean else timings
    # Wide enough for the title and the legend, growing with the number of bars, capped.
    width_in = min(18.0, max(9.0, 4.0 + 0.22 * num_ranks * len(groups)))
    fig = Figure(figsize=(width_in, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    # Group g's ranks sit at g + (rank - (P-1)/2) * bar; the gaps between groups stay visible.
    bar = 0.8 / num_ranks
    group_x = [float(i) for i in range(len(shown))] + [len(shown) + 0.4] * with_mean  # set apart
    tallest = 0.0
    for g, (x0, times) in enumerate(zip(group_x, groups)):
        bottom = [0.0] * len(times["comp_s"])
        for key, name, color in TIME_KINDS:
            xs = [x0 + (rank - (num_ranks - 1) / 2) * bar for rank in range(len(times[key]))]
            ax.bar(xs, times[key], width=bar * 0.92, bottom=bottom, color=color,
                   label=name if g == 0 else None, edgecolor="white", linewidth=0.3)
            bottom = [b + t for b, t in zip(bottom, times[key])]
        tallest = max(tallest, *bottom)
    # Explicit headroom: the tops of the bars (usually idle) are the part to be read.
    ax.set_ylim(0, 1.06 * tallest if tallest > 0 else 1.0)
    if with_mean:
        ax.axvline(len(shown) - 0.3, color="black", linewidth=0.6, linestyle=":")
    ax.set_xticks(group_x, [str(r["epoch"]) for r in shown] + ["mean"] * with_mean)
    ax.set_ylabel("seconds per epoch")
    every = "" if len(shown) == len(run.epochs) else f" ({len(shown)} of {len(run.epochs)} shown)"
    ax.set_xlabel(f"epoch{every}; within a group, ranks 0..{num_ranks - 1} from left to right")
    ax.grid(axis="y", alpha=0.3)
    # Outside the axes: inside, it would hide the bar tops where the idle time shows.
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(_breakdown_title(run, means))
    return _save(fig, out_path)


def main(argv=None) -> int:
    """The command line: load every metrics file, then write ``curves.png`` and the breakdowns."""
    parser = argparse.ArgumentParser(
        prog="python -m mpidl.plot",
        description="Plot mpidl metrics files (JSON Lines from `python -m mpidl.train --metrics PATH`): "
        "curves.png with loss and OA per epoch for every run, and per run a time_breakdown PNG "
        "with each rank's computation / communication / idle seconds per epoch.",
    )
    parser.add_argument("metrics", nargs="+", metavar="METRICS.jsonl", help="one or more metrics files")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="folder for the PNG files (created if missing)")
    parser.add_argument("--labels", default=None, metavar="A,B,...",
                        help="one name per metrics file for legends and file names (default: the file names)")
    args = parser.parse_args(argv)

    if args.labels is not None:
        labels = [label.strip() for label in args.labels.split(",")]
        if len(labels) != len(args.metrics):
            parser.error(f"--labels has {len(labels)} names for {len(args.metrics)} metrics files")
        if len(set(labels)) != len(labels) or not all(labels):
            parser.error(f"--labels must be distinct and non-empty, got {args.labels!r}")
    else:
        labels = _default_labels([Path(p) for p in args.metrics])
    # Every file is read before anything is drawn, so a bad third file fails before any output.
    try:
        runs = [load_run(path, label) for path, label in zip(args.metrics, labels)]
    except (OSError, ValueError) as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")

    out_dir = Path(args.out)
    names = ["curves.png", *_breakdown_names(runs)]
    try:
        _matplotlib()  # before creating the folder: a missing dependency leaves nothing behind
    except ModuleNotFoundError as exc:
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    try:  # like every output of mpidl: checked (and created) before anything is drawn
        check_output_folder("--out", str(out_dir), names)
    except OutputError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    try:
        written = [plot_curves(runs, out_dir / names[0])]
        for run, name in zip(runs, names[1:]):
            written.append(plot_time_breakdown(run, out_dir / name))
    except (OSError, ValueError) as exc:  # a write names the figure's path (a full disk)
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    for path in written:
        print(path)
    return 0


# ---------------------------------------------------------------------------- helpers


def _matplotlib():
    """Import the two matplotlib classes used here, or explain how to install matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
        from matplotlib.figure import Figure  # noqa: PLC0415
    except ImportError as exc:
        raise ModuleNotFoundError(MATPLOTLIB_MISSING) from exc
    return Figure, FigureCanvasAgg


def _save(fig, out_path) -> Path:
    """Write the figure atomically (:func:`mpidl.app.outputs.atomic_file`: the user's file mode;
    a failure names ``out_path`` and leaves no temporary file)."""
    out_path = Path(out_path)
    with atomic_file(str(out_path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return out_path


def _as_run(run) -> Run:
    return run if isinstance(run, Run) else load_run(run)


def _rank_times(run: Run, record: dict) -> dict[str, list[float]]:
    """The per-rank seconds of one epoch record, checked to be lists of one length."""
    times = {}
    for key, _, _ in TIME_KINDS:
        values = record.get(key)
        if not isinstance(values, list) or not values:
            raise ValueError(
                f"metrics file {run.path}, epoch {record['epoch']}: no per-rank '{key}' list, "
                "so there is no time breakdown to draw"
            )
        times[key] = [_number(v, missing=0.0) for v in values]
    if len({len(v) for v in times.values()}) != 1:
        raise ValueError(
            f"metrics file {run.path}, epoch {record['epoch']}: comp_s, comm_s and idle_s "
            "have different numbers of ranks"
        )
    return times


def _epochs_to_show(epochs: list[dict]) -> list[dict]:
    if len(epochs) <= MAX_EPOCH_GROUPS:
        return epochs
    step = (len(epochs) - 1) / (MAX_EPOCH_GROUPS - 1)
    return [epochs[round(i * step)] for i in range(MAX_EPOCH_GROUPS)]


def _breakdown_title(run: Run, means: dict[str, list[float]]) -> str:
    """Run name, setup, emulation and the idle share: the numbers a reader wants first."""
    last = run.epochs[-1]
    setup = [f"{len(means['comp_s'])} ranks"]
    if run.start is not None and run.start.get("num_nodes"):
        setup[0] += f" on {run.start['num_nodes']} node{'s' if run.start['num_nodes'] != 1 else ''}"
    setup += [str(last[k]) for k in ("strategy", "weighting") if last.get(k)]
    if last.get("batch_sizes"):
        setup.append("batch " + _number_list(last["batch_sizes"]))
    rank_seconds = sum(sum(v) for v in means.values())
    idle_share = sum(means["idle_s"]) / rank_seconds if rank_seconds > 0 else 0.0
    lines = [f"{run.label}: time per rank, idle {100 * idle_share:.0f}% of rank time", ", ".join(setup)]
    if note := emulation_note(run):
        lines.append(note)
    return "\n".join(lines)


def _stop_note(run: Run) -> str:
    if run.end is None:
        return " [unfinished]"
    stopped = run.end.get("stopped", "completed")
    return "" if stopped == "completed" else f" [stopped: {stopped}]"


def _default_labels(paths: list[Path]) -> list[str]:
    """File stems; when two files share a stem (runs/a/metrics.jsonl, runs/b/metrics.jsonl),
    the parent folder is prefixed, and as a last resort the position."""
    labels = [p.stem for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{p.parent.name}_{p.stem}" if p.parent.name else p.stem for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{i}_{label}" for i, label in enumerate(labels)]
    return labels


def _breakdown_names(runs: list[Run]) -> list[str]:
    """``time_breakdown.png`` for one run, else ``time_breakdown_<label>.png`` with the label
    made safe for file names (and numbered where two labels become the same name)."""
    if len(runs) == 1:
        return ["time_breakdown.png"]
    safe = [re.sub(r"[^A-Za-z0-9._-]+", "_", run.label).strip("_") or "run" for run in runs]
    if len(set(safe)) < len(safe):
        safe = [f"{i}_{name}" for i, name in enumerate(safe)]
    return [f"time_breakdown_{name}.png" for name in safe]


def _number(value, missing: float = math.nan) -> float:
    """A JSON number as float; null (or a missing value) becomes ``missing``."""
    return missing if value is None else float(value)


def _parse_list(value) -> list[float]:
    """A list of numbers from a JSON list or a comma-separated option string."""
    if isinstance(value, str):
        return [float(part) for part in value.split(",")]
    return [float(v) for v in value]


def _number_list(value) -> str:
    return ",".join(f"{v:g}" for v in _parse_list(value))


if __name__ == "__main__":
    sys.exit(main())
