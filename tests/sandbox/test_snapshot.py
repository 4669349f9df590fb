"""Snapshots return the workspace byte for byte, whatever happened since."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from ridgeline.errors import NotFoundError
from ridgeline.sandbox import snapshot as snapshots

from tests.helpers.sandbox_helpers import needs_bwrap

pytestmark = needs_bwrap


def tree(root: Path) -> dict[str, tuple]:
    """Everything that must come back: kinds, contents, modes, link targets."""
    out = {}
    for rel, st in snapshots.scan(root).items():
        p = root / rel
        if stat.S_ISLNK(st.st_mode):
            out[rel] = ("l", os.readlink(p))
        elif stat.S_ISDIR(st.st_mode):
            out[rel] = ("d", stat.S_IMODE(st.st_mode))
        elif not stat.S_ISREG(st.st_mode):
            out[rel] = ("special", stat.S_IFMT(st.st_mode))
        else:
            out[rel] = ("f", stat.S_IMODE(st.st_mode), hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def populate(sb):
    sb.run("mkdir -p src/pkg docs && for i in $(seq 30); do head -c $((i*100)) /dev/urandom "
           "> src/pkg/f$i.bin; done && echo readme > docs/README && ln -s docs/README link && "
           "chmod 600 src/pkg/f1.bin && printf '\\xff\\x00' > binary")


def mutate(sb):
    sb.run("echo changed > src/pkg/f2.bin; printf X | dd of=src/pkg/f3.bin bs=1 seek=5 "
           "conv=notrunc 2>/dev/null; rm src/pkg/f4.bin; rm -r docs; mkdir -p new/deep; "
           "echo n > new/deep/file; chmod 755 src/pkg/f1.bin; rm link; ln -s /etc/passwd link; "
           "touch -d 2001-01-01 src/pkg/f5.bin; mkfifo fifo")


def test_restore_undoes_adds_changes_deletes(sandbox):
    populate(sandbox)
    before = tree(sandbox.workspace_dir)
    snap = sandbox.snapshot()
    mutate(sandbox)
    assert tree(sandbox.workspace_dir) != before
    sandbox.restore(snap)
    assert tree(sandbox.workspace_dir) == before
    # the sandbox sees the restored files, and a second round works as well
    assert sandbox.run("cat docs/README").stdout == "readme\n"
    mutate(sandbox)
    sandbox.restore(snap)
    assert tree(sandbox.workspace_dir) == before


def test_several_snapshots_and_unknown_ids(sandbox):
    sandbox.write_file("a.txt", "1")
    s1 = sandbox.snapshot()
    sandbox.write_file("a.txt", "2")
    sandbox.write_file("b.txt", "b")
    s2 = sandbox.snapshot()
    sandbox.write_file("a.txt", "3")
    sandbox.restore(s1)
    assert sandbox.list_files() == ["a.txt"] and sandbox.read_file("a.txt") == b"1"
    sandbox.restore(s2)
    assert sandbox.read_file("a.txt") == b"2" and sandbox.read_file("b.txt") == b"b"
    with pytest.raises(NotFoundError):
        sandbox.restore("no-such-snapshot")


def test_in_place_edit_in_the_same_instant_is_still_restored(sandbox, monkeypatch):
    """A same-size in-place write right after the snapshot must not be missed even where
    ctime is coarse (forced here): such files are always copied back."""
    sandbox.write_file("f.txt", "aaaa")
    monkeypatch.setattr(snapshots, "fine_grained_ctime", lambda d: False)
    snap = sandbox.snapshot()
    with open(sandbox.workspace_dir / "f.txt", "r+") as f:
        f.write("bbbb")
    sandbox.restore(snap)
    assert sandbox.read_file("f.txt") == b"aaaa"


def test_restore_does_not_follow_planted_symlinks(sandbox, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    sandbox.run("mkdir d && echo 1 > d/f")
    snap = sandbox.snapshot()
    # Replace the directory by a link to a host directory; restore must not write there.
    sandbox.run(f"rm -r d && ln -s {outside} d")
    sandbox.restore(snap)
    assert list(outside.iterdir()) == []
    assert sandbox.read_file("d/f") == b"1\n"
