"""A private network shared by a group of sandboxes (a task and its compose sidecars).

`PrivateNetwork()` makes a network namespace with only its loopback up and keeps it
alive as a bind-mounted file; a sandbox whose spec names that file
(`SandboxSpec.network_namespace`) starts in it instead of in one of its own. Members
reach each other on 127.0.0.1 (by service name through the /etc/hosts each member is
given, `hosts_file`); nothing else is in the namespace, so nothing outside is reachable,
and the host cannot be reached either. Needs root (as the bwrap backend's own network
namespaces do).

Why one shared loopback rather than an address per member: it takes no veth pairs,
bridges or routes on the host, and a compose service is found by name either way; two
members listening on the same port would collide (reported by the second's bind).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import tempfile
import threading
from pathlib import Path

from ridgeline.errors import SandboxError

CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MNT_DETACH = 2
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1

_libc = ctypes.CDLL(None, use_errno=True)


def _loopback_up() -> None:
    """Bring `lo` up in the calling thread's network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


class PrivateNetwork:
    """A network namespace with loopback only; `path` is what sandbox specs name."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise SandboxError("a private network for several sandboxes needs root",
                               hint="run as root, or run the task without its sidecars")
        self.dir = Path(tempfile.mkdtemp(prefix="ridgeline-net-"))
        self.path = self.dir / "net"
        self.path.touch(mode=0o600)
        error: list[BaseException] = []

        def make() -> None:   # on a thread of its own: unshare affects only the caller
            try:
                if _libc.unshare(CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
                _loopback_up()
                if _libc.mount(b"/proc/thread-self/ns/net", os.fsencode(self.path), None,
                               MS_BIND, None) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"bind the namespace: {os.strerror(err)}")
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                error.append(e)

        t = threading.Thread(target=make, name="ridgeline-netns")
        t.start()
        t.join()
        if error:
            self.close()
            raise SandboxError(f"could not make a private network: {error[0]}")

    def close(self) -> None:
        """Let go of the namespace (it ends when its last member does)."""
        with contextlib.suppress(OSError):
            _libc.umount2(os.fsencode(self.path), MNT_DETACH)
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.dir.rmdir()

    def __enter__(self) -> "PrivateNetwork":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hosts_file(directory: Path, names: list[str]) -> Path:
    """An /etc/hosts that resolves `names` (service names) to the shared loopback."""
    path = directory / "hosts"
    path.write_text("127.0.0.1\tlocalhost " + " ".join(sorted(set(names))) + "\n"
                    "::1\tlocalhost ip6-localhost ip6-loopback\n")
    path.chmod(0o644)
    return path


@contextlib.contextmanager
def _switched(enter):
    """Run the block with the current thread in the network namespace `enter()` moves
    it to (children started meanwhile keep it), then back in its own."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter()
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back to the host network: {os.strerror(err)}")
    finally:
        os.close(own)


def fresh():
    """A new, empty network namespace (its loopback down) for the block. Needs root."""
    def enter() -> None:
        if _libc.unshare(CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(CLONE_NEWNET): {os.strerror(err)}")
    return _switched(enter)


@contextlib.contextmanager
def joined(path: Path):
    """The network namespace at `path` (a PrivateNetwork's) for the block."""
    target = os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    def enter() -> None:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {path}: {os.strerror(err)}")
    try:
        with _switched(enter):
            yield
    finally:
        os.close(target)
