"""Reading input arrays: MATLAB ``.mat`` (v5 and v7.3), NumPy ``.npy`` / ``.npz``.

An input is named ``FILE`` or ``FILE:KEY``. Without a key, the variable is chosen
automatically when that is unambiguous (see :meth:`ArrayFile.pick`).

MATLAB v7.3 files are HDF5 files. MATLAB writes arrays in column-major (Fortran) order, and
HDF5 describes them in row-major order, so a MATLAB ``(rows, cols, bands)`` array appears to
h5py as ``(bands, cols, rows)``: :class:`ArrayFile` reverses the axes (``arr.T``) so every
array comes back with the shape MATLAB shows. ``.mat`` v5 files (``scipy.io.loadmat``)
already come back in MATLAB's shape.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np


class InputError(ValueError):
    """An input file that cannot be converted; the message names the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass(frozen=True)
class Variable:
    name: str
    shape: tuple[int, ...]  # MATLAB's shape (already un-transposed for v7.3)
    kind: str  # 'numeric', 'text', 'cell' or 'other'

    def describe(self) -> str:
        return f"{self.name} ({'x'.join(map(str, self.shape))} {self.kind})"


def parse_source(spec: str) -> tuple[str, str | None]:
    """``'a/b.mat:Y'`` -> ``('a/b.mat', 'Y')``; ``'a/b.mat'`` -> ``('a/b.mat', None)``.

    The key is the text after the last colon when it holds no path separator (so a path
    with a colon in a folder name still works when no key is given).
    """
    head, sep, tail = spec.rpartition(":")
    if sep and head and tail and "/" not in tail and "\\" not in tail and not os.path.exists(spec):
        return head, tail
    return spec, None


def clean_name(name: str) -> str:
    """Endmember / class names as stored in the data: ``'2-Tree'`` -> ``'tree'``.

    A leading number with a separator (how the benchmark files number their endmembers) is
    dropped and the name is lower-cased, so names compare equal across datasets.
    """
    return re.sub(r"^\s*\d+\s*[-_.:)]\s*", "", str(name)).strip().lower()


class ArrayFile:
    """The variables of one input file, read lazily (only the variable asked for is loaded)."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"{self.path}: no such file")
        if os.path.isdir(self.path):
            raise InputError(self.path, "is a directory, expected a .mat, .npy or .npz file")
        suffix = os.path.splitext(self.path)[1].lower()
        self._npz = None
        if suffix == ".npy":
            self.format = "npy"
        elif suffix == ".npz":
            self.format = "npz"
        else:  # .mat or anything else: let the content decide
            import h5py  # noqa: PLC0415

            self.format = "mat73" if h5py.is_hdf5(self.path) else "mat5"
        self.variables = self._list()

    # ---- listing -------------------------------------------------------------------------------
    def _list(self) -> dict[str, Variable]:
        try:
            if self.format == "npy":
                arr = np.load(self.path, mmap_mode="r", allow_pickle=False)
                return {"array": Variable("array", tuple(arr.shape), _kind_np(arr.dtype))}
            if self.format == "npz":
                self._npz = np.load(self.path, allow_pickle=False)
                return {k: Variable(k, tuple(self._npz[k].shape), _kind_np(self._npz[k].dtype))
                        for k in self._npz.files}
            if self.format == "mat73":
                return self._list_mat73()
            import scipy.io  # noqa: PLC0415

            found = scipy.io.whosmat(self.path)
        except InputError:
            raise
        except Exception as exc:  # scipy / numpy raise many types on a damaged or foreign file
            raise InputError(self.path, f"cannot read as {self._format_name()} "
                                        f"({exc.__class__.__name__}: {exc})") from exc
        kinds = {"char": "text", "cell": "cell", "struct": "other", "object": "other"}
        return {name: Variable(name, tuple(shape), kinds.get(cls, "numeric"))
                for name, shape, cls in found}

    def _list_mat73(self) -> dict[str, Variable]:
        import h5py  # noqa: PLC0415

        out = {}
        with h5py.File(self.path, "r") as f:
            for name, item in f.items():
                if name.startswith("#") or not isinstance(item, h5py.Dataset):
                    continue  # '#refs#' holds the contents of cell arrays, not variables
                cls = item.attrs.get("MATLAB_class", b"")
                cls = cls.decode() if isinstance(cls, bytes) else str(cls)
                if cls == "char":
                    kind = "text"
                elif cls == "cell" or item.dtype.kind == "O":
                    kind = "cell"
                else:
                    kind = _kind_np(item.dtype)
                out[name] = Variable(name, tuple(reversed(item.shape)), kind)
        return out

    def _format_name(self) -> str:
        return {"npy": "a NumPy .npy file", "npz": "a NumPy .npz file",
                "mat73": "a MATLAB v7.3 (HDF5) file", "mat5": "a MATLAB .mat file"}[self.format]

    def describe(self) -> str:
        return ", ".join(v.describe() for v in self.variables.values()) or "none"

    # ---- choosing and loading -------------------------------------------------------------------
    def pick(self, key: str | None, ndims: tuple[int, ...] = (2, 3), what: str = "array") -> str:
        """The variable to use: ``key`` if given (it must exist), else the largest numeric
        variable with ``ndim`` in ``ndims``. Ties for the largest are refused as ambiguous."""
        if key is not None:
            if self.format == "npy":
                raise InputError(self.path, f"a .npy file holds a single array; drop ':{key}'")
            if key not in self.variables:
                raise InputError(self.path, f"no variable {key!r} (variables: {self.describe()})")
            return key
        candidates = [v for v in self.variables.values()
                      if v.kind == "numeric" and len(v.shape) in ndims]
        if not candidates:
            raise InputError(self.path, f"no {'-D or '.join(map(str, ndims))}-D numeric variable "
                                        f"for the {what} (variables: {self.describe()}); "
                                        f"name one with FILE:KEY")
        sizes = [int(np.prod(v.shape)) for v in candidates]
        best = max(sizes)
        tied = [v.name for v, s in zip(candidates, sizes) if s == best]
        if len(tied) > 1:
            raise InputError(self.path, f"cannot tell which variable is the {what}: {tied} are "
                                        f"equally large; name one with FILE:KEY")
        return tied[0]

    def has(self, key: str) -> bool:
        return key in self.variables

    def load(self, key: str) -> Any:
        """The variable as MATLAB shows it: a NumPy array, or a list of str for text/cell."""
        if key not in self.variables:
            raise InputError(self.path, f"no variable {key!r} (variables: {self.describe()})")
        try:
            if self.format == "npy":
                return np.load(self.path, allow_pickle=False)
            if self.format == "npz":
                return np.asarray(self._npz[key])
            if self.format == "mat73":
                return self._load_mat73(key)
            import scipy.io  # noqa: PLC0415

            value = scipy.io.loadmat(self.path, variable_names=[key])[key]
        except InputError:
            raise
        except Exception as exc:
            raise InputError(self.path, f"cannot read variable {key!r} "
                                        f"({exc.__class__.__name__}: {exc})") from exc
        if self.variables[key].kind in ("text", "cell"):
            return _strings(value)
        return value

    def _load_mat73(self, key: str) -> Any:
        import h5py  # noqa: PLC0415

        with h5py.File(self.path, "r") as f:
            ds = f[key]
            kind = self.variables[key].kind
            if kind == "text":
                return [_matlab_chars(ds[()])]
            if kind == "cell":
                refs = np.asarray(ds[()]).T  # back to MATLAB's shape, then column-major order
                return [_matlab_chars(f[ref][()]) for ref in refs.ravel(order="F")]
            return np.asarray(ds[()]).T


def _kind_np(dtype: np.dtype) -> str:
    return "numeric" if np.dtype(dtype).kind in "biuf" else ("text" if np.dtype(dtype).kind in "US"
                                                            else "other")


def _matlab_chars(codes: np.ndarray) -> str:
    """A MATLAB v7.3 char array (uint16 code units, stored transposed) -> str."""
    codes = np.asarray(codes)
    return "".join(chr(int(c)) for c in codes.T.ravel(order="F")) if codes.size else ""


def _strings(value: Any) -> list[str]:
    """Flatten what scipy makes of a MATLAB char/cell array into a list of str (column-major)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, bytes):
        return [value.decode()]
    arr = np.asarray(value)
    if arr.dtype.kind in "US":  # scipy turns each row of a char matrix into one string
        return [str(s).strip() for s in arr.ravel(order="F")]
    out: list[str] = []
    for item in arr.ravel(order="F"):
        out.extend(_strings(item))
    return out
