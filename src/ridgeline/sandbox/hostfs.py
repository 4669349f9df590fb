"""Host-side file operations on trees a sandbox can write (its logs, staging mounts).

The host runs as root and the sandbox may have planted symlinks anywhere in such a
tree, so nothing here resolves a path string inside it: the tree's top is opened with
O_NOFOLLOW | O_DIRECTORY (it is the host's own directory, the bind-mount source, which
the sandbox cannot replace), and every entry below is reached relative to a directory
descriptor without following links. Reads accept regular files only and are bounded.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path

from ridgeline.errors import SandboxError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeEntryError(SandboxError):
    """An entry the host was asked to read or enter is a symlink or not a regular file."""


def open_dir(path: Path | str, name: str | None = None, dir_fd: int | None = None) -> int:
    """A descriptor of the directory `path` (or `name` inside `dir_fd`), never a link."""
    target = name if name is not None else path
    try:
        return os.open(target, _DIR, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeEntryError(f"{target} is a symlink or not a directory") from None
        raise


def clear_dir(path: Path | str) -> None:
    """Delete everything inside the directory `path`, which stays (it is a mount source).
    Links are removed, never followed."""
    fd = open_dir(path)
    try:
        for name in os.listdir(fd):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since the listing: nothing left to delete
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)  # fd-based and link-safe on Linux
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def fresh_dir(parent: Path | str, name: str, owner: tuple[int, int] | None,
              mode: int = 0o755) -> None:
    """Replace whatever `parent/name` is (a directory, a file, a link) with a new empty
    directory owned by `owner`. Call only while nothing runs in the sandbox."""
    pfd = open_dir(parent)
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None:
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=pfd)
            else:
                os.unlink(name, dir_fd=pfd)
        os.mkdir(name, mode, dir_fd=pfd)
        fd = open_dir(parent, name, dir_fd=pfd)
        try:
            if owner is not None:
                os.fchown(fd, *owner)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    finally:
        os.close(pfd)


def read_regular(parent: Path | str, parts: list[str], max_bytes: int) -> bytes | None:
    """The first `max_bytes` of the regular file `parent/parts...`, or None if it does
    not exist. Raises `UnsafeEntryError` if any component is a link (or the file is not
    a regular file): the host never reads through what the sandbox may have planted."""
    fd = open_dir(parent)
    try:
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            try:
                if last:
                    nfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                                  | os.O_CLOEXEC, dir_fd=fd)
                else:
                    nfd = open_dir(parent, name, dir_fd=fd)
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise UnsafeEntryError(f"{'/'.join(parts[:i + 1])} is a symlink") from None
                raise
            os.close(fd)
            fd = nfd
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeEntryError(f"{'/'.join(parts)} is not a regular file")
        return read_bounded(fd, max_bytes)
    finally:
        os.close(fd)


def read_bounded(fd: int, limit: int) -> bytes:
    """Up to `limit` bytes from an open file (fewer if it ends first)."""
    chunks, got = [], 0
    while got < limit:
        b = os.read(fd, min(limit - got, 1 << 20))
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)
