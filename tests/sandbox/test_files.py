"""The files API: confined to the workspace, whatever paths and symlinks say."""

from __future__ import annotations

import os

import pytest

from ridgeline.errors import NotFoundError, PathEscapeError, SandboxError
from ridgeline.sandbox import Limits, SandboxSpec, create_sandbox

from tests.helpers.sandbox_helpers import needs_bwrap

pytestmark = needs_bwrap


def test_write_read_list_relative_and_absolute(make_sandbox):
    sb = make_sandbox(workspace_path="/app")
    sb.write_file("src/main.py", "print('hi')\n")
    sb.write_file("/app/data.bin", b"\x00\xff", mode=0o600)
    assert sb.read_file("/app/src/main.py") == b"print('hi')\n"
    assert sb.read_file("data.bin") == b"\x00\xff"
    assert sb.read_file("src/main.py", max_bytes=5) == b"print"
    assert sb.list_files() == ["data.bin", "src/"]
    assert sb.list_files("/app", recursive=True) == ["data.bin", "src/", "src/main.py"]
    assert oct(os.stat(sb.workspace_dir / "data.bin").st_mode & 0o777) == "0o600"
    # the sandbox sees the same files at /app, and the files API sees what it writes
    assert sb.run("python3 src/main.py").stdout == "hi\n"
    sb.run("echo from-inside > /app/src/out.txt")
    assert sb.read_file("src/out.txt") == b"from-inside\n"


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "a/../../x",
                                  "/workspace/../etc/passwd", "/workspacex/y"])
def test_path_traversal_is_refused(sandbox, path):
    with pytest.raises(PathEscapeError):
        sandbox.read_file(path)
    with pytest.raises(PathEscapeError):
        sandbox.write_file(path, "x")


def test_symlink_escapes_are_refused(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    # Links planted from inside, pointing at host paths (absolute and relative).
    sandbox.run(f"ln -s {secret} abs; ln -s ../../../../../../{str(secret).lstrip('/')} rel; "
                f"ln -s /etc etcdir; ln -s {tmp_path} hostdir")
    for path in ("abs", "rel", "etcdir/passwd", "hostdir/secret.txt"):
        with pytest.raises(PathEscapeError):
            sandbox.read_file(path)
        with pytest.raises(PathEscapeError):
            sandbox.write_file(path, "overwritten")
    assert secret.read_text() == "host secret"
    with pytest.raises(PathEscapeError):
        sandbox.list_files("etcdir")


def test_symlinks_inside_the_workspace_are_followed(sandbox):
    sandbox.run("mkdir -p real && echo data > real/f && ln -s real alias && "
                "ln -s /workspace/real/f absolute-inside")
    assert sandbox.read_file("alias/f") == b"data\n"
    assert sandbox.read_file("absolute-inside") == b"data\n"
    sandbox.write_file("alias/g", "via link")
    assert (sandbox.workspace_dir / "real" / "g").read_text() == "via link"


def test_errors_are_clear(sandbox):
    with pytest.raises(NotFoundError):
        sandbox.read_file("missing.txt")
    sandbox.run("mkdir d && mkfifo pipe")
    with pytest.raises(SandboxError, match="directory"):
        sandbox.read_file("d")
    with pytest.raises(SandboxError, match="regular file"):
        sandbox.read_file("pipe")  # would block the host forever if opened blindly
    with pytest.raises(SandboxError):
        sandbox.write_file("d", "x")


def test_huge_file_is_refused_with_the_limit_named():
    with create_sandbox(SandboxSpec(limits=Limits(max_file_size_bytes=1 << 20))) as sb:
        with pytest.raises(SandboxError, match="max_file_size_bytes"):
            sb.write_file("big.bin", b"\0" * (2 << 20))
        assert not (sb.workspace_dir / "big.bin").exists()
        sb.write_file("ok.bin", b"\0" * (1 << 20))


def test_random_paths_never_leave_the_workspace(tmp_path):
    """Whatever mix of names, '..', '.', '/' and symlinks: a write lands inside the
    workspace or is refused; nothing outside is ever touched."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ridgeline.sandbox.workspace import Workspace

    ws_dir = tmp_path / "ws"
    ws_dir.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (ws_dir / "in").mkdir()
    os.symlink("../outside", ws_dir / "up")          # relative, leads out
    os.symlink(str(outside), ws_dir / "abs")         # absolute host path
    os.symlink("/app/in", ws_dir / "inner")          # absolute sandbox path, inside
    ws = Workspace(ws_dir, "/app", max_file_size=None)
    parts = st.sampled_from(["..", ".", "a", "in", "up", "abs", "inner", "", "app"])

    @settings(max_examples=200, deadline=None)
    @given(st.lists(parts, min_size=1, max_size=6), st.booleans())
    def check(components, absolute):
        path = ("/app/" if absolute else "") + "/".join(components)
        try:
            ws.write_file(path, "x")
        except (PathEscapeError, SandboxError, NotFoundError, IsADirectoryError):
            pass
        assert list(outside.iterdir()) == []

    check()
