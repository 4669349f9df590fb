"""Sandbox.fork (sandbox/fork.py): n sandboxes from one prepared workspace, copy-on-write."""

from __future__ import annotations

import os

import pytest

from ridgeline.errors import ConfigError, SandboxError
from ridgeline.sandbox import Limits, Mount, SandboxSpec, create_sandbox

from tests.helpers.sandbox_helpers import needs_bwrap, needs_root

pytestmark = needs_bwrap


def _used_kib(sb) -> int:
    """What the fork's own filesystem holds (its volume, under the overlay)."""
    st = os.statvfs(sb.workspace_dir)
    return (st.f_blocks - st.f_bfree) * st.f_frsize // 1024


@needs_root
def test_forks_start_from_the_parent_and_copy_nothing_until_written():
    with create_sandbox(SandboxSpec(limits=Limits(disk_bytes=256 << 20))) as parent:
        assert parent.run("head -c 20000000 /dev/urandom > big && mkdir -p d/e && "
                          "echo hi > d/e/f && chmod 750 d && ln -s d/e/f link").ok
        before = parent.run("sha256sum big").stdout
        empty = create_sandbox(SandboxSpec(limits=Limits(disk_bytes=256 << 20)))
        baseline = _used_kib(empty)
        empty.close()
        kids = parent.fork(3)
        try:
            assert len({k.id for k in kids} | {parent.id}) == 4
            for i, k in enumerate(kids):
                assert k.run("sha256sum big").stdout == before
                assert k.run("cat link; stat -c %a d").stdout == "hi\n750\n"
                assert k.run("id -u").stdout.strip() == "1000"
                # Nothing of the 20 MB was copied: the fork's own disk holds metadata.
                assert _used_kib(k) - baseline < 512, (_used_kib(k), baseline)
                assert k.run(f"echo fork{i} > d/e/f && touch only-{i}").ok
            # Each fork's writes are its own; the parent is untouched.
            for i, k in enumerate(kids):
                assert k.run("cat d/e/f; ls only-*").stdout == f"fork{i}\nonly-{i}\n"
            assert parent.run("cat d/e/f; ls only-* 2>/dev/null").stdout == "hi\n"
            # A written file is copied up and counts against the fork's own quota.
            assert kids[0].run("echo more >> big").ok
            assert _used_kib(kids[0]) - baseline > 19000
            # The parent goes on writing without changing what a later fork sees.
            assert parent.run("echo later > d/e/f").ok
            late = parent.fork(1)[0]
            assert late.run("cat d/e/f").stdout == "later\n"
            late.close()
        finally:
            for k in kids:
                k.close()
        assert not any("fork" in n for n in os.listdir(parent.dir.parent)
                       if n.startswith(f"{os.getpid()}-"))


def test_fork_refuses_what_it_cannot_do(tmp_path):
    with create_sandbox(SandboxSpec(mounts=[Mount(source=tmp_path, target="/shared",
                                                  writable=True)])) as sb:
        with pytest.raises(SandboxError, match="writable mounts"):
            sb.fork(2)
        with pytest.raises(ConfigError, match="at least 1"):
            sb.fork(0)
