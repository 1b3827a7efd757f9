"""Output paths checked before any work, stale temporaries, write failures named, models rescued.

Disk-full is emulated two ways, both deterministic: a monkeypatched writer that raises
``OSError(ENOSPC)`` in-process, and, for a real HDF5 write failure, a subprocess whose file
size limit (``RLIMIT_FSIZE``; Python ignores SIGXFSZ, so a write past it fails with EFBIG
exactly where a full disk fails with ENOSPC) is smaller than the file it writes.
"""

import errno
import os
import resource
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import mpidl.app.outputs as outputs
from mpidl.app.checkpoint import load_model
from mpidl.app.outputs import OutputError, check_output_file, check_output_folder

ROOT = Path(__file__).resolve().parents[1]


def tmp_files(folder):
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))


# ---------------------------------------------------------------- set-up checks
def test_a_writable_file_passes_and_leaves_nothing(tmp_path):
    assert check_output_file("--save", str(tmp_path / "sub" / "model.h5")) == []
    assert os.listdir(tmp_path / "sub") == []  # the folder is made, the probe removed


@pytest.mark.parametrize("target, message", [
    ("/proc/x", "--save /proc/x: cannot write in /proc"),
    ("/proc/nope/x.h5", "--save /proc/nope/x.h5: cannot create the folder /proc/nope"),
])
def test_an_unwritable_file_is_refused(target, message):
    with pytest.raises(OutputError, match=message):
        check_output_file("--save", target)


def test_a_folder_given_as_a_file_is_refused(tmp_path):
    with pytest.raises(OutputError, match=f"--save {tmp_path}: is a directory"):
        check_output_file("--save", str(tmp_path))


def test_a_file_under_a_file_is_refused(tmp_path):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(OutputError, match="plain is a file, not a folder"):
        check_output_file("--metrics", str(tmp_path / "plain" / "m.jsonl"))


def test_checkpoint_folder_checks(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="--checkpoint .*file: is a file, not a folder"):
        check_output_folder("--checkpoint", str(tmp_path / "file"))
    with pytest.raises(OutputError, match="--checkpoint /proc/x: cannot create the folder /proc/x"):
        check_output_folder("--checkpoint", "/proc/x")
    new = tmp_path / "a" / "b"
    check_output_folder("--checkpoint", str(new), ["checkpoint.h5"])
    assert new.is_dir() and os.listdir(new) == []


# ---------------------------------------------------------------- stale temporaries
def test_only_our_own_stale_temporaries_are_removed(tmp_path):
    ours = [".checkpoint.h5.abcd_123.tmp", ".checkpoint.h5.zz99yy88.tmp"]
    others = [".checkpoint.h5.toolong12.tmp", ".checkpoint.h5.short.tmp", "checkpoint.h5.abcd1234.tmp",
              ".model.h5.abcd1234.tmp", "notes.tmp", ".checkpoint.h5.abcd1234.tmp.keep"]
    for name in ours + others:
        (tmp_path / name).write_text("x")
    removed = check_output_folder("--checkpoint", str(tmp_path), ["checkpoint.h5"])
    assert sorted(os.path.basename(p) for p in removed) == sorted(ours)
    assert sorted(os.listdir(tmp_path)) == sorted(others)


def test_the_writers_temporaries_are_recognised(tmp_path):
    tmp = outputs.make_temp(str(tmp_path / "checkpoint.h5"))
    assert outputs.is_temp_of(os.path.basename(tmp), "checkpoint.h5")
    assert outputs.remove_stale_temps(str(tmp_path / "checkpoint.h5")) == [tmp]


# ---------------------------------------------------------------- failures named
def test_cause_finds_the_errno_hdf5_buries():
    text = ("[Errno 27] Can't synchronously write data (file write failed: time = x, filename = "
            "'/d/.s.h5.5jfkxgl2.tmp', file descriptor = 3, errno = 28, error message = 'No space')")
    assert outputs.cause(RuntimeError(text)) == "No space left on device (ENOSPC)"
    assert outputs.cause(OSError(errno.EACCES, "x")) == "Permission denied (EACCES)"


def test_atomic_write_errors_name_the_target_not_the_temporary(tmp_path):
    target = tmp_path / "m.h5"
    with pytest.raises(OSError) as info:
        with outputs.atomic_h5(str(target)) as f:
            f["a"] = np.zeros(3)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(info.value) == f"cannot write {target}: No space left on device (ENOSPC)"
    assert info.value.errno == errno.ENOSPC and os.listdir(tmp_path) == []


def test_rescue_goes_to_the_working_folder(tmp_path, monkeypatch):
    from mpidl.app.checkpoint import save_model
    from mpidl.engine.models import build_model

    monkeypatch.chdir(tmp_path)
    model = build_model("hsicnn", (4, 5, 5), 3, seed=1, channels=(4, 4), hidden=8)
    failed = "/nonexistent/full/model.h5"
    message = outputs.rescue_model(save_model, model, failed, OSError(errno.ENOSPC, "full"), "the final model")
    rescued = tmp_path / f"mpidl-rescued-model.{os.getpid()}.h5"
    assert message == (f"cannot write the final model to {failed}: No space left on device (ENOSPC); "
                       f"the trained model was saved to {rescued} instead (mpidl.app.checkpoint.load_model reads it)")
    np.testing.assert_array_equal(load_model(str(rescued)).params.data, model.params.data)


# ---------------------------------------------------------------- converter output
def data_tools(args, fsize=None):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-m", "mpidl.data_tools", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, preexec_fn=limit if fsize else None)


def test_converter_disk_full_is_one_error_naming_the_output(tmp_path):
    """Before: the error, then an h5py exception, then a segfault (exit 139) with the
    temporary file removed while HDF5 still held it open."""
    out = tmp_path / "s.h5"
    proc = data_tools(["synthetic", "--out", str(out)], fsize=200_000)
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert proc.stderr == f"error: cannot write {out}: File too large (EFBIG)\n"
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("where, message", [
    ("dir", "--out {tmp}: is a directory (give a file name)"),
    ("/proc/x.h5", "--out /proc/x.h5: cannot write in /proc"),
])
def test_converter_out_is_checked_first(tmp_path, where, message):
    out = str(tmp_path) if where == "dir" else where
    proc = data_tools(["synthetic", "--out", out])
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: " + message.format(tmp=tmp_path)), proc.stderr
    assert ".tmp" not in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(tmp_path) == []


def test_write_layout_names_the_path_for_a_directory(tmp_path):
    from mpidl.data.layout import write_layout

    x = np.zeros((4, 1, 3, 3), np.float32)
    with pytest.raises(OSError, match=f"cannot write {tmp_path}: is a directory"):
        write_layout(tmp_path, {"train": (x, np.arange(4) % 2), "test": (x, np.arange(4) % 2)}, ["a", "b"])


# ---------------------------------------------------------------- values in the data
def nan_file(path, where=(17, 40)):
    from mpidl.data.layout import write_layout

    rng = np.random.default_rng(0)
    x = rng.standard_normal((60, 2, 3, 3)).astype(np.float32)
    y = np.arange(60) % 2
    write_layout(path, {"train": (x, y), "test": (x[:10], y[:10])}, ["a", "b"])
    with h5py.File(path, "r+") as f:
        for i in where:
            f["train/x"][i, 0, 0, 0] = np.nan
        if where:
            f["train/x"][where[-1], 1, 1, 1] = np.inf
    return path


def test_scan_nonfinite_in_chunks(tmp_path):
    from mpidl.data.layout import scan_nonfinite

    path = nan_file(tmp_path / "nan.h5")
    assert scan_nonfinite(path, "train", block=7) == (2, 3, 17)
    assert scan_nonfinite(path, "train", start=20, block=7) == (1, 2, 40)
    assert scan_nonfinite(path, "train", stop=17) == (0, 0, None)
    assert scan_nonfinite(path, "test") == (0, 0, None)


def test_info_reports_nonfinite_values(tmp_path):
    path = nan_file(tmp_path / "nan.h5")
    proc = data_tools(["info", str(path)])
    assert proc.returncode == 1
    assert proc.stderr == (f"error: {path}: train/x holds non-finite values (NaN or Inf): 3 value(s) "
                           "in 2 sample(s), the first at sample 17\n")


def test_fingerprint_is_stored_and_verified(tmp_path):
    from mpidl.data.layout import file_fingerprint, stored_fingerprint

    path = nan_file(tmp_path / "d.h5", where=())
    assert stored_fingerprint(path) == file_fingerprint(path)
    assert data_tools(["info", str(path), "--verify"]).returncode == 0
    with h5py.File(path, "r+") as f:
        f["train/x"][3] += 1
    assert stored_fingerprint(path) != file_fingerprint(path)
    proc = data_tools(["info", str(path), "--verify"])
    assert proc.returncode == 1 and "fingerprint" in proc.stderr


# ---------------------------------------------------------------- the error reaches the user
def test_the_failing_rank_writes_its_message_once_before_mpi_abort(monkeypatch):
    """MPI_Abort may kill the process at once: the whole message must be written to the file
    descriptor (not left in a Python buffer) before it is called, and only once."""
    import mpidl.distributed.launch as launch

    events = []

    class World:
        def Get_rank(self):
            return 1

        def Get_size(self):
            return 4

        def Abort(self, code):
            events.append(("abort", code))

    class FakeMPI:
        COMM_WORLD = World()

    def fake_exit(code):
        events.append(("exit", code))
        raise SystemExit(code)

    monkeypatch.setattr(launch, "MPI", FakeMPI)
    monkeypatch.setattr(launch, "_reported", False)
    monkeypatch.setattr(launch.sys.stderr, "fileno", lambda: 2, raising=False)
    monkeypatch.setattr(launch, "_write_all", lambda fd, data: events.append(("write", fd, data)))
    monkeypatch.setattr(launch.os, "_exit", fake_exit)
    for _ in range(2):  # a second exception (say, while aborting) does not print again
        try:
            raise OSError("disk gone")
        except OSError as exc:
            with pytest.raises(SystemExit):
                launch.abort_on_uncaught_exception(OSError, exc, exc.__traceback__)
    # An Abort that returns (an MPI already failing) still ends the process at once, never
    # through Python's exit, whose MPI_Finalize would wait for the unreachable ranks.
    assert [e[0] for e in events] == ["write", "abort", "exit", "abort", "exit"]
    assert [e[1] for e in events if e[0] == "exit"] == [1, 1]
    first_line = events[0][2].split(b"\n")[0]
    assert events[0][1] == 2 and first_line.startswith(b"mpidl: rank 1 failed: OSError: disk gone (host ")
    assert first_line.endswith(f"pid {os.getpid()})".encode())
