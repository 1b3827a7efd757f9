"""A small tmpfs mounted for one test: a full or a read-only disk, for real.

``with small_disk(folder, size="8k") as disk:`` mounts a tmpfs of ``size`` on ``folder``
(created) and unmounts it afterwards, also when the test fails; ``readonly=True`` mounts it
read-only. The test is skipped when it cannot mount (not root, no mount namespace rights).
"""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(folder, size: str = "8k", readonly: bool = False):
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    options = f"size={size}" + (",ro" if readonly else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(disk, leave_bytes: int) -> None:
    """Write a filler file so that about ``leave_bytes`` stay free on ``disk``."""
    stat = os.statvfs(disk)
    free = stat.f_bavail * stat.f_frsize
    with open(Path(disk) / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave_bytes))
