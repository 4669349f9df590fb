"""The local backend: commands run directly on the host, in the workspace directory.

NO ISOLATION. The command sees and can change everything the calling user can; the
network policy is not enforced and `workspace_path` is not where the workspace is (it is
`workspace_dir`). It exists for development on machines without bubblewrap and says so
loudly every time a sandbox is made. Limits still apply per process (rlimits), timeouts
and output caps as everywhere, and process trees are killed at a timeout and at close.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path

from ridgeline.errors import SandboxError, UnsupportedError
from ridgeline.sandbox.base import ExecResult, SandboxSpec, ShellSession
from ridgeline.sandbox.host_sandbox import HostSandbox, default_root, prepare_root
from ridgeline.sandbox.process import TreeTracker, communicate, kill_process_tree, to_exec_result
from ridgeline.sandbox.shell import BashSession

log = logging.getLogger(__name__)
WARNING = ("ridgeline sandbox backend 'local' provides NO ISOLATION: commands run on the "
           "host as {user} with full access to its files and network; use it for "
           "development only (the default backend is 'bwrap')")
OOM_MARKERS = (b"MemoryError", b"Cannot allocate memory", b"std::bad_alloc", b"out of memory")


class LocalProvider:
    name = "local"

    def __init__(self, root_dir: Path | None = None) -> None:
        self.root = prepare_root(root_dir or default_root())
        self.prlimit = shutil.which("prlimit")

    def create(self, spec: SandboxSpec) -> "LocalSandbox":
        return LocalSandbox(self, spec)


class LocalSandbox(HostSandbox):
    backend = "local"

    def __init__(self, provider: LocalProvider, spec: SandboxSpec) -> None:
        if spec.mounts:
            raise UnsupportedError(
                "the local backend cannot mount directories at "
                f"{', '.join(m.target for m in spec.mounts)} (it has no mount namespace)",
                hint="use the bwrap backend")
        msg = WARNING.format(user=os.environ.get("USER") or os.getuid())
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        super().__init__(spec, provider.root)
        self._p = provider
        self._procs: set[subprocess.Popen] = set()
        self._shells: list[BashSession] = []
        self._env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.dir),
                     "LANG": "C.UTF-8", "TERM": "dumb", "RIDGELINE_WORKSPACE": str(self.workspace_dir),
                     **spec.env}
        lim = spec.limits
        args = []
        if lim.cpu_seconds is not None:
            args.append(f"--cpu={lim.cpu_seconds}:{lim.cpu_seconds + 1}")
        if lim.max_file_size_bytes is not None:
            args.append(f"--fsize={lim.max_file_size_bytes}")
        if lim.memory_bytes is not None:
            args.append(f"--as={lim.memory_bytes}")
        self._rlimits = [provider.prlimit, *args, "--"] if args and provider.prlimit else []

    def _host_cwd(self, cwd: str | None) -> str:
        """Sandbox paths under the workspace map to the workspace directory."""
        target = cwd if cwd is not None else self.spec.cwd
        ws = self.spec.workspace_path
        if target == ws or target.startswith(ws + "/"):
            host = self.workspace_dir / target[len(ws):].lstrip("/")
            host.mkdir(parents=True, exist_ok=True)
            return str(host)
        return target

    def popen(self, argv: list[str], *, env: dict[str, str] | None = None,
              cwd: str | None = None, launcher: tuple[str, ...] = (),
              **kwargs) -> subprocess.Popen:
        self._check_open()
        if not argv:
            raise SandboxError("empty command")
        try:
            proc = subprocess.Popen([*launcher, *self._rlimits, *argv],
                                    env={**self._env, **(env or {})},
                                    cwd=self._host_cwd(cwd), **kwargs)
        except OSError as e:
            raise SandboxError(f"could not start {argv[0]}: {e.strerror}") from None
        self._procs.add(proc)
        return proc

    def run(self, cmd: str | list[str], timeout: float | None = None,
            env: dict[str, str] | None = None, cwd: str | None = None,
            stdin: bytes | None = None) -> ExecResult:
        argv, limit = self._command(cmd, timeout)
        t0 = time.monotonic()
        try:
            proc = self.popen(argv, env=env, cwd=cwd, start_new_session=True,
                              stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except SandboxError as e:
            if "No such file" in str(e):  # like a shell: a missing command is exit code 127
                return ExecResult(127, b"", f"{argv[0]}: command not found\n".encode(),
                                  time.monotonic() - t0)
            raise
        try:
            outcome = communicate(proc, stdin=stdin, max_output=self.spec.limits.max_output_bytes,
                                  timeout=limit, kill=lambda: kill_process_tree(proc.pid),
                                  started=t0)
        finally:
            self._procs.discard(proc)
        memory = outcome.returncode != 0 and any(m in outcome.stderr.kept for m in OOM_MARKERS)
        return to_exec_result(outcome, memory_killed=memory)

    def shell(self) -> ShellSession:
        self._check_open()

        def start(argv: list[str], cwd: str | None):
            proc = self.popen(argv, cwd=cwd, start_new_session=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            return proc, TreeTracker(proc.pid)

        session = BashSession(start, max_output=self.spec.limits.max_output_bytes,
                              default_timeout=self.spec.limits.wall_timeout_s,
                              check_open=self._check_open)
        self._shells = [sh for sh in self._shells if not sh.closed] + [session]
        return session

    def _probe_dir(self) -> str:
        return str(self.workspace_dir)

    def _stop_processes(self) -> None:
        for sh in self._shells:
            sh.close()
        self._shells.clear()
        for proc in list(self._procs):
            kill_process_tree(proc.pid)

    def _close_processes(self) -> None:
        self._stop_processes()
