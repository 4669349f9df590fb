"""The workspace seen from the host: the directory that backs it, and the files API
(`write_file`, `read_file`, `list_files`) confined to it.

Sandboxed code can plant symlinks and race us, and the host side runs as root, so paths
are never resolved by the kernel in one go: each component is opened relative to its
parent's descriptor with O_NOFOLLOW, and symlinks are resolved here, by hand, the way
the sandbox would see them (an absolute target is a path *inside* the sandbox). Anything
that leads outside the workspace raises `PathEscapeError`.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from pathlib import Path

from ridgeline.errors import NotFoundError, PathEscapeError, SandboxError
from ridgeline.sandbox import disk
from ridgeline.sandbox.hostfs import read_bounded

MAX_SYMLINKS = 40
#: A listing stops (SandboxError) past this many characters of paths or levels: a deep
#: or wide tree left by the sandbox must not make the host build an unbounded list or
#: hold a descriptor per level past its open-file limit.
MAX_LISTING_CHARS = 64 * 1024 * 1024
MAX_LISTING_DEPTH = 256
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Workspace:
    """Files API over the host directory `host_dir`, mounted at `sandbox_path` inside."""

    def __init__(self, host_dir: Path, sandbox_path: str, max_file_size: int | None,
                 owner: tuple[int, int] | None = None) -> None:
        self.host_dir = host_dir
        self.sandbox_path = sandbox_path
        self.max_file_size = max_file_size
        #: Host (uid, gid) given to what the host creates here, so the sandbox owns it.
        self.owner = owner

    def _own(self, fd: int) -> None:
        if self.owner is not None:
            os.fchown(fd, *self.owner)

    # -- paths ---------------------------------------------------------------------------
    def relative(self, path: str) -> list[str]:
        """Components of `path` (relative to the workspace, or absolute inside it) after
        lexical normalisation; `..` that climbs out is refused."""
        if not isinstance(path, str) or "\0" in path:
            raise SandboxError(f"invalid path {path!r}")
        if path.startswith("/"):
            norm = posixpath.normpath(path)
            root = self.sandbox_path
            if norm == root:
                return []
            if not norm.startswith(root.rstrip("/") + "/"):
                raise PathEscapeError(f"{path} is outside the workspace {root}",
                                      hint=f"use a path under {root} or a relative path")
            path = norm[len(root):]
        parts: list[str] = []
        for p in path.split("/"):
            if p in ("", "."):
                continue
            if p == "..":
                if not parts:
                    raise PathEscapeError(f"{path} leads outside the workspace "
                                          f"{self.sandbox_path}")
                parts.pop()
            else:
                parts.append(p)
        return parts

    def _open_parent(self, path: str, create: bool) -> tuple[int, str]:
        """A descriptor of the directory that holds the last component of `path`
        (symlinks resolved inside the workspace), and that component's name."""
        return self._resolve(path, create_parents=create, follow_last=True)

    def _resolve(self, path: str, *, create_parents: bool, follow_last: bool
                 ) -> tuple[int, str]:
        parts = self.relative(path)
        if not parts:
            raise SandboxError(f"{path!r} is the workspace directory itself, not a file")
        stack = [os.open(self.host_dir, _DIR_FLAGS)]
        hops = 0
        try:
            while True:
                name = parts.pop(0)
                if name == "..":
                    if len(stack) == 1:
                        raise PathEscapeError(f"{path} leads outside the workspace "
                                              f"{self.sandbox_path} through a symlink")
                    os.close(stack.pop())
                    continue
                if name == ".":
                    continue
                last = not parts
                link = _readlink(stack[-1], name)
                if link is not None and (not last or follow_last):
                    hops += 1
                    if hops > MAX_SYMLINKS:
                        raise SandboxError(f"{path}: too many levels of symlinks")
                    if link.startswith("/"):
                        # Absolute targets are sandbox paths: only the workspace counts.
                        try:
                            new = self.relative(link)
                        except PathEscapeError:
                            raise PathEscapeError(
                                f"{path} is a symlink (via {name!r} -> {link}) that leads "
                                f"outside the workspace {self.sandbox_path}") from None
                        for fd in stack[1:]:
                            os.close(fd)
                        del stack[1:]
                        parts = new + parts
                    else:
                        parts = [p for p in link.split("/") if p] + parts
                    if not parts:
                        raise SandboxError(f"{path} resolves to the workspace directory")
                    continue
                if last:
                    fd = stack.pop()
                    for other in stack:
                        os.close(other)
                    stack = []
                    return fd, name
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=stack[-1])
                except FileNotFoundError:
                    if not create_parents:
                        raise NotFoundError(f"{path}: no such file or directory in the "
                                            "workspace") from None
                    os.mkdir(name, 0o755, dir_fd=stack[-1])
                    fd = os.open(name, _DIR_FLAGS, dir_fd=stack[-1])
                    self._own(fd)
                except NotADirectoryError:
                    raise SandboxError(f"{path}: {name!r} is not a directory") from None
                stack.append(fd)
        finally:
            for fd in stack:
                os.close(fd)

    # -- files API -----------------------------------------------------------------------
    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        if isinstance(data, str):
            data = data.encode("utf-8")
        if self.max_file_size is not None and len(data) > self.max_file_size:
            raise SandboxError(
                f"{path}: {len(data)} bytes is over the sandbox's file size limit of "
                f"{self.max_file_size} bytes", hint="raise limits.max_file_size_bytes")
        dfd, name = self._open_parent(path, create=True)
        try:
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                             | os.O_CLOEXEC | os.O_NONBLOCK, mode & 0o7777, dir_fd=dfd)
            except IsADirectoryError:
                raise SandboxError(f"{path} is a directory") from None
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENXIO):
                    raise SandboxError(f"{path} is not a regular file") from None
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise SandboxError(f"{path} is not a regular file")
                self._own(fd)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, mode & 0o7777)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    def make_dirs(self, path: str) -> None:
        """Create the directory `path` and its parents (owned by the sandbox)."""
        dfd, name = self._open_parent(path, create=True)
        try:
            try:
                os.mkdir(name, 0o755, dir_fd=dfd)
                created = True
            except FileExistsError:
                created = False
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
            except OSError as e:
                if isinstance(e, NotADirectoryError) or e.errno == errno.ELOOP:
                    raise SandboxError(f"{path} exists and is not a directory") from None
                raise
            try:
                if created:
                    self._own(fd)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        dfd, name = self._open_parent(path, create=False)
        try:
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                             dir_fd=dfd)
            except FileNotFoundError:
                raise NotFoundError(f"{path}: no such file in the workspace") from None
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                raise SandboxError(f"{path} is a directory", hint="use list_files")
            if not stat.S_ISREG(st.st_mode):
                raise SandboxError(f"{path} is not a regular file")
            return read_bounded(fd, st.st_size if max_bytes is None
                                else min(max_bytes, st.st_size))
        finally:
            os.close(fd)

    def list_files(self, path: str = ".", recursive: bool = False) -> list[str]:
        """Entries of the directory `path`, sorted; directories end with '/'. With
        `recursive`, every entry below it as a path relative to `path` (symlinks are
        listed, never followed)."""
        if self.relative(path):
            dfd, name = self._open_parent(path, create=False)
            try:
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=dfd)
                except FileNotFoundError:
                    raise NotFoundError(f"{path}: no such directory in the workspace") from None
                except (NotADirectoryError, OSError) as e:
                    if isinstance(e, NotADirectoryError) or e.errno == errno.ELOOP:
                        raise SandboxError(f"{path} is not a directory") from None
                    raise
            finally:
                os.close(dfd)
        else:
            fd = os.open(self.host_dir, _DIR_FLAGS)
        try:
            return sorted(_list(fd, recursive, path))
        finally:
            os.close(fd)


def _readlink(dir_fd: int, name: str) -> str | None:
    try:
        return os.readlink(name, dir_fd=dir_fd)
    except (FileNotFoundError, OSError) as e:
        if isinstance(e, FileNotFoundError) or e.errno == errno.EINVAL:
            return None
        raise


def _list(fd: int, recursive: bool, path: str) -> list[str]:
    # disk.walk: iterative, relative to O_NOFOLLOW descriptors, skips what vanishes.
    entries = disk.walk(fd) if recursive else _entries(fd)
    out: list[str] = []
    size = 0
    for rel, st in entries:
        out.append(f"{rel}/" if stat.S_ISDIR(st.st_mode) else rel)
        size += len(rel) + 1
        if size > MAX_LISTING_CHARS or rel.count("/") >= MAX_LISTING_DEPTH:
            what = (f"deeper than {MAX_LISTING_DEPTH} levels"
                    if rel.count("/") >= MAX_LISTING_DEPTH
                    else f"over {MAX_LISTING_CHARS} characters of paths")
            raise SandboxError(f"cannot list {path}: the tree is {what}",
                               hint="list a subdirectory, or without recursive")
    return out


def _entries(fd: int):
    for name in os.listdir(fd):
        try:
            yield name, os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed since the listing
