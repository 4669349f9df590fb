"""The tar archives that carry a task's files into its sandbox (`COPY`, `ADD`, the
task's `files/`), written to a file as they are read, never held in memory.

A task directory is untrusted: an `ADD` of a 1 MiB gzip can hold 1 GiB (or a tar header
that claims a 1 GiB name), and a `COPY` of a directory can hold anything. So the archive
is streamed, member by member, into a file the sandbox then unpacks, and a `Budget`
caps what it may carry: the bytes of its files (the task's storage) and its members.
Reading an `ADD`ed archive is capped as well, in decompressed bytes and in the size of
any one read (tarfile reads a whole PAX or GNU long-name header at once), so a bomb
costs at most the cap in decompression time and a few MiB of memory. Going over any
cap is a `TaskError` naming the Dockerfile line.

Each member keeps its mode (or `--chmod`'s) without setuid, setgid or sticky bits and
loses its owner; an `ADD`ed archive's members also pass tarfile's `data` filter (no
absolute names, no `..`, no links out, no devices).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import tarfile
import time
from pathlib import Path
from typing import IO, BinaryIO

from ridgeline.errors import TaskError

#: Members one archive may carry (files, directories, links).
MAX_MEMBERS = 100_000
#: The largest single read of an archive being unpacked (tar headers are read whole).
MAX_READ = 8 * 1024 * 1024
#: Decompressed bytes an archive may hold beyond its files' sizes (headers, padding).
HEADER_SLACK = 64 * 1024 * 1024

#: (host path or heredoc text, name in the archive, follow a top-level link)
Member = tuple["Path | str", str, bool]


class Budget:
    """What one archive may still carry; `add` raises `TaskError` past it."""

    def __init__(self, where: str, max_bytes: int, max_members: int = MAX_MEMBERS) -> None:
        self.where = where
        self.max_bytes = max_bytes
        self.max_members = max_members
        self.bytes = 0
        self.members = 0

    def add(self, ti: tarfile.TarInfo) -> None:
        self.members += 1
        if ti.isreg():
            self.bytes += ti.size
        if self.bytes > self.max_bytes:
            raise TaskError(f"{self.where}: the files to copy hold more than "
                            f"{self.max_bytes} bytes, the task's storage",
                            hint="make the archive or directory smaller, or raise "
                                 "storage_mb in task.toml / task.yaml")
        if self.members > self.max_members:
            raise TaskError(f"{self.where}: the files to copy are more than "
                            f"{self.max_members} entries",
                            hint="pack them into fewer files")

    def exceeded(self, what: str) -> TaskError:
        return TaskError(f"{self.where}: {what}",
                         hint="the archive is malformed or a decompression bomb; "
                              "repack it")


def with_mode(mode: int | None):
    """A member as the sandbox gets it: no owner, `mode` for files and directories when
    given, never setuid, setgid or sticky bits."""
    def apply(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        if mode is not None and (ti.isfile() or ti.isdir()):
            ti.mode = mode
        ti.mode &= 0o777
        return ti
    return apply


def write_members(out: BinaryIO, members: list[Member], mode: int | None,
                  budget: Budget) -> None:
    """Archive host files and heredoc texts into `out`. Directories are walked with an
    explicit stack (any depth); links inside them stay links."""
    fix = with_mode(mode)
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for src, name, follow in members:
            if isinstance(src, str):  # heredoc text
                body = src.encode()
                ti = tarfile.TarInfo(name)
                ti.size, ti.mode, ti.mtime = len(body), 0o644, int(time.time())
                budget.add(ti)
                tar.addfile(fix(ti), io.BytesIO(body))
                continue
            # A COPY source that is a link (the plan checked it stays in the context) is
            # copied as what it points to, as Docker does.
            stack = [(os.path.realpath(src) if follow else os.fspath(src), name)]
            while stack:
                path, arcname = stack.pop()
                ti = tar.gettarinfo(path, arcname=arcname)
                if ti is None:
                    continue  # a socket: tar skips it too
                budget.add(ti)
                if ti.isreg():
                    with open(path, "rb") as f:
                        tar.addfile(fix(ti), f)
                else:
                    tar.addfile(fix(ti))
                if ti.isdir():
                    stack.extend((os.path.join(path, c), f"{arcname}/{c}")
                                 for c in sorted(os.listdir(path), reverse=True))


def write_repacked(out: BinaryIO, archive: Path, mode: int | None, budget: Budget) -> None:
    """Re-pack the task's archive (tar, or tar compressed with gzip, bzip2 or xz) into
    `out`, each member through tarfile's "data" filter, within `budget`."""
    fix = with_mode(mode)
    with _open_capped(archive, budget) as raw, \
            tarfile.open(fileobj=raw, mode="r:") as src, \
            tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst:
        for member in src:
            budget.add(member)
            clean = tarfile.data_filter(member, "/nonexistent-ridgeline-dest")
            body = src.extractfile(member) if member.isfile() else None
            dst.addfile(fix(clean), body)
            src.members.clear()  # members are not looked back at: keep none in memory


def _open_capped(archive: Path, budget: Budget) -> "_Capped":
    with open(archive, "rb") as f:
        magic = f.read(6)
    if magic.startswith(b"\x1f\x8b"):
        stream: IO[bytes] = gzip.open(archive, "rb")
    elif magic.startswith(b"BZh"):
        stream = bz2.open(archive, "rb")
    elif magic.startswith(b"\xfd7zXZ\x00"):
        stream = lzma.open(archive, "rb")
    else:
        stream = open(archive, "rb")
    return _Capped(stream, budget)


class _Capped(io.RawIOBase):
    """The decompressed archive as tarfile reads it (read, seek forward, tell), refusing
    to go past the budget's bytes plus headers or to read too much at once."""

    def __init__(self, stream: IO[bytes], budget: Budget) -> None:
        self.stream = stream
        self.budget = budget

    def _check(self, end: int) -> None:
        if end > self.budget.max_bytes + HEADER_SLACK:
            raise self.budget.exceeded(f"the archive unpacks to more than "
                                       f"{self.budget.max_bytes + HEADER_SLACK} bytes")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > MAX_READ:
            raise self.budget.exceeded(f"the archive has a header or entry read of "
                                       f"more than {MAX_READ} bytes at once")
        self._check(self.stream.tell() + size)
        return self.stream.read(size)

    def readinto(self, b) -> int:  # type: ignore[override]
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self.stream.tell()

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        target = pos if whence == io.SEEK_SET else (
            self.stream.tell() + pos if whence == io.SEEK_CUR else None)
        if target is None:
            raise io.UnsupportedOperation("seek from the end of an archive")
        self._check(target)
        return self.stream.seek(target)

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            super().close()
