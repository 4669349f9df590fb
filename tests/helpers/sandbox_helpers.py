"""Helpers for the sandbox tests: skip markers, and a look at the host's /proc to check
that nothing is left behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap is not installed (apt-get install -y bubblewrap)")
def _cgroups() -> bool:
    from ridgeline.sandbox.cgroups import CgroupHost
    return CgroupHost.detect() is not None


needs_root = pytest.mark.skipif(not _cgroups(), reason="needs cgroup v1 memory/pids "
                                "controllers (root); rlimits alone cannot bound a sandbox")


def pids_in_namespace(pidns_inode: int) -> list[int]:
    """Host pids of every process whose pid namespace is `pidns_inode`."""
    want = f"pid:[{pidns_inode}]"
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") == want:
                out.append(int(entry))
        except OSError:
            continue
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""
