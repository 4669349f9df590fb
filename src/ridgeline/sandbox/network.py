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

`PrivateNetwork(internet=True)` (a task whose `allow_internet` the operator allowed) also
reaches the internet through `slirp4netns`, the user-mode NAT rootless podman uses: no
bridge or firewall change on the host. The host itself stays out of reach: slirp's
gateway does not forward to the host's loopback (`--disable-host-loopback`), and routes
inside the namespace refuse the host's own addresses, link-local addresses (cloud
metadata) and the private ranges (the host's LAN), so "internet" means the internet.
DNS is slirp's resolver (`resolv_conf`).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import ipaddress
import os
import select
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

from ridgeline.errors import SandboxError

CLONE_NEWNET = 0x40000000
MS_BIND = 0x1000
MNT_DETACH = 2
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
SLIRP_DNS = "10.0.2.3"      # slirp4netns's built-in resolver and gateway
SLIRP_GATEWAY = "10.0.2.2"
SLIRP_READY_S = 10.0
#: Never reachable from a sandbox with internet: link-local (cloud metadata at
#: 169.254.169.254), the private ranges (the host's LAN) and shared address space.
REFUSED_RANGES = ("169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16",
                  "100.64.0.0/10")

_libc = ctypes.CDLL(None, use_errno=True)


def _loopback_up() -> None:
    """Bring `lo` up in the calling thread's network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))


def host_addresses() -> list[str]:
    """The host's own IPv4 addresses (besides loopback): a sandbox must not reach
    services the host listens on, even through slirp's NAT."""
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True,
                         text=True, check=False).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            addr = fields[fields.index("inet") + 1].split("/")[0]
            if not ipaddress.ip_address(addr).is_loopback:
                found.append(addr)
    return found


class PrivateNetwork:
    """A network namespace with loopback only (and, with `internet`, a NAT to the
    internet, see module doc); `path` is what sandbox specs name."""

    def __init__(self, internet: bool = False) -> None:
        self.slirp: subprocess.Popen | None = None
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
        if internet:
            try:
                self._connect_internet()
            except BaseException:
                self.close()
                raise

    def _connect_internet(self) -> None:
        slirp = shutil.which("slirp4netns")
        if slirp is None:
            raise SandboxError("internet for a sandbox needs slirp4netns",
                               hint="apt-get install slirp4netns (make install does)")
        ready_r, ready_w = os.pipe()
        try:
            self.slirp = subprocess.Popen(
                [slirp, "--configure", "--mtu=65520", "--disable-host-loopback",
                 "--ready-fd", str(ready_w), "--netns-type=path", str(self.path), "tap0"],
                pass_fds=(ready_w,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE)
            os.close(ready_w)
            ready_w = -1
            if not select.select([ready_r], [], [], SLIRP_READY_S)[0] \
                    or os.read(ready_r, 1) != b"1":
                err = b""
                if self.slirp.poll() is not None and self.slirp.stderr is not None:
                    err = self.slirp.stderr.read()
                raise SandboxError(f"slirp4netns did not connect the sandbox's network: "
                                   f"{err.decode(errors='replace')[-300:]}")
        finally:
            os.close(ready_r)
            if ready_w >= 0:
                os.close(ready_w)
        refused = [*REFUSED_RANGES, *(f"{a}/32" for a in host_addresses()),
                   f"{SLIRP_GATEWAY}/32"]
        with joined(self.path):   # `ip` started here runs inside the namespace
            for cidr in refused:
                res = subprocess.run(["ip", "route", "add", "prohibit", cidr],
                                     capture_output=True, text=True, check=False)
                if res.returncode != 0 and "File exists" not in res.stderr:
                    raise SandboxError(f"could not fence {cidr} off the sandbox's "
                                       f"network: {res.stderr.strip()}")

    def close(self) -> None:
        """Let go of the namespace (it ends when its last member does)."""
        if self.slirp is not None:
            self.slirp.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.slirp.wait(timeout=5)
            if self.slirp.poll() is None:
                self.slirp.kill()
                self.slirp.wait()
            self.slirp = None
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


def resolv_conf(directory: Path) -> Path:
    """An /etc/resolv.conf naming slirp's resolver (for a network with internet)."""
    path = directory / "resolv.conf"
    path.write_text(f"nameserver {SLIRP_DNS}\n")
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
