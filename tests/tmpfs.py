"""A real, small tmpfs for the tests of a full store (mounting one needs root)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``mount`` (made), unmounted after; the test is skipped
    where it cannot be mounted (not root, no CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
