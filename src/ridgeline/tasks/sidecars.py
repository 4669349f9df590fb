"""Compose sidecars of a task (an API server, a simulated user, an MCP server): each a
bwrap sandbox on its own image running its entrypoint and command, in a private network
shared with the task's sandbox (sandbox/network.py), reached by its service name."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

from ridgeline.errors import SandboxError
from ridgeline.sandbox import SandboxSpec
from ridgeline.sandbox.base import Sandbox
from ridgeline.sandbox.network import PrivateNetwork, hosts_file
from ridgeline.sandbox.network import joined as network_joined
from ridgeline.tasks.environment import (EnvironmentSetupError, TaskUnsupported,
                                         _create_sandbox, _failure_reason, network_mounts,
                                         sandbox_limits)
from ridgeline.tasks.images import CA_ENV, BuildRefused, builder
from ridgeline.tasks.model import Sidecar, Task

SIDECAR_READY_S = 60.0


def start_sidecars(task: Task, staging: Path, internet: bool = False
                   ) -> tuple[PrivateNetwork, dict[str, Sandbox]]:
    """Build and start the task's compose sidecars in a private network of their own
    (sandbox/network.py; with `internet`, one that also reaches the internet), each a
    bwrap sandbox on its image running its entrypoint and command in the background;
    wait until the ports they declare accept connections. The caller closes what this
    returns (close_group), also when this raises."""
    net = PrivateNetwork(internet=internet)
    hosts = hosts_file(staging, [task.service_name, *(c.name for c in task.sidecars)])
    started: dict[str, Sandbox] = {}
    try:
        for car in task.sidecars:
            started[car.name] = _start_sidecar(task, car, net, hosts)
        ports = [p for c in task.sidecars for p in c.ports]
        if ports and not wait_for_ports(net.path, ports, SIDECAR_READY_S):
            logs = {n: sb.run("tail -c 400 /tmp/.sidecar.log").stdout for n, sb in
                    started.items()}
            raise EnvironmentSetupError(task.id, f"compose sidecars did not listen on "
                                        f"{ports} within {SIDECAR_READY_S:.0f} s: {logs}")
    except BaseException:
        close_group(started, net)
        raise
    return net, started


def _start_sidecar(task: Task, car: Sidecar, net: PrivateNetwork, hosts: Path) -> Sandbox:
    where = f"compose service {car.name!r}"
    try:
        image = (builder().build(car.dockerfile, car.context) if car.dockerfile is not None
                 else builder().local(car.image or ""))
    except BuildRefused as e:
        raise TaskUnsupported(task.id, f"{where}: {e}") from e
    except SandboxError as e:
        raise EnvironmentSetupError(task.id, f"{where}: {e.message}") from e
    argv = [*(car.entrypoint if car.entrypoint is not None else image.config.entrypoint),
            *(car.command if car.command is not None else image.config.cmd)]
    if not argv:
        raise TaskUnsupported(task.id, f"{where}: no entrypoint or command to run")
    workdir = image.workdir("/srv")
    spec = SandboxSpec(workspace_path=workdir, tools_root=image.rootfs,
                       workspace_from=image.seed(workdir),
                       env={**image.config.env, **CA_ENV, "HOME": "/tmp", **car.env},
                       mounts=network_mounts(task, hosts.parent, net),
                       limits=sandbox_limits(task), network_namespace=net.path)
    sb = _create_sandbox(spec, "bwrap")
    try:
        res = sb.run(["sh", "-c", 'nohup "$@" >/tmp/.sidecar.log 2>&1 </dev/null &',
                      "sh", *argv], timeout=30)
        if not res.ok:
            raise EnvironmentSetupError(task.id, f"{where}: could not start {argv}: "
                                        f"{_failure_reason(res)}")
    except BaseException:
        sb.close()
        raise
    return sb


def wait_for_ports(netns: Path, ports: list[int], timeout: float) -> bool:
    """Whether every port accepts a connection on the shared loopback within `timeout`
    (checked from a thread that joins the private network)."""
    ok: list[bool] = []

    def probe() -> None:
        deadline = time.monotonic() + timeout
        with network_joined(netns):
            pending = set(ports)
            while pending and time.monotonic() < deadline:
                for p in list(pending):
                    with contextlib.suppress(OSError), \
                            socket.create_connection(("127.0.0.1", p), timeout=0.5):
                        pending.discard(p)
                if pending:
                    time.sleep(0.1)
            ok.append(not pending)

    t = threading.Thread(target=probe, name="ridgeline-sidecar-ready")
    t.start()
    t.join()
    return bool(ok and ok[0])


def close_group(sidecars: dict[str, Sandbox], net: PrivateNetwork | None) -> None:
    for sb in sidecars.values():
        with contextlib.suppress(Exception):
            sb.close()
    sidecars.clear()
    if net is not None:
        net.close()
