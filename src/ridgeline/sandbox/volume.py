"""Per-sandbox filesystems: the disk quota is enforced by the kernel, at the write.

Why not measure: a watcher that walks the workspace and kills the sandbox when it is
over the limit misses what a walk cannot see or cannot finish. A file unlinked while
held open is in no directory (271 MiB written under a 50 MiB quota); `fallocate` takes
2 GB between two walks; a directory chain deeper than the harness's open-file limit
breaks the walk; and a walk counts bytes, not the inodes 300,000 empty files take.

So each sandbox's workspace is a filesystem of its own: a sparse ext4 image in the
sandbox's host directory (under the 0700 sandbox root), attached to a loop device and
mounted on the workspace directory. ext4 refuses every block and inode past its size
with ENOSPC, whether the file is linked or not, written, fallocated or a directory; the
host's disk holds at most the image. The image is sized so that what a process may use
(statvfs f_bavail) is `Limits.disk_bytes` (at most `SLACK` more); ext4's own metadata
comes on top and is allocated on the host only when used (lazy inode tables, which
`noinit_itable` keeps from being zeroed in the background). `Limits.disk_inodes` is
its inode count (ext4 rounds it up to whole inode-table blocks per block group, and it
is at most one per 4 KiB block).

Speed: mkfs runs once per (size, inodes) and machine; its result is a template of a
few hundred KiB of data, copied sparsely for each volume. The loop device is attached
with the LOOP_CONFIGURE ioctl and mounted with mount(2), in-process: no helper process.
Attaching and mounting still wait on the kernel (RCU grace periods, metadata reads:
~10-20 ms on a busy machine), so a background thread keeps `SPARES` volumes of the
last sizes used ready in the sandbox root (`.spare-<pid>-*`), and a sandbox's start
takes one with a mount move (MS_MOVE) and a rename; with none ready it makes its own.
At close the mount is detached from the namespace at once; the kernel's teardown
(writing back dirty pages, releasing the loop device) runs on a background thread that
drops the last reference, and the image is unlinked right away, so its blocks return
to the host when the loop device lets go of it (autoclear).

Only the host ever writes the image file (the sandbox sees the mounted filesystem, not
the file), so the kernel never parses an image a sandbox could have crafted.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import queue
import shutil
import stat
import struct
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ridgeline.errors import SandboxError
from ridgeline.sandbox import disk

LOOP_CONTROL = "/dev/loop-control"
BLOCK = 4096
INODE_SIZE = 256
#: What a process may use beyond disk_bytes: the image is sized to within this.
SLACK = 1024 * 1024
#: Smallest image made (ext4 works down to 64 blocks; a tiny disk_bytes is still a filesystem).
MIN_IMAGE = 256 * 1024
MS_NOSUID, MS_NODEV, MS_BIND, MS_MOVE = 2, 4, 4096, 8192
#: Volumes kept ready (attached and mounted) per size, so a sandbox's start only moves one.
SPARES = 2
SPARE_PREFIX = ".spare-"
MNT_DETACH = 2
MOUNT_DATA = "noinit_itable"
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A
LO_FLAGS_AUTOCLEAR = 4
log = logging.getLogger(__name__)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _mount(source: str | Path, target: Path, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    if _libc.mount(os.fsencode(source), os.fsencode(target),
                   None if fstype is None else fstype.encode(), flags,
                   None if data is None else data.encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _umount(target: Path | str, flags: int = 0) -> None:
    if _libc.umount2(str(target).encode(), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def _loop_attach(image: Path) -> tuple[str, int]:
    """A free loop device backed by `image` (autoclear: it detaches itself when the
    last user closes it). Returns the device path and an open descriptor of it, which
    the caller closes once the filesystem is mounted (or failed to mount)."""
    ctl = os.open(LOOP_CONTROL, os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(64):
            n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            dev = f"/dev/loop{n}"
            lfd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
            ffd = os.open(image, os.O_RDWR | os.O_CLOEXEC)
            # struct loop_config: u32 fd, u32 block_size, struct loop_info64, u64[8].
            info = struct.pack("=5Q4I64s64s32s2Q", 0, 0, 0, 0, 0, 0, 0, 0, LO_FLAGS_AUTOCLEAR,
                               os.fsencode(image.name)[:63], b"", b"", 0, 0)
            try:
                fcntl.ioctl(lfd, LOOP_CONFIGURE, struct.pack("=II", ffd, 0) + info + bytes(64))
            except OSError as e:
                os.close(lfd)
                if e.errno == errno.EBUSY:  # another thread or process took it first
                    continue
                raise
            finally:
                os.close(ffd)
            return dev, lfd
    finally:
        os.close(ctl)
    raise OSError(errno.EBUSY, "no free loop device after 64 tries")


def _mkfs() -> str | None:
    return shutil.which("mkfs.ext4") or next(
        (p for p in ("/sbin/mkfs.ext4", "/usr/sbin/mkfs.ext4") if os.access(p, os.X_OK)), None)


@dataclass(frozen=True)
class Template:
    path: Path
    usable: int   # bytes a process may use (statvfs f_bavail) on a fresh copy
    inodes: int   # inodes of the filesystem


class Templates:
    """Empty filesystems, one per (disk_bytes, disk_inodes), made once and kept in the
    sandbox root's `.images` (root-only, like the rest of it)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / ".images"
        with contextlib.suppress(FileExistsError):
            self.dir.mkdir(mode=0o700)
        st = self.dir.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise SandboxError(f"{self.dir} is not a directory owned by this user",
                               hint="remove it and try again")
        self.root = root
        self._made: dict[tuple[int, int], Template] = {}
        self._lock = threading.Lock()
        # Ready volumes per (size, inodes); the refill thread makes them.
        self._stock: dict[tuple[int, int], list[_Spare]] = {}
        self._asked: dict[tuple[int, int], int] = {}
        self._stock_lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def get(self, size: int, inodes: int) -> Template:
        key = (size, inodes)
        with self._lock:
            t = self._made.get(key)
            if t is None:
                t = self._made[key] = self._load(size, inodes) or self._make(size, inodes)
            return t

    def take(self, size: int, inodes: int) -> "_Spare | None":
        """A ready volume of this size, if one is in stock; asks for more either way."""
        key = (size, inodes)
        with self._stock_lock:
            # Stocked from a size's second use on: a one-off sandbox leaves no spares.
            self._asked[key] = self._asked.get(key, 0) + 1
            if self._asked[key] < 2:
                return None
            spares = self._stock.setdefault(key, [])
            spare = spares.pop() if spares else None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._refill, daemon=True,
                                                name="ridgeline-volume-stock")
                self._thread.start()
                atexit.register(self.close)
            self._stock_lock.notify_all()
        return spare

    def _refill(self) -> None:
        while True:
            with self._stock_lock:
                short = None
                while short is None and not self._closed:
                    short = next((k for k, v in self._stock.items() if len(v) < SPARES), None)
                    if short is None:
                        self._stock_lock.wait()
                if self._closed:
                    return
            try:
                spare = _Spare.make(self, *short)
            except Exception as e:  # noqa: BLE001 - the caller makes its own instead
                log.warning("could not prepare a spare sandbox volume: %s", e)
                with self._stock_lock:
                    self._stock.pop(short, None)  # not retried until asked again
                continue
            with self._stock_lock:
                if self._closed:
                    spare.discard()
                    return
                self._stock.setdefault(short, []).append(spare)

    def close(self) -> None:
        """Unmount the ready volumes (at exit)."""
        with self._stock_lock:
            self._closed = True
            spares = [s for v in self._stock.values() for s in v]
            self._stock.clear()
            self._stock_lock.notify_all()
        for spare in spares:
            spare.discard()

    def _name(self, size: int, inodes: int) -> Path:
        return self.dir / f"ext4-{size}-{inodes}"

    def _load(self, size: int, inodes: int) -> Template | None:
        base = self._name(size, inodes)
        try:
            usable, count = (int(x) for x in (base.with_suffix(".meta")).read_text().split())
        except (OSError, ValueError):
            return None
        img = base.with_suffix(".img")
        return Template(img, usable, count) if img.is_file() else None

    def _make(self, size: int, inodes: int) -> Template:
        """mkfs, then measure what a process may use on it and correct the image size
        until that is `size` (to within SLACK): ext4's overhead depends on the layout."""
        mkfs = _mkfs()
        if mkfs is None:
            raise SandboxError("mkfs.ext4 not found", hint="install it with "
                               "`apt-get install -y e2fsprogs`")
        base = self._name(size, inodes)
        tmp = base.with_name(f".{base.name}-{os.getpid()}-{threading.get_ident()}.img")
        image = max(MIN_IMAGE, _round(size + inodes * INODE_SIZE + min(size // 50, 1 << 24)
                                      + (size // (128 << 20) + 1) * 4 * BLOCK + (1 << 20)))
        try:
            best: tuple[int, int] | None = None  # (image, usable) with usable > size
            for _ in range(6):
                usable, count = _mkfs_and_measure(mkfs, tmp, image, inodes)
                if size <= usable <= size + SLACK or image == MIN_IMAGE and usable >= size:
                    break
                if usable > size and (best is None or usable < best[1]):
                    best = (image, usable)
                image = max(MIN_IMAGE, _round(image + size - usable + SLACK // 4))
            else:
                # Near a block group boundary the usable size jumps past the window
                # whichever way the image moves: the excess becomes blocks reserved for
                # host root, which no sandbox process can use.
                if best is None:
                    raise OSError(errno.EINVAL, f"could not size an ext4 image to {size} bytes")
                _mkfs_and_measure(mkfs, tmp, best[0], inodes)
                _tune2fs(tmp, "-r", str((best[1] - size) // BLOCK))
                usable, count = _prepare_fresh(tmp)
            img = base.with_suffix(".img")
            os.replace(tmp, img)
            meta = base.with_name(f".{base.name}-{os.getpid()}.meta")
            meta.write_text(f"{usable} {count}\n")
            os.replace(meta, base.with_suffix(".meta"))
            return Template(img, usable, count)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _mkfs_and_measure(mkfs: str, tmp: Path, image: int, inodes: int) -> tuple[int, int]:
    with open(tmp, "wb") as f:
        f.truncate(image)
    n = max(16, min(inodes, image // BLOCK))  # ext4: at most one inode per block
    _run([mkfs, "-q", "-F", "-b", str(BLOCK), "-I", str(INODE_SIZE), "-N", str(n), "-m", "0",
          "-O", "^has_journal,^resize_inode", "-E", "lazy_itable_init=1,nodiscard",
          "-L", "ridgeline", str(tmp)])
    return _prepare_fresh(tmp)


def _tune2fs(image: Path, *args: str) -> None:
    tool = shutil.which("tune2fs") or next(
        (p for p in ("/sbin/tune2fs", "/usr/sbin/tune2fs") if os.access(p, os.X_OK)), "tune2fs")
    _run([tool, *args, str(image)])


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True,
                          env={"PATH": os.environ.get("PATH", "") + ":/sbin:/usr/sbin"})
    if proc.returncode != 0:
        raise OSError(errno.EINVAL, f"{os.path.basename(argv[0])} failed: "
                      f"{(proc.stderr or proc.stdout).strip()[-300:]}")


def _round(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def _prepare_fresh(image: Path) -> tuple[int, int]:
    """Mount a fresh filesystem once: drop lost+found (the sandbox's workspace starts
    empty; nothing fscks these images) and measure it. Returns (usable bytes, inodes)."""
    point = image.with_suffix(".mnt")
    point.mkdir(mode=0o700, exist_ok=True)
    dev, lfd = _loop_attach(image)
    try:
        try:
            _mount(dev, point, "ext4", MS_NOSUID | MS_NODEV, MOUNT_DATA)
        finally:
            os.close(lfd)
        try:
            with contextlib.suppress(FileNotFoundError):
                (point / "lost+found").rmdir()
            os.chmod(point, 0o755)
            st = os.statvfs(point)
            return st.f_bavail * st.f_frsize, st.f_files
        finally:
            _umount(point)
    finally:
        with contextlib.suppress(OSError):
            point.rmdir()


@dataclass
class _Spare:
    """A volume made ahead: `dir` (in the sandbox root, named after this process so a
    crash is swept) holds the image and the mount point."""

    dir: Path
    image: Path
    point: Path

    @classmethod
    def make(cls, templates: Templates, size: int, inodes: int) -> "_Spare":
        d = templates.root / f"{SPARE_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        d.mkdir(mode=0o700)
        spare = cls(d, d / "disk.img", d / "mnt")
        spare.point.mkdir()
        try:
            _make_mounted(templates.get(size, inodes), spare.image, spare.point)
        except BaseException:
            shutil.rmtree(d, ignore_errors=True)
            raise
        return spare

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            _umount(self.point, MNT_DETACH)
        shutil.rmtree(self.dir, ignore_errors=True)  # nothing is mounted in it any more


def _make_mounted(template: Template, image: Path, point: Path) -> None:
    """A fresh copy of `template` at `image`, mounted on `point`."""
    src = os.open(template.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(image, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                      | os.O_CLOEXEC, 0o600)
        try:
            disk.copy_sparse(src, dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    try:
        dev, lfd = _loop_attach(image)
        try:
            _mount(dev, point, "ext4", MS_NOSUID | MS_NODEV, MOUNT_DATA)
        finally:
            os.close(lfd)  # after a failed mount this detaches the device (autoclear)
    except BaseException:
        image.unlink()
        raise


_by_point: dict[str, "Volume"] = {}
_by_point_lock = threading.Lock()


def mounted_at(path: Path) -> "Volume | None":
    """The live volume mounted on `path`, if any (so a quota reads its usage from the
    filesystem instead of walking it)."""
    with _by_point_lock:
        return _by_point.get(str(path)) or _by_point.get(os.path.realpath(path))


def _register(path: Path, vol: "Volume | None") -> None:
    with _by_point_lock:
        if vol is not None:
            _by_point[str(path)] = vol
        elif str(path) in _by_point:
            del _by_point[str(path)]


class Volume:
    """The filesystem of one sandbox, mounted on `mountpoint` until `release()`."""

    def __init__(self, templates: Templates, image: Path, mountpoint: Path, size: int,
                 inodes: int) -> None:
        self.template = templates.get(size, inodes)
        self.image, self.mountpoint, self.limit = image, mountpoint, size
        self._released = False
        spare = templates.take(size, inodes)
        if spare is not None:
            try:
                _mount(spare.point, mountpoint, None, MS_MOVE)
            except OSError as e:
                log.warning("could not use a spare volume (%s); making one", e)
                spare.discard()
                spare = None
        if spare is None:
            _make_mounted(self.template, image, mountpoint)
        else:
            os.rename(spare.image, image)
            # Only an empty former mount point is left; its rmdir waits on the kernel.
            _releaser.later(lambda: shutil.rmtree(spare.dir, ignore_errors=True))
        self.baseline = self._used_raw()
        with _by_point_lock:
            _by_point[str(mountpoint)] = self

    def _used_raw(self) -> int:
        st = os.statvfs(self.mountpoint)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def used(self) -> int:
        """Bytes the sandbox's files hold on the volume (open unlinked files included),
        at most the limit: a full volume is at its quota, not over it (the filesystem
        counts its own metadata and rounding, which the kernel already bounds)."""
        return max(0, min(self.limit, self._used_raw() - self.baseline))

    def inodes_used(self) -> int:
        st = os.statvfs(self.mountpoint)
        return st.f_files - st.f_ffree

    def release(self) -> None:
        """Detach the filesystem now; the kernel's teardown happens in the background.
        Idempotent. Only once nothing of the sandbox runs any more."""
        if self._released:
            return
        self._released = True
        with _by_point_lock:
            if _by_point.get(str(self.mountpoint)) is self:
                del _by_point[str(self.mountpoint)]
        try:
            # Holding the root keeps the filesystem alive past the detach, so that the
            # teardown runs where that descriptor is closed: on the releaser thread.
            held = os.open(self.mountpoint, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            held = -1
        try:
            _umount(self.mountpoint, MNT_DETACH)
        except OSError as e:
            log.warning("could not unmount the volume at %s: %s", self.mountpoint, e)
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.image.unlink()
            if held >= 0:
                _releaser.later(lambda: os.close(held))


class _Releaser:
    """Runs the kernel's slow parts of letting a volume go (the teardown when its last
    descriptor is closed, rmdir of a former mount point) off the caller's path."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def later(self, job: Callable[[], object]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="ridgeline-volume-release")
                self._thread.start()
        self._queue.put(job)

    def _loop(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                self._queue.get()()


_releaser = _Releaser()


# -- availability and crash recovery ---------------------------------------------------------
_reasons: dict[tuple[str, Path], str | None] = {}
_reasons_lock = threading.Lock()


def unavailable_reason(root: Path) -> str | None:
    """Why this machine cannot give sandboxes a filesystem of their own, or None if it
    can (checked once per process and root by really making and mounting one)."""
    key = (LOOP_CONTROL, root)
    with _reasons_lock:
        if key not in _reasons:
            _reasons[key] = _probe(root)
        return _reasons[key]


def _probe(root: Path) -> str | None:
    if os.geteuid() != 0:
        return "not running as root (attaching a loop device and mounting need it)"
    if not os.path.exists(LOOP_CONTROL):
        return (f"{LOOP_CONTROL} does not exist (no loop device support: `modprobe loop`, "
                "or give the container /dev/loop-control and /dev/loop*)")
    if _mkfs() is None:
        return "mkfs.ext4 not found (install it with `apt-get install -y e2fsprogs`)"
    try:
        Templates(root).get(1 << 20, 64)
    except (OSError, SandboxError) as e:
        return f"making and mounting a loop-mounted ext4 image failed: {e}"
    return None


def _unescape(field: str) -> str:
    # /proc/*/mountinfo writes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _backing_file(source: str) -> str:
    if not source.startswith("/dev/loop"):
        return ""
    try:
        with open(f"/sys/block/{os.path.basename(source)}/loop/backing_file") as f:
            return f.read().strip()
    except OSError:
        return ""


def volume_mounts(root: Path, mountinfo: str = "/proc/thread-self/mountinfo"
                  ) -> list[tuple[str, str]]:
    """(mount point, image) of every mount in the calling thread's namespace that lies
    below `root` or shows a volume whose image is below `root` (a writable mount's
    bind, wherever it is), deepest first (the order to unmount them in). `image` is ""
    for a mount below `root` that is no volume."""
    prefix = str(root).rstrip("/") + "/"
    found = {}
    with open(mountinfo) as f:
        for line in f:
            fields = line.split(" ")
            point = _unescape(fields[4])
            rest = fields[fields.index("-") + 1:]
            image = _backing_file(_unescape(rest[1])) if len(rest) > 1 else ""
            if not image.startswith(prefix):
                image = ""
            if point.startswith(prefix) or image:
                found[point] = image
    return sorted(found.items(), key=lambda p: p[0].count("/"), reverse=True)


def detach_all(root: Path, keep: Path | None = None) -> None:
    """Detach every volume and mount below `root`, except those of `keep` (a sandbox's
    directory), in the calling thread's namespace: a new mount namespace copies the
    host's mounts, and a copy of another sandbox's volume would keep that filesystem
    (and its disk) alive after the sandbox closed."""
    keep_s = None if keep is None else str(keep).rstrip("/") + "/"
    for point, image in volume_mounts(root):
        if keep_s is not None and ((point + "/").startswith(keep_s) or image.startswith(keep_s)):
            continue
        with contextlib.suppress(OSError):
            _umount(point, MNT_DETACH)


def _owner(name: str) -> str:
    return name.removeprefix(".trash-").removeprefix(SPARE_PREFIX).split("-", 1)[0]


def sweep_stale(root: Path) -> None:
    """Unmount the volumes of sandboxes whose process died without closing them (their
    directories are named `<pid>-<id>`, trash and spares included; a writable mount's
    bind is found by its image), and remove that process's spare volumes."""
    if not root.is_dir():
        return
    prefix = str(root).rstrip("/") + "/"
    for point, image in volume_mounts(root, "/proc/self/mountinfo"):
        where = image if image else point
        owner = _owner(where[len(prefix):].split("/", 1)[0])
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            with contextlib.suppress(OSError):
                _umount(point, MNT_DETACH)
    for child in root.glob(f"{SPARE_PREFIX}*"):
        owner = _owner(child.name)
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
            shutil.rmtree(child, ignore_errors=True)  # unmounted above


# -- writable mounts ------------------------------------------------------------------------
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class MountVolume:
    """A writable mount's host directory on a volume of its own, for the sandbox's life.

    The directory's content is copied onto a fresh volume (mounted in the sandbox's host
    directory), and the volume is bind-mounted over the directory on the host: the host
    and the sandbox see the same files, live, and the kernel bounds them like the
    workspace. At `release` the bind is undone and what the volume holds is copied back
    into the (emptied) directory, so the host finds the sandbox's files there as before;
    that copy is iterative, never follows a link and only makes directories, regular
    files (sparse) and symlinks. A copy-back that fails is logged, never raised."""

    def __init__(self, templates: Templates, image: Path, stage: Path, source: Path,
                 size: int, inodes: int) -> None:
        self.source, self.stage = source, stage
        stage.mkdir(mode=0o700)
        self.volume = Volume(templates, image, stage, size, inodes)
        self._bound = False
        try:
            _copy_dir(source, stage)
            # The directory itself keeps its owner and mode (only its content moved).
            st = os.stat(source)
            os.chown(stage, st.st_uid, st.st_gid)
            os.chmod(stage, stat.S_IMODE(st.st_mode))
            _mount(stage, source, None, MS_BIND)
            self._bound = True
            _register(source, self.volume)
        except BaseException:
            self.volume.release()
            raise

    def release(self) -> None:
        """Undo the bind, copy the files back, let the volume go. Idempotent; only once
        nothing of the sandbox runs any more."""
        if self.volume._released:
            return
        try:
            if self._bound:
                self._bound = False
                _register(self.source, None)
                _umount(self.source, MNT_DETACH)
                from ridgeline.sandbox import hostfs  # the cleanup helpers (iterative)
                hostfs.clear_dir(self.source)
                _copy_dir(self.stage, self.source)
        except Exception as e:  # noqa: BLE001 - cleanup: report, never crash the caller
            log.warning("could not copy the writable mount %s back from its volume: %s",
                        self.source, e)
        finally:
            self.volume.release()


def _copy_dir(source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> None:
    """`copy_tree` between two directories opened here (by descriptor, no symlink walk)."""
    src = os.open(source, _DIR)
    try:
        dst = os.open(dest, _DIR)
        try:
            copy_tree(src, dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def copy_tree(src: int, dst: int) -> None:
    """Copy the tree below the directory `src` into the directory `dst` (both left
    open): directories, regular files (holes kept) and symlinks, with modes, owners and
    times; other entries (fifos, sockets, devices) are skipped. Iterative, with
    descriptors held only along the current path; links are copied, never followed."""
    src_dirs: dict[str, int] = {}
    # The destination directories along the current path: (rel, fd, source stat).
    path: list[tuple[str, int, os.stat_result | None]] = [("", dst, None)]

    def leave_until(parent: str) -> None:
        while len(path) > 1 and not (parent == path[-1][0]
                                     or parent.startswith(path[-1][0] + "/")):
            _, fd, st = path.pop()
            try:
                os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(fd)

    try:
        for rel, st in disk.walk(src, lambda r, fd: src_dirs.__setitem__(r, fd)):
            parent, _, name = rel.rpartition("/")
            leave_until(parent)
            if path[-1][0] != parent:
                continue  # its directory could not be made
            sfd, dfd = src_dirs[parent], path[-1][1]
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(name, 0o700, dir_fd=dfd)
                fd = os.open(name, _DIR, dir_fd=dfd)
                path.append((rel, fd, st))
                os.fchown(fd, st.st_uid, st.st_gid)
                os.fchmod(fd, mode)
            elif stat.S_ISREG(st.st_mode):
                try:
                    ifd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                                  | os.O_NONBLOCK, dir_fd=sfd)
                except OSError:
                    continue  # gone or swapped meanwhile
                try:
                    ofd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                                  | os.O_CLOEXEC, 0o600, dir_fd=dfd)
                    try:
                        disk.copy_sparse(ifd, ofd)
                        os.fchown(ofd, st.st_uid, st.st_gid)
                        os.fchmod(ofd, mode)
                        os.utime(ofd, ns=(st.st_atime_ns, st.st_mtime_ns))
                    finally:
                        os.close(ofd)
                finally:
                    os.close(ifd)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
                os.chown(name, st.st_uid, st.st_gid, dir_fd=dfd, follow_symlinks=False)
        leave_until("")
    finally:
        for _, fd, _ in path[1:]:
            os.close(fd)
