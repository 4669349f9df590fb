"""Host-side file operations on trees a sandbox can write (its logs, staging mounts).

The host runs as root and the sandbox may have planted symlinks anywhere in such a
tree, so nothing here resolves a path string inside it: the tree's top is opened with
O_NOFOLLOW | O_DIRECTORY (it is the host's own directory, the bind-mount source, which
the sandbox cannot replace), and every entry below is reached relative to a directory
descriptor without following links. Reads accept regular files only and are bounded.

Deleting such a tree (`remove_tree`) is iterative and holds a bounded number of
descriptors whatever its depth or width: a sandbox can leave a chain of directories far
deeper than Python's recursion limit or the process's open-file limit (shutil.rmtree on
3.11/3.12 recurses and raises RecursionError there). Failures are collected and raised
once, as `CleanupError`, after everything removable was removed.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from pathlib import Path

from ridgeline.errors import SandboxError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: Directory descriptors `remove_tree` holds at most; deeper directories are moved up to
#: the top of the tree being removed (a rename inside it) and removed from there.
REMOVE_MAX_FDS = 32
#: Failures `remove_tree` describes in its error (the rest are only counted).
_MAX_REPORTED = 5
log = logging.getLogger(__name__)


class UnsafeEntryError(SandboxError):
    """An entry the host was asked to read or enter is a symlink or not a regular file."""


class CleanupError(SandboxError):
    """Part of a tree could not be deleted (what could be was)."""


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
    failed: list[CleanupError] = []
    try:
        for name in os.listdir(fd):
            try:
                remove_tree(fd, name)
            except CleanupError as e:
                failed.append(e)  # the other entries still go
    finally:
        os.close(fd)
    if failed:
        raise CleanupError(f"could not empty {path}: "
                           + "; ".join(e.message for e in failed[:_MAX_REPORTED]),
                           hint=failed[0].hint)


def remove_tree(parent: Path | str | int, name: str) -> None:
    """Delete the entry `name` of the directory `parent` (a path, or a descriptor that is
    left open) whatever it is: a file, a link (removed, never followed) or a directory
    tree of any depth and width. A missing entry is not an error. Mount points inside
    are not crossed (they and their parents stay). Everything that can be removed is;
    then `CleanupError` says what could not be."""
    pfd = parent if isinstance(parent, int) else open_dir(parent)
    failures = _Failures(str(name))
    try:
        _remove(pfd, name, failures)
    finally:
        if not isinstance(parent, int):
            os.close(pfd)
    failures.raise_if_any()


def remove_path(path: Path | str) -> None:
    """`remove_tree` of a host path (its parent is a trusted host directory)."""
    path = Path(path)
    remove_tree(path.parent, path.name)


def discard_tree(path: Path | str, what: str = "directory") -> bool:
    """`remove_path` for cleanup that must never fail its caller: an error is logged
    (the tree is left for a person or the next clean-up), never raised. Whether the
    tree is gone."""
    try:
        remove_path(path)
        return True
    except Exception as e:  # noqa: BLE001 - cleanup of leftovers: report, never crash
        log.warning("could not delete the %s %s: %s", what, path, e)
        return False


class _Failures:
    def __init__(self, top: str) -> None:
        self.top = top
        self.count = 0
        self.first: list[str] = []

    def add(self, rel: str, e: OSError) -> None:
        self.count += 1
        if len(self.first) < _MAX_REPORTED:
            self.first.append(f"{rel}: {e.strerror or e}")

    def raise_if_any(self) -> None:
        if self.count:
            more = f" and {self.count - len(self.first)} more" if self.count > len(
                self.first) else ""
            raise CleanupError(f"could not delete {self.count} entries of {self.top} "
                               f"({'; '.join(self.first)}{more})",
                               hint="look for mounts or immutable files in that tree")


class _Frame:
    """A directory being emptied: its descriptor, its name in the frame below (its
    parent), the names still to remove and whether anything went since it was listed."""

    __slots__ = ("fd", "name", "rel", "names", "progress")

    def __init__(self, fd: int, name: str, rel: str) -> None:
        self.fd, self.name, self.rel = fd, name, rel
        self.names: list[str] | None = None
        self.progress = False


_GONE, _IS_DIR, _FAILED = range(3)


def _remove(pfd: int, name: str, failures: _Failures) -> None:
    if _unlink(pfd, name, name, failures) != _IS_DIR:
        return
    top = _enter(pfd, name, name, failures)
    if top is None:
        return
    dev = os.fstat(top).st_dev
    stack = [_Frame(top, name, name)]
    try:
        while stack:
            frame = stack[-1]
            if not frame.names:
                if frame.names is None or frame.progress:
                    frame.names, frame.progress = _listdir(frame, failures), False
                if not frame.names:  # empty, or nothing in it could be removed
                    stack.pop()
                    os.close(frame.fd)
                    below = stack[-1] if stack else None
                    if _rmdir(below.fd if below else pfd, frame, failures) and below:
                        below.progress = True  # only real progress earns a new listing
                    continue
            entry = frame.names.pop()
            rel = f"{frame.rel}/{entry}"
            kind = _unlink(frame.fd, entry, rel, failures)
            if kind == _GONE:
                frame.progress = True
            elif kind == _IS_DIR:
                if len(stack) >= REMOVE_MAX_FDS:
                    # Too deep to hold its descriptor: move it up to the top (a rename
                    # inside the tree being removed) and take it from there later.
                    new = f".ridgeline-rm-{secrets.token_hex(8)}"
                    try:
                        os.rename(entry, new, src_dir_fd=frame.fd, dst_dir_fd=stack[0].fd)
                    except OSError as e:
                        failures.add(rel, e)
                        continue
                    frame.progress = stack[0].progress = True
                    continue
                sub = _enter(frame.fd, entry, rel, failures)
                if sub is None:
                    continue
                if os.fstat(sub).st_dev != dev:
                    # A mount point: what is mounted there is not part of this tree.
                    os.close(sub)
                    failures.add(rel, OSError(errno.EXDEV, "a mount point (not crossed)"))
                    continue
                stack.append(_Frame(sub, entry, rel))
    finally:
        for frame in stack:
            os.close(frame.fd)


def _listdir(frame: _Frame, failures: _Failures) -> list[str]:
    try:
        return os.listdir(frame.fd)
    except OSError as e:
        failures.add(frame.rel, e)
        return []


def _unlink(dfd: int, name: str, rel: str, failures: _Failures) -> int:
    for attempt in range(2):
        try:
            os.unlink(name, dir_fd=dfd)
            return _GONE
        except FileNotFoundError:
            return _GONE
        except IsADirectoryError:  # Linux's answer for a directory
            return _IS_DIR
        except PermissionError as e:
            # A directory the sandbox made read-only (matters when we are not root).
            if attempt or not _make_writable(dfd):
                failures.add(rel, e)
                return _FAILED
        except OSError as e:
            failures.add(rel, e)
            return _FAILED
    return _FAILED


def _make_writable(fd: int) -> bool:
    try:
        st = os.fstat(fd)
        if stat.S_IMODE(st.st_mode) & 0o700 == 0o700:
            return False  # not the reason
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)
        return True
    except OSError:
        return False


def _enter(dfd: int, name: str, rel: str, failures: _Failures) -> int | None:
    for attempt in range(2):
        try:
            return os.open(name, _DIR, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and not attempt:
                # Swapped for a file or a link since it was found to be a directory.
                if _unlink(dfd, name, rel, failures) != _IS_DIR:
                    return None
                continue
            if e.errno in (errno.EACCES, errno.EPERM) and not attempt and _chmod_dir(dfd, name):
                continue  # a directory with mode 000
            failures.add(rel, e)
            return None
    return None


def _chmod_dir(dfd: int, name: str) -> bool:
    """Give the directory `name` (never a link: an O_PATH descriptor, changed through
    /proc/self/fd) its owner's full access."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC,
                     dir_fd=dfd)
    except OSError:
        return False
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _rmdir(pfd: int, frame: _Frame, failures: _Failures) -> bool:
    try:
        os.rmdir(frame.name, dir_fd=pfd)
    except FileNotFoundError:
        pass
    except OSError as e:
        failures.add(frame.rel, e)
        return False
    return True


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
            remove_tree(pfd, name)
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
