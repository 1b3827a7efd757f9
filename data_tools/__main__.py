"""Command line of the data tools: ``python -m mpidl.data_tools SUBCOMMAND ...``.

======================  ===========================================================
subcommand              does
======================  ===========================================================
``hsi``                 hyperspectral cube + ground truth (.mat v5/v7.3, .npy) -> layout
``images``              folder of class sub-folders of images -> layout (needs Pillow)
``synthetic``           the built-in generated scene -> layout
``info``                print a layout file's contents; exit code 1 if it is invalid
======================  ===========================================================

Errors in the input (a bad option, a missing key, mismatched sizes, an invalid file, NaN or
Inf values) print one line ``error: ...`` naming the file and the problem, and exit with
code 1; no output file is left behind. A converter's ``--out`` is checked first (not a
folder; a temporary file can be created and removed beside it, as the atomic writer will),
and a write that fails later (disk full) names ``--out``, never the temporary file.
"""

from __future__ import annotations

import argparse
import sys

from mpidl.data_tools import hsi, images, info, synthetic


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mpidl.data_tools",
        description="Convert data to the mpidl HDF5 layout, or inspect a layout file.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for module, name, help_text in (
            (hsi, "hsi", "hyperspectral cube + ground truth -> patch dataset"),
            (images, "images", "folder of class sub-folders of images -> dataset"),
            (synthetic, "synthetic", "the built-in synthetic scene -> dataset"),
            (info, "info", "print and validate a layout file")):
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or "").split("\n")[0])
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from mpidl.app.outputs import check_output_file  # noqa: PLC0415

    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "out", None):
            check_output_file("--out", args.out)
        return args.run(args)
    except (ValueError, OSError, KeyError, ImportError) as exc:  # they name the file and problem
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
