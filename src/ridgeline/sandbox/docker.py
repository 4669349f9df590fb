"""The docker backend: one container per sandbox, through the Docker engine's Python SDK.

The container runs `sleep infinity` under Docker's init with every capability dropped,
no-new-privileges, a read-only root, tmpfs /tmp and /run, no network (`--network none`
keeps only loopback, so both policies mean loopback here), and the spec's memory, pids,
CPU-time and file-size limits. The workspace is a host directory bind-mounted at
`workspace_path` (so `workspace_dir`, the files API and snapshots are the host-side code
all backends share); this needs the engine to run on this machine.

Commands are `exec`s whose multiplexed stream is split into ordinary pipes, so output
caps, timeouts and the shell session work as in the other backends. A timeout kills the
exec's process tree through its host pid. Images are never pulled at run time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

from ridgeline.errors import SandboxError
from ridgeline.sandbox.base import ExecResult, SandboxSpec, ShellSession
from ridgeline.sandbox.host_sandbox import HostSandbox, default_root, prepare_root
from ridgeline.sandbox.process import TreeTracker, communicate, kill_process_tree, to_exec_result
from ridgeline.sandbox.shell import BashSession

log = logging.getLogger(__name__)

DEFAULT_IMAGE = "python:3.12-slim"
#: Some VMs refuse RLIMIT_NPROC above ~32K in a container (EPERM from runc) although
#: their hard limit is higher.
NPROC_LIMIT = 32768
BASE_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb"}


def container_ulimits() -> dict[str, int]:
    """Open files and processes for a container on this machine. Engines ask for more
    by default (Docker and podman: 1M files) than some hosts' hard limits allow, and
    runc then refuses to start the container; the engine runs here (see module doc),
    so this process's hard limits are the engine's."""
    import resource
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    return {"nofile": 1 << 20 if nofile == resource.RLIM_INFINITY else min(nofile, 1 << 20),
            "nproc": NPROC_LIMIT if nproc == resource.RLIM_INFINITY
            else min(nproc, NPROC_LIMIT)}


class DockerProvider:
    name = "docker"

    def __init__(self, base_url: str | None = None, root_dir: Path | None = None,
                 default_image: str = DEFAULT_IMAGE) -> None:
        try:
            import docker
        except ImportError:
            raise SandboxError("the docker backend needs the `docker` Python package",
                               hint="pip install 'ridgeline[docker]'") from None
        try:
            self.client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
            self.client.ping()
        except Exception as e:  # noqa: BLE001 - any failure means: no usable engine
            raise SandboxError(f"no Docker engine is reachable ({type(e).__name__}: {e})",
                               hint="start Docker or set DOCKER_HOST, or use backend='bwrap'"
                               ) from None
        self.default_image = default_image
        self.root = prepare_root(root_dir or default_root())

    def create(self, spec: SandboxSpec) -> "DockerSandbox":
        return DockerSandbox(self, spec)


class _ExecProcess:
    """A Docker exec that looks like a `subprocess.Popen` with three pipes: threads copy
    between the exec's socket (multiplexed stdout/stderr frames) and real pipes."""

    def __init__(self, api, container_id: str, argv: list[str], env: dict[str, str],
                 workdir: str, stdin: bool) -> None:
        self._api = api
        self._id = api.exec_create(container_id, argv, stdin=stdin, stdout=True, stderr=True,
                                   environment=env, workdir=workdir)["Id"]
        sock = api.exec_start(self._id, socket=True)
        self._sock: socket.socket = getattr(sock, "_sock", sock)
        self.returncode: int | None = None
        out_r, self._out_w = os.pipe()
        err_r, self._err_w = os.pipe()
        self.stdout = os.fdopen(out_r, "rb", buffering=0)
        self.stderr = os.fdopen(err_r, "rb", buffering=0)
        self.stdin = None
        if stdin:
            in_r, in_w = os.pipe()
            self.stdin = os.fdopen(in_w, "wb", buffering=0)
            threading.Thread(target=self._pump_in, args=(in_r,), daemon=True).start()
        self._eof = threading.Event()
        threading.Thread(target=self._pump_out, daemon=True).start()
        self.pid = 0
        for _ in range(100):  # the host pid, for pidfds and killing the tree
            self.pid = int(api.exec_inspect(self._id).get("Pid") or 0)
            if self.pid or not api.exec_inspect(self._id).get("Running"):
                break
            time.sleep(0.01)

    def _pump_in(self, fd: int) -> None:
        try:
            while data := os.read(fd, 65536):
                self._sock.sendall(data)
        except ConnectionError:
            pass  # the exec ended and closed its socket; its exit status tells the rest
        except OSError as e:
            log.warning("docker exec %s: sending its input failed: %s", self._id, e)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)

    def _recv_exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                return b""
            buf += chunk
        return buf

    def _pump_out(self) -> None:
        try:
            while header := self._recv_exact(8):
                kind, size = header[0], struct.unpack(">I", header[4:])[0]
                payload = self._recv_exact(size)
                os.write(self._err_w if kind == 2 else self._out_w, payload)
        except ConnectionError:
            pass  # the exec's socket was reset, or our reader is gone (the command was killed)
        except OSError as e:
            log.warning("docker exec %s: reading its output failed: %s", self._id, e)
        finally:
            os.close(self._out_w)
            os.close(self._err_w)
            self._eof.set()

    def poll(self) -> int | None:
        if self.returncode is None:
            info = self._api.exec_inspect(self._id)
            if not info.get("Running"):
                self.returncode = int(info.get("ExitCode") or 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired("docker exec", timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.pid:
            kill_process_tree(self.pid)


class DockerSandbox(HostSandbox):
    backend = "docker"

    def __init__(self, provider: DockerProvider, spec: SandboxSpec) -> None:
        import docker

        super().__init__(spec, provider.root)
        self._p = provider
        self._api = provider.client.api
        self._shells: list[BashSession] = []
        self.container = None
        try:
            image = spec.image or provider.default_image
            try:
                provider.client.images.get(image)
            except docker.errors.ImageNotFound:
                raise SandboxError(f"image {image} is not available locally",
                                   hint=f"pull it first with `docker pull {image}` "
                                        "(sandboxes never download at run time)") from None
            lim = spec.limits
            ulimits = [docker.types.Ulimit(name=k, soft=v, hard=v)
                       for k, v in container_ulimits().items()]
            if lim.max_file_size_bytes is not None:
                ulimits.append(docker.types.Ulimit(name="fsize", soft=lim.max_file_size_bytes,
                                                   hard=lim.max_file_size_bytes))
            if lim.cpu_seconds is not None:
                ulimits.append(docker.types.Ulimit(name="cpu", soft=lim.cpu_seconds,
                                                   hard=lim.cpu_seconds + 1))
            volumes = {str(self.workspace_dir): {"bind": spec.workspace_path, "mode": "rw"}}
            for m in spec.mounts:
                if not m.source.exists():
                    raise SandboxError(f"mount source {m.source} does not exist")
                volumes[str(m.source.resolve())] = {"bind": m.target,
                                                    "mode": "rw" if m.writable else "ro"}
            self._env = {**BASE_ENV, **spec.env}
            tmp_size = f",size={lim.memory_bytes}" if lim.memory_bytes else ""
            # the image's ENTRYPOINT would wrap (or replace) the keep-alive command
            self.container = provider.client.containers.run(
                image, entrypoint=["sleep", "infinity"], detach=True, init=True,
                network_mode="none",
                mem_limit=lim.memory_bytes, memswap_limit=lim.memory_bytes,
                pids_limit=lim.max_processes, ulimits=ulimits, cap_drop=["ALL"],
                security_opt=["no-new-privileges"], read_only=True,
                tmpfs={"/tmp": f"rw,nosuid,nodev,mode=1777{tmp_size}", "/run": "rw,nosuid,nodev"},
                volumes=volumes, working_dir=spec.cwd, environment=self._env,
                hostname="sandbox", labels={"ridgeline.sandbox": self.id})
        except BaseException:
            self.close()
            raise

    @property
    def alive(self) -> bool:
        if self._closed or self.container is None:
            return False
        with contextlib.suppress(Exception):
            self.container.reload()
            return self.container.status == "running"
        return False

    def _exec(self, argv: list[str], env: dict[str, str] | None, cwd: str | None,
              stdin: bool) -> _ExecProcess:
        self._check_open()
        if not self.alive:
            raise SandboxError(f"sandbox {self.id}: its container is not running")
        return _ExecProcess(self._api, self.container.id, argv, {**self._env, **(env or {})},
                            cwd or self.spec.cwd, stdin)

    def run(self, cmd: str | list[str], timeout: float | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None,
            stdin: bytes | None = None) -> ExecResult:
        argv, limit = self._command(cmd, timeout)
        t0 = time.monotonic()
        proc = self._exec(argv, env, cwd, stdin is not None)
        outcome = communicate(proc, stdin=stdin, max_output=self.spec.limits.max_output_bytes,  # type: ignore[arg-type]
                              timeout=limit, kill=proc.kill, started=t0)
        oom = False
        if outcome.returncode == 137:
            with contextlib.suppress(Exception):
                oom = bool(self._api.inspect_container(self.container.id)["State"]["OOMKilled"])
        if outcome.returncode == 126 and b"executable file not found" in outcome.stdout.kept:
            outcome.returncode = 127  # a missing command, as a shell reports it
        return to_exec_result(outcome, memory_killed=oom)

    def shell(self) -> ShellSession:
        self._check_open()

        def start(argv: list[str], cwd: str | None):
            proc = self._exec(argv, None, cwd, True)
            return proc, TreeTracker(proc.pid)

        session = BashSession(start, max_output=self.spec.limits.max_output_bytes,  # type: ignore[arg-type]
                              default_timeout=self.spec.limits.wall_timeout_s,
                              check_open=self._check_open)
        self._shells = [sh for sh in self._shells if not sh.closed] + [session]
        return session

    def popen(self, argv: list[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None, launcher: tuple[str, ...] = (), **kwargs
              ) -> subprocess.Popen:
        """For an attached terminal: the docker CLI's `exec -it`."""
        self._check_open()
        cli = shutil.which("docker")
        if cli is None:
            raise SandboxError("an interactive docker shell needs the docker CLI")
        flags = ["-i", "-t", "-w", cwd or self.spec.cwd]
        for k, v in {**self._env, **(env or {})}.items():
            flags += ["-e", f"{k}={v}"]
        return subprocess.Popen([*launcher, cli, "exec", *flags, self.container.id, *argv],
                                **kwargs)

    def _health_checks(self) -> dict[str, tuple[bool, str]]:
        return {"container": (self.alive, "the container is not running")}

    def _stop_processes(self) -> None:
        for sh in self._shells:
            with contextlib.suppress(Exception):
                sh.close()
        self._shells.clear()
        self.container.restart(timeout=0)  # every process gone, /tmp fresh

    def _close_processes(self) -> None:
        for sh in self._shells:
            with contextlib.suppress(Exception):
                sh.close()
        self._shells.clear()
        if self.container is not None:
            with contextlib.suppress(Exception):
                self.container.remove(force=True)

