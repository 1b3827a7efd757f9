"""Output paths: checked before any work, temporary files of atomic writes, and a rescue
place for a trained model whose final write fails.

Every file mpidl writes (checkpoints, saved models, layout files, class maps, figures) is
written to a temporary name beside its target, ``.<target name>.<8 random characters>.tmp``
(:func:`make_temp`), with the mode the user's umask gives, then renamed over the target
(:func:`atomic_file`, :func:`atomic_h5`); a failed write removes its temporary and raises an
error that names the target, never the temporary. The same naming serves three purposes:

* :func:`check_output_file` / :func:`check_output_folder` test, at set-up, that a target can
  be written by creating and removing such a temporary file next to it -- exactly what the
  atomic writer will do -- so an unwritable ``--save`` or ``--checkpoint`` is refused
  before training, not after it;
* :func:`remove_stale_temps` removes the temporaries an interrupted write (``kill -9``) left
  behind, recognising only names of that form for the targets mpidl writes in that folder;
* :func:`rescue_model` writes a model to a fallback place when its own target fails (disk
  full, quota, a file system gone), so that a finished training run is not thrown away.

:func:`cause` turns a file-system error into words for the user (the errno's name, also when
HDF5 buries it in its own text; a file another process holds locked; a truncated file).

Nothing here talks MPI: the command line runs the checks on the ranks that will write and
agrees on the result with the other set-up errors.
"""

from __future__ import annotations

import errno
import os
import re
import sys
import tempfile
from contextlib import contextmanager

#: mkstemp's random part: 8 characters of [a-z0-9_]
_RANDOM = r"[a-z0-9_]{8}"


class OutputError(ValueError):
    """An output path that cannot be written; the message names the option and the path."""


def make_temp(path: str) -> str:
    """Create an empty temporary file beside ``path`` (same folder, so that ``os.replace``
    is a rename within one file system) and return its name, ``.<basename>.XXXXXXXX.tmp``.
    Raises OSError from the file system."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    return tmp


def write_error(path: str, exc: BaseException) -> OSError:
    """An OSError whose message names the user's ``path`` (never the temporary name) and the
    operating system's cause; its ``errno`` is the original one."""
    error = OSError(f"cannot write {path}: {cause(exc)}")
    error.errno = getattr(exc, "errno", None) or _buried_errno(exc)
    return error


def user_mode() -> int:
    """The mode a new file gets from the user's umask, ``0o666 & ~umask`` (mkstemp makes 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextmanager
def atomic_file(path: str):
    """Yield the name of a temporary file beside ``path`` (:func:`make_temp`, already given
    the user's mode, :func:`user_mode`) for the caller to write by name (a figure's
    ``savefig``, an HDF5 library); on success fsync it and rename it to ``path`` (atomic on
    POSIX), then fsync the folder (best effort). On any error the temporary file is removed,
    and a failed write -- an OSError, or a library's error that carries the operating
    system's errno (HDF5's on a full disk) -- is re-raised as :func:`write_error`, naming
    ``path`` and never the temporary name."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise OSError(f"cannot write {path}: is a directory")
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = make_temp(path)
    except OSError as exc:
        raise write_error(path, exc) from None
    try:
        os.chmod(tmp, user_mode())
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)  # the writer closed it; make its bytes durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as exc:
        if os.path.exists(tmp):
            os.remove(tmp)
        if is_write_failure(exc):
            raise write_error(path, exc) from None
        raise
    try:  # make the rename itself durable (not every file system allows it)
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def is_write_failure(exc: BaseException) -> bool:
    """True for an error of the file system: an OSError, or a library's RuntimeError whose
    text carries an errno (h5py reports a full disk as ``RuntimeError: ... errno = 28``)."""
    return isinstance(exc, OSError) or (isinstance(exc, RuntimeError) and _buried_errno(exc) is not None)


@contextmanager
def atomic_h5(path: str, *, streamed: bool = False):
    """Yield an ``h5py.File`` open for writing, then write it to ``path`` as
    :func:`atomic_file` does (a temporary beside ``path`` renamed over it; the user's file
    mode; an error names ``path`` and leaves no temporary).

    By default the file is built in memory and its bytes are written in one go: HDF5 never
    meets the disk, so a full disk is a plain OSError of that one write. (A write that fails
    inside HDF5 leaves the library's state for that file broken: it can neither flush nor
    close it, even through ``/dev/null``, and the interpreter crashes at exit.) That holds the
    whole file in memory once, which suits models, checkpoints and maps. ``streamed=True``
    writes through HDF5 to the temporary as it goes, for files too large for memory (layout
    files): a failure there is caught as well as it can be (:func:`_abandon`,
    :func:`_collect_hdf5_failures`), but may still crash the interpreter at exit.
    """
    import io  # noqa: PLC0415

    import h5py  # noqa: PLC0415

    with atomic_file(path) as tmp:
        if not streamed:
            image = io.BytesIO()
            with h5py.File(image, "w") as f:
                yield f
            with open(tmp, "wb") as out:
                out.write(image.getbuffer())
            return
        failures = []
        with _collect_hdf5_failures(failures):
            f = h5py.File(tmp, "w")
            try:
                yield f
                f.flush()
                if failures:
                    raise failures[0]
            except BaseException:
                _abandon(f)
                raise
            f.close()
        if failures:
            raise failures[0]


@contextmanager
def _collect_hdf5_failures(found: list):
    """Collect in ``found`` the file-system failures (:func:`is_write_failure`) that reach
    ``sys.excepthook`` or ``sys.unraisablehook`` meanwhile (h5py's errors in ``__dealloc__``);
    any other error goes to the hook as before."""
    previous_hook, previous_unraisable = sys.excepthook, sys.unraisablehook

    def excepthook(kind, exc, tb):
        if is_write_failure(exc):
            found.append(exc)
        else:
            previous_hook(kind, exc, tb)

    def unraisablehook(info):
        if is_write_failure(info.exc_value):
            found.append(info.exc_value)
        else:
            previous_unraisable(info)

    sys.excepthook, sys.unraisablehook = excepthook, unraisablehook
    try:
        yield
    finally:
        sys.excepthook, sys.unraisablehook = previous_hook, previous_unraisable


def _abandon(f) -> None:
    """Close an ``h5py.File`` whose writes failed, discarding what it still holds: its
    descriptor is redirected to ``/dev/null``, so the library's final flush succeeds."""
    try:
        handle = f.id.get_vfd_handle()
        if isinstance(handle, int) and handle >= 0:
            sink = os.open(os.devnull, os.O_RDWR)
            os.dup2(sink, handle)
            os.close(sink)
    except Exception:  # not the POSIX driver, or already closed: close as it is
        pass
    try:
        f.close()
    except Exception:
        pass


def is_temp_of(name: str, target: str) -> bool:
    """True iff file name ``name`` is a temporary of :func:`make_temp` for target ``target``
    (a base name)."""
    return re.fullmatch(re.escape("." + target + ".") + _RANDOM + re.escape(".tmp"), name) is not None


def remove_stale_temps(path: str) -> list[str]:
    """Remove the temporaries of ``path`` that an interrupted atomic write left in its folder;
    return the paths removed. Only names of :func:`make_temp`'s form for this target's name
    are touched: nothing else in the folder is."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    target = os.path.basename(path)
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in sorted(names):
        full = os.path.join(folder, name)
        if is_temp_of(name, target) and os.path.isfile(full) and not os.path.islink(full):
            try:
                os.remove(full)
                removed.append(full)
            except OSError:
                pass
    return removed


def _buried_errno(exc: BaseException) -> int | None:
    found = re.search(r"errno = (\d+)", str(exc))
    return int(found.group(1)) if found else None


#: the words for a file another process holds open, refused by HDF5's file locking
LOCKED = ("another process holds it open for writing (HDF5 file locking): close that process, "
          "or, if it has finished writing, run with HDF5_USE_FILE_LOCKING=FALSE")


def cause(exc: BaseException) -> str:
    """The operating system's words for ``exc`` ("No space left on device (ENOSPC)"), also
    when HDF5 buries the errno inside a longer message; what HDF5's own refusals mean (a file
    locked by another process, a truncated file); else the exception's first line."""
    text = str(exc).strip().splitlines()
    if text and text[0].startswith("cannot write "):  # already one of ours
        return text[0].split(": ", 1)[-1]
    whole = " ".join(text)
    if "unable to lock file" in whole:
        return LOCKED
    truncated = re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", whole)
    if truncated:
        return (f"the file is truncated: {truncated.group(1)} of its {truncated.group(2)} bytes "
                "(a copy or a write was cut short)")
    if "file signature not found" in whole:
        return "not an HDF5 file"
    number = getattr(exc, "errno", None)
    if not isinstance(number, int) or number <= 0:
        number = _buried_errno(exc)
    if number:
        return f"{os.strerror(number)} ({errno.errorcode.get(number, number)})"
    return text[0] if text else type(exc).__name__


def _probe(folder: str, target: str) -> None:
    """Create and remove a temporary file for ``target`` in ``folder`` (raises OSError)."""
    tmp = make_temp(os.path.join(folder, target))
    os.remove(tmp)


def check_output_file(option: str, path: str, *, create_folder: bool = True) -> list[str]:
    """Check that the file ``path`` (given as ``option``) can be written atomically: it is not
    a folder, its folder exists or can be created (with ``create_folder=False`` it must
    exist), and a temporary file can be created and removed there. Removes the stale
    temporaries of ``path``; returns their paths. Raises :class:`OutputError` naming
    ``option`` and ``path``."""
    if os.path.isdir(path):
        raise OutputError(f"{option} {path}: is a directory (give a file name)")
    folder = os.path.dirname(os.path.abspath(path))
    if create_folder:
        _make_folder(option, path, folder)
    elif not os.path.isdir(folder):
        raise OutputError(f"{option} {path}: folder {folder} does not exist")
    try:
        _probe(folder, os.path.basename(path))
    except OSError as exc:
        raise OutputError(f"{option} {path}: cannot write in {folder}: {cause(exc)}") from None
    return remove_stale_temps(path)


def check_output_folder(option: str, folder: str, targets=()) -> list[str]:
    """Check that ``folder`` (given as ``option``) is a folder, created if missing, in which a
    temporary file can be created and removed. Removes the stale temporaries of each file
    name in ``targets`` there; returns their paths. Raises :class:`OutputError`."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise OutputError(f"{option} {folder}: is a file, not a folder")
    _make_folder(option, folder, folder)
    try:
        _probe(folder, targets[0] if targets else "probe")
    except OSError as exc:
        raise OutputError(f"{option} {folder}: cannot write in this folder: {cause(exc)}") from None
    removed = []
    for target in targets:
        removed += remove_stale_temps(os.path.join(folder, target))
    return removed


def _make_folder(option: str, path: str, folder: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{option} {path}: {_first_file(folder)} is a file, not a folder") from None
    except OSError as exc:
        raise OutputError(f"{option} {path}: cannot create the folder {folder}: {cause(exc)}") from None


def _first_file(folder: str) -> str:
    """The first component of ``folder`` that exists and is not a folder."""
    parts = os.path.abspath(folder).split(os.sep)
    for i in range(2, len(parts) + 1):
        candidate = os.sep.join(parts[:i])
        if os.path.exists(candidate) and not os.path.isdir(candidate):
            return candidate
    return folder


def rescue_places(failed: str, name: str) -> list[str]:
    """Where a model goes when writing ``failed`` did not work: the working folder, then the
    system's temporary folder (each skipped when it is the failed file's own folder)."""
    own = os.path.dirname(os.path.abspath(failed))
    places = []
    for folder in (os.getcwd(), tempfile.gettempdir()):
        folder = os.path.abspath(folder)
        if folder != own and folder not in places:
            places.append(folder)
    return [os.path.join(folder, name) for folder in places]


def rescue_model(save, model, failed: str, exc: BaseException, what: str) -> str:
    """``save(path, model)`` to the first of :func:`rescue_places` that works, after writing
    ``failed`` (``what``: "the final model", "the checkpoint") raised ``exc``. Returns the
    message for the user: the failed path and its cause, and where the model is now."""
    name = f"mpidl-rescued-model.{os.getpid()}.h5"
    problems = []
    for place in rescue_places(failed, name):
        try:
            save(place, model)
        except (OSError, RuntimeError, ValueError) as again:
            problems.append(f"{place}: {cause(again)}")
            continue
        return (f"cannot write {what} to {failed}: {cause(exc)}; the trained model was saved to "
                f"{place} instead (mpidl.app.checkpoint.load_model reads it)")
    return (f"cannot write {what} to {failed}: {cause(exc)}; the trained model could not be saved "
            f"anywhere else either ({'; '.join(problems) or 'no other place'})")
