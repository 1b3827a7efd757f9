"""Classification maps: ``mpiexec -n N python -m mpidl.predict --model model.h5 --cube scene.mat --data data.h5 --out map.h5``.

Classifies EVERY pixel of a scene with a trained model, data-parallel over the ranks: rank
``i`` of ``P`` takes a contiguous band of rows (``np.array_split`` of the rows), cuts the
``patch x patch`` window around each of its pixels from the padded cube, normalizes it with
the training statistics and keeps the arg-max class; rank 0 gathers the bands and writes

* ``--out`` (HDF5, atomically): ``map`` (rows, cols) int16, the predicted class of every
  pixel; ``truth`` (rows, cols) int16, the ground truth (-1 = unlabelled); ``split`` (rows,
  cols) int8, 0 = unlabelled, 1 = train, 2 = test (3 = val), when the pixels' splits are
  known; attributes ``class_names``, ``oa_labelled``, ``oa_test`` (when known),
  ``class_accuracy_labelled`` and ``class_accuracy_test`` (K values, NaN for a class with no
  pixel), ``model``, ``cube``, ``data``;
* a PNG (``--png``, default the output's name with ``.png``; matplotlib, ``pip install
  'mpidl[plot]'``): the ground truth and the predicted map side by side, and the errors on
  the labelled pixels.

What a map needs beyond the model: the patch size, the padding and the per-channel mean/std
the model was trained with, all read from the layout file it was trained on (``--data``,
either variant). The cube is read by the converter's reader (:func:`mpidl.data_tools.hsi.
load_cube`, the same ``FILE[:KEY]``, ``--rows/--cols``, ``--pixel-order``; defaults from the
layout's attributes) and padded with its ``pad_mode``, so a labelled pixel's sample is the
one the trainer saw, bit for bit, and the map's accuracy on the test pixels is the trained
model's test OA. The ground truth is the layout's labelled pixels (train and test, with their
split), or ``--labels`` / ``--abundances`` as for the converter.

Every input is checked on every rank before any pixel is classified, and the ranks agree
(a bad option; a missing or unreadable model, data file or cube; a cube whose band count
differs from the model's; a scene shape that differs from the layout's); the outputs are
checked on rank 0, which writes them, as the atomic writer will write them (a missing or
read-only folder; :func:`mpidl.app.outputs.check_output_file`): rank 0 prints ``error: ...`` and
every rank exits with code 2, leaving no output. A write that still fails (a full disk) prints
``error: cannot write PATH: cause``, leaves no temporary file and exits with code 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PREDICT_BATCH = 1024


def build_parser() -> argparse.ArgumentParser:
    from mpidl.app.cli import Parser  # noqa: PLC0415

    p = Parser(prog="python -m mpidl.predict",
                                description="Classify every pixel of a scene with a trained model "
                                            "(data-parallel over the ranks' bands of rows).")
    p.add_argument("--model", required=True, help="model file written by mpidl.train --save")
    p.add_argument("--cube", required=True, metavar="FILE[:KEY]",
                   help="the hyperspectral cube (.mat v5/v7.3, .npy), as for the converter")
    p.add_argument("--data", required=True,
                   help="the layout file the model was trained on (patch size, padding, "
                        "normalization, labelled pixels)")
    truth = p.add_mutually_exclusive_group()
    truth.add_argument("--labels", metavar="FILE[:KEY]",
                       help="ground truth class map, 0 = unlabelled (default: the layout's pixels)")
    truth.add_argument("--abundances", metavar="FILE[:KEY]",
                       help="ground truth abundances; class = dominant endmember")
    p.add_argument("--min-abundance", type=float, default=None,
                   help="with --abundances: leave pixels below this unlabelled (default none)")
    p.add_argument("--rows", type=int, default=None, help="image rows of a (bands, pixels) cube "
                   "(default: the layout's scene_shape, or nRow in the file)")
    p.add_argument("--cols", type=int, default=None, help="image columns (default as --rows)")
    p.add_argument("--pixel-order", choices=("F", "C"), default=None,
                   help="pixel numbering of a matrix cube (default: the layout's, else F)")
    p.add_argument("--out", required=True, help="output HDF5 file of the class map")
    p.add_argument("--png", default=None,
                   help="figure of the ground truth and the map (default: --out with .png)")
    p.add_argument("--no-png", action="store_true", help="write no figure (default: write one)")
    p.add_argument("--batch", type=int, default=PREDICT_BATCH,
                   help=f"pixels per forward pass (default {PREDICT_BATCH})")
    p.add_argument("--quiet", action="store_true", help="print only errors (default: print the report)")
    return p


def _attr(attrs, key, default=None):
    if key not in attrs:
        return default
    value = attrs[key]
    if isinstance(value, bytes):
        return value.decode()
    return value


def prepare(args) -> dict:
    """Every check and every input, before any work; raises ValueError / OSError naming the
    file and the problem."""
    import h5py  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from mpidl.app.checkpoint import load_model  # noqa: PLC0415
    from mpidl.data_tools.hsi import load_abundances, load_cube, load_labels  # noqa: PLC0415
    from mpidl.data.layout import SCENE_KIND, validate_layout  # noqa: PLC0415
    from mpidl.app.outputs import cause  # noqa: PLC0415

    if args.batch < 1:
        raise ValueError(f"--batch must be >= 1, got {args.batch}")
    if not os.path.isfile(args.model):
        raise FileNotFoundError(f"--model {args.model}: no such file")
    try:
        model = load_model(args.model)
    except ValueError as exc:  # says what the file is instead
        raise ValueError(f"--model {exc}") from None
    except OSError as exc:  # not HDF5, truncated, held open by a writer
        raise ValueError(f"--model {args.model}: cannot be read: {cause(exc)}") from None
    except KeyError as exc:
        raise ValueError(f"--model {args.model}: not a model written by mpidl.train --save "
                         f"({cause(exc)})") from None
    meta = validate_layout(args.data)
    bands, ph, pw = model.input_shape
    if (meta["bands"], meta["patch_size"], meta["patch_size"]) != (bands, ph, pw):
        raise ValueError(f"--model {args.model} takes samples of {bands} x {ph} x {pw} but --data "
                         f"{args.data} has {meta['bands']} bands and patch {meta['patch_size']}")
    if model.num_classes != meta["num_classes"]:
        raise ValueError(f"--model {args.model} has {model.num_classes} classes but --data "
                         f"{args.data} has {meta['num_classes']}")
    with h5py.File(args.data, "r") as f:
        pad_mode = _attr(f.attrs, "pad_mode", "reflect")
        layout_order = _attr(f.attrs, "pixel_order", "F")
        shape = f.attrs.get("scene_shape")
        scene_shape = tuple(int(v) for v in np.asarray(shape).reshape(-1)[:2]) if shape is not None else None
        known = {s: (f[f"{s}/pos"][...], f[f"{s}/y"][...]) for s in meta["splits"] if "pos" in f[s]}
    order = args.pixel_order or layout_order
    rows = args.rows or (scene_shape[0] if scene_shape else None)
    cols = args.cols or (scene_shape[1] if scene_shape else None)
    cube, cube_desc = load_cube(args.cube, rows, cols, order)
    if cube.shape[2] != bands:
        raise ValueError(f"--cube {cube_desc} has {cube.shape[2]} bands but the model "
                         f"{args.model} takes {bands}")
    if scene_shape is not None and cube.shape[:2] != scene_shape:
        raise ValueError(f"--cube {cube_desc} is {cube.shape[0]} x {cube.shape[1]} pixels but "
                         f"--data {args.data} was converted from a {scene_shape[0]} x "
                         f"{scene_shape[1]} scene")
    n_rows, n_cols = cube.shape[:2]
    split_map = np.zeros((n_rows, n_cols), np.int8)
    if args.labels or args.abundances:
        gt = (load_labels(args.labels, n_rows, n_cols, order, cube_desc) if args.labels else
              load_abundances(args.abundances, n_rows, n_cols, order, cube_desc, args.min_abundance))
        truth = gt.labels.astype(np.int16)
        truth_desc = gt.description
        if truth.max() >= model.num_classes:
            raise ValueError(f"ground truth {truth_desc} has {truth.max() + 1} classes but the "
                             f"model has {model.num_classes}")
    else:
        if not known:
            raise ValueError(f"--data {args.data} stores no pixel positions: give the ground "
                             f"truth with --labels or --abundances")
        truth = np.full((n_rows, n_cols), -1, np.int16)
        for code, split in ((1, "train"), (2, "test"), (3, "val")):
            if split in known:
                pos, y = known[split]
                truth[pos[:, 0], pos[:, 1]] = y
                split_map[pos[:, 0], pos[:, 1]] = code
        truth_desc = f"{args.data} (labelled pixels of its splits)"
    png = png_path(args)
    if png is not None:
        try:
            import matplotlib  # noqa: F401, PLC0415
        except ImportError:
            raise ImportError("the PNG needs matplotlib, which is not installed: pip install "
                              "'mpidl[plot]' (or pass --no-png)") from None
    return {"model": model, "cube": cube, "cube_desc": cube_desc, "meta": meta,
            "pad_mode": pad_mode, "truth": truth, "truth_desc": truth_desc, "split": split_map,
            "png": png, "scene_backed": meta.get("kind") == SCENE_KIND}


def png_path(args) -> str | None:
    """The figure's path: ``--png``, by default ``--out`` with ``.png``; None with ``--no-png``."""
    return None if args.no_png else (args.png or os.path.splitext(args.out)[0] + ".png")


def check_outputs(args, rank: int) -> list[str]:
    """On rank 0, which writes them: ``--out`` and the figure can be written atomically in
    their (existing) folders (raises :class:`mpidl.app.outputs.OutputError`); returns the stale
    temporaries of interrupted writes that were removed."""
    from mpidl.app.outputs import check_output_file  # noqa: PLC0415

    if rank != 0:
        return []
    removed = check_output_file("--out", args.out, create_folder=False)
    png = png_path(args)
    if png is not None:
        removed += check_output_file("--png" if args.png else "--out (its figure)", png, create_folder=False)
    return removed


def row_band(rows: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s rows ``[lo, hi)``: contiguous, sizes differing by at most one."""
    base, extra = divmod(rows, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def classify_rows(model, cube, lo: int, hi: int, mean, std, pad_mode: str, batch: int):
    """Predicted classes of scene rows ``[lo, hi)``: ``(hi - lo, cols) int16``.

    Pixel ``(r, c)``'s sample is the converter's patch (``cube`` padded by ``h = patch // 2``
    with ``pad_mode``; window ``padded[r : r + patch, c : c + patch]`` as (bands, patch,
    patch)), normalized as the reader does: ``(x - mean[b]) / std[b]`` in float32.
    """
    import numpy as np  # noqa: PLC0415

    from mpidl.data.layout import cut_patches  # noqa: PLC0415

    patch = model.input_shape[1]
    half = patch // 2
    cols = cube.shape[1]
    out = np.empty((hi - lo, cols), np.int16)
    if hi <= lo:
        return out
    # Only this band's rows (and the h rows above and below) are padded and cut.
    top, bottom = max(lo - half, 0), min(hi + half, cube.shape[0])
    block = cube[top:bottom]
    pad_top, pad_bottom = half - (lo - top), half - (bottom - hi)
    if pad_mode == "reflect" and (pad_top or pad_bottom):
        padded = np.pad(cube, ((half, half), (half, half), (0, 0)), mode=pad_mode)[lo:hi + 2 * half]
    else:
        padded = np.pad(block, ((pad_top, pad_bottom), (half, half), (0, 0)), mode=pad_mode)
    m = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, np.float32).reshape(1, -1, 1, 1)
    rr, cc = np.meshgrid(np.arange(hi - lo), np.arange(cols), indexing="ij")
    pixels = np.stack([rr.reshape(-1), cc.reshape(-1)], axis=1)
    flat = out.reshape(-1)
    model.eval()
    for start in range(0, pixels.shape[0], batch):
        x = cut_patches(padded, pixels[start:start + batch], patch)
        x -= m
        x /= s
        logits = model.forward(model.backend.asarray(x))
        flat[start:start + batch] = model.backend.to_host(logits.argmax(axis=1))
    return out


def accuracy_report(pred, truth, where, k: int) -> tuple[float, list[float], int]:
    """OA and per-class accuracy (recall; NaN for a class with no pixel) over the pixels
    ``where & truth >= 0``; also their number."""
    import numpy as np  # noqa: PLC0415

    sel = where & (truth >= 0)
    n = int(sel.sum())
    if n == 0:
        return float("nan"), [float("nan")] * k, 0
    p, t = pred[sel], truth[sel]
    per = [float((p[t == c] == c).mean()) if np.any(t == c) else float("nan") for c in range(k)]
    return float((p == t).mean()), per, n


def _write_map(path: str, pred, prep, report: dict, args) -> None:
    import numpy as np  # noqa: PLC0415

    from mpidl.app.outputs import atomic_h5  # noqa: PLC0415

    with atomic_h5(path) as f:
        f.create_dataset("map", data=pred.astype(np.int16))
        f.create_dataset("truth", data=prep["truth"].astype(np.int16))
        if prep["split"].any():
            f.create_dataset("split", data=prep["split"])
        f.attrs["class_names"] = prep["meta"]["class_names"]
        f.attrs["model"] = os.path.abspath(args.model)
        f.attrs["cube"] = prep["cube_desc"]
        f.attrs["data"] = os.path.abspath(args.data)
        f.attrs["ground_truth"] = prep["truth_desc"]
        for key, value in report.items():
            f.attrs[key] = value


def draw_map(path: str, pred, truth, class_names, title: str) -> None:
    """PNG, atomically: ground truth | predicted map | errors on the labelled pixels."""
    import numpy as np  # noqa: PLC0415
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    from matplotlib.colors import ListedColormap  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    palette = ["#4C72B0", "#55A868", "#C44E52", "#8172B2", "#CCB974", "#64B5CD", "#DD8452",
               "#8C8C8C", "#DA8BC3", "#937860"]
    k = len(class_names)
    colors = ["#FFFFFF"] + [palette[i % len(palette)] for i in range(k)]
    cmap = ListedColormap(colors)
    fig = Figure(figsize=(12, 4.4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    labelled = truth >= 0
    wrong = labelled & (pred != truth)
    err = np.where(labelled, np.where(wrong, 2, 1), 0)
    panels = [(truth + 1, cmap, "ground truth (white: unlabelled)", k),
              (pred + 1, cmap, "predicted class, every pixel", k),
              (err, ListedColormap(["#FFFFFF", "#D0D0D0", "#000000"]),
               f"errors on labelled pixels (black: {int(wrong.sum())})", 2)]
    for ax, (img, cm, name, vmax) in zip(axes, panels):
        ax.imshow(img, cmap=cm, vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_title(name, fontsize=10)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.legend(handles=[Patch(color=colors[i + 1], label=n) for i, n in enumerate(class_names)],
               loc="lower center", ncol=min(k, 8), frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.subplots_adjust(bottom=0.12, top=0.86, wspace=0.05)
    from mpidl.app.outputs import atomic_file  # noqa: PLC0415

    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def main(argv=None) -> int:
    from mpidl.app.cli import parse_args, start_process  # noqa: PLC0415

    start_process()  # before MPI starts: OMPI_MCA_osc, the thread policy
    import numpy as np  # noqa: PLC0415

    from mpidl.distributed.launch import (abort_on_uncaught_exception, agree_on_error,  # noqa: PLC0415
                                          gather_to_root, world)

    rank, size = world()
    sys.excepthook = abort_on_uncaught_exception
    error, prep, removed = None, None, []
    try:
        args = parse_args(build_parser(), argv, rank)
        removed = check_outputs(args, rank)
        prep = prepare(args)
    except (ValueError, OSError, KeyError, ImportError) as exc:
        error = str(exc)
    error = agree_on_error(error)
    if error is not None:
        if rank == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    model, cube, meta = prep["model"], prep["cube"], prep["meta"]
    lo, hi = row_band(cube.shape[0], rank, size)
    start = time.perf_counter()
    band = classify_rows(model, cube, lo, hi, meta["mean"], meta["std"], prep["pad_mode"], args.batch)
    seconds = time.perf_counter() - start
    bands = gather_to_root((lo, hi, band, seconds))
    if rank != 0:
        return 0
    pred = np.concatenate([b[2] for b in sorted(bands, key=lambda b: b[0])], axis=0)
    truth, split = prep["truth"], prep["split"]
    k = model.num_classes
    everywhere = np.ones(truth.shape, bool)
    oa_all, per_all, n_all = accuracy_report(pred, truth, everywhere, k)
    report = {"oa_labelled": oa_all, "class_accuracy_labelled": np.array(per_all),
              "labelled_pixels": n_all}
    lines = [f"predict: {size} rank(s), rows per rank {[b[1] - b[0] for b in bands]}, "
             f"{pred.size} pixels in {max(b[3] for b in bands):.2f} s "
             f"({pred.size / max(max(b[3] for b in bands), 1e-9):.0f} pixels/s)"]
    names = meta["class_names"]
    width = max(8, *(len(n) for n in names))
    if (split == 2).any():
        oa_test, per_test, n_test = accuracy_report(pred, truth, split == 2, k)
        report.update({"oa_test": oa_test, "class_accuracy_test": np.array(per_test),
                       "test_pixels": n_test})
    header = f"{'class':<{width}}  {'labelled':>8}  {'acc %':>6}" + (
        f"  {'test':>6}  {'acc %':>6}" if "oa_test" in report else "")
    lines += ["", header]
    for c, name in enumerate(names):
        row = f"{name:<{width}}  {int((truth == c).sum()):>8d}  {100 * per_all[c]:6.2f}"
        if "oa_test" in report:
            row += f"  {int(((truth == c) & (split == 2)).sum()):>6d}  {100 * report['class_accuracy_test'][c]:6.2f}"
        lines.append(row)
    total = f"{'OA':<{width}}  {n_all:>8d}  {100 * oa_all:6.2f}"
    if "oa_test" in report:
        total += f"  {report['test_pixels']:>6d}  {100 * report['oa_test']:6.2f}"
    lines += [total, ""]
    if removed:
        lines.append(f"removed {len(removed)} temporary file(s) left by an interrupted write: "
                     f"{', '.join(removed)}")
    try:
        # only rank 0 is left: a failed write is its own error, no other rank waits for it
        _write_map(args.out, pred, prep, report, args)
        lines.append(f"wrote {args.out} (map {pred.shape[0]} x {pred.shape[1]}, classes {names})")
        if prep["png"]:
            title = (f"{os.path.basename(args.model)} on {os.path.basename(prep['cube_desc'].split(':')[0])}: "
                     f"OA {100 * oa_all:.2f} % on all {n_all} labelled pixels"
                     + (f", {100 * report['oa_test']:.2f} % on the {report['test_pixels']} test pixels"
                        if "oa_test" in report else ""))
            draw_map(prep["png"], pred, truth, names, title)
            lines.append(f"wrote {prep['png']}")
    except OSError as exc:  # a full disk: the writer names the path and removed its temporary
        if not args.quiet:
            print("\n".join(lines), flush=True)
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    if not args.quiet:
        print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
