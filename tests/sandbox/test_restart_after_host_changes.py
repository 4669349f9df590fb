"""A running sandbox keeps working when the host files it binds are replaced: starting
another Ridgeline process rewrote the sandbox identity files (passwd, group) by rename,
and every sandbox of every other process then failed to restart ("Can't bind mount ...
No such file or directory"), which the verifier reported as an unhealthy sandbox."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ridgeline.sandbox import SandboxSpec, create_sandbox

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="staged binds are used as root")


def test_restart_after_another_process_starts():
    with create_sandbox(SandboxSpec()) as sb:
        subprocess.run([sys.executable, "-c", "from ridgeline.sandbox import create_sandbox, "
                        "SandboxSpec; create_sandbox(SandboxSpec()).close()"], check=True)
        sb.stop_processes()
        assert sb.run("id -un").stdout.strip() == "sandbox"


def test_restart_after_a_bound_file_is_replaced():
    with create_sandbox(SandboxSpec()) as sb:
        passwd = sb._p.identity / "passwd"
        for _ in range(2):
            shutil.copy(passwd, f"{passwd}.new")
            os.replace(f"{passwd}.new", passwd)   # a new inode at the same path
            sb.stop_processes()
            assert sb.run("id -un").stdout.strip() == "sandbox"
