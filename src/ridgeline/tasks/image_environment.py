"""A task's environment on its built image (images.py): the sandbox whose root is the
image (read-only), whose workspace is a writable copy of the image's WORKDIR, with
writable copies of the other trees the build made and the harness's staging mounts.

Two backends run the same image: bwrap over podman's mount of it, and docker, whose
engine (Docker, or podman's Docker-compatible API) starts a container from it; an
engine that does not have the image gets it from podman (`podman save`, `docker load`)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from ridgeline.errors import SandboxError
from ridgeline.sandbox import Mount, NetworkPolicy, SandboxSpec
from ridgeline.sandbox.base import Sandbox
from ridgeline.sandbox.network import PrivateNetwork
from ridgeline.tasks import wheelhouse
from ridgeline.tasks.environment import (LOGS_PATH, SOLUTION_PATH, TESTS_PATH,
                                         EnvironmentSetupError, TaskUnsupported,
                                         _create_sandbox, interpreter_mounts, network_mounts,
                                         runtime_env,
                                         sandbox_limits, wheel_mounts_for)
from ridgeline.tasks.harness import HARNESS_MOUNT, HarnessTools
from ridgeline.tasks.images import (CA_ENV, IMAGE_PATH, BuildRefused, BuiltImage,
                                    ImagesUnavailable, builder)
from ridgeline.tasks.model import Task

log = logging.getLogger(__name__)

def build_image(task: Task, fallback: bool = False) -> BuiltImage | None:
    """The task's image; with `fallback` (mode auto), None where this machine cannot
    build images at all (no base image: no mirror), so the host-root mode runs it."""
    assert task.build.source is not None
    try:
        return builder().build(task.build.source, task.build.context)
    except BuildRefused as e:
        raise TaskUnsupported(task.id, str(e)) from e
    except ImagesUnavailable as e:
        if fallback:
            log.warning("task %s: images cannot be built here (%s); the host-root mode "
                        "runs it", task.id, e.message)
            return None
        raise TaskUnsupported(task.id, f"task images cannot be built here: {e.message}"
                              ) from e
    except SandboxError as e:
        raise EnvironmentSetupError(task.id, f"building the image: {e.message}") from e


#: Top-level directories of a Debian/Ubuntu root: the system's, read-only in the
#: sandbox. Any other (a task's /data, /workspace ...) was made by the task's build.
SYSTEM_TOP = frozenset({"bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64",
                        "libx32", "media", "mnt", "opt", "proc", "root", "run", "sbin",
                        "srv", "sys", "tmp", "usr", "var"})


def task_trees(image: BuiltImage, workdir: str) -> list[str]:
    """The top-level directories the task's build made beside the system's (and beside
    the workspace): writable copies of them are the task's, as under Docker."""
    ws_top = workdir.strip("/").split("/", 1)[0]
    # the harness's own mounts take those paths (a Harbor image often makes /logs)
    harness = {p.strip("/") for p in (TESTS_PATH, SOLUTION_PATH, LOGS_PATH, HARNESS_MOUNT,
                                      wheelhouse.MOUNT)}
    out = []
    for name in sorted(os.listdir(image.rootfs)):
        p = image.rootfs / name
        if name not in SYSTEM_TOP | harness and name != ws_top and p.is_dir() \
                and not p.is_symlink():
            out.append("/" + name)
    return out


def share_with_engine(image: BuiltImage) -> None:
    """Make `image` available to the docker backend's engine: podman's API shares
    podman's store (nothing to do); a Docker daemon loads podman's archive of it."""
    import docker

    from ridgeline.sandbox import get_provider
    client = get_provider("docker").client
    try:
        client.images.get(image.ref)
        return
    except docker.errors.ImageNotFound:
        pass
    with tempfile.TemporaryDirectory(prefix="ridgeline-image-") as d:
        archive = Path(d) / "image.tar"
        builder().save(image.ref, archive)
        try:
            with open(archive, "rb") as f:
                client.images.load(f.read())
        except docker.errors.APIError as e:
            raise SandboxError(f"the Docker engine refused image {image.ref}: {e}",
                               hint="use the bwrap backend") from None
    log.info("loaded %s into the Docker engine", image.ref)


def create_on_image(task: Task, image: BuiltImage, tools: HarnessTools, staging: Path,
                     env: dict[str, str] | None, net: PrivateNetwork | None = None,
                     backend: str = "bwrap") -> tuple[Sandbox, dict[str, Path]]:
    """A sandbox (bwrap or docker) whose root is the built image (read-only), whose
    workspace is a writable copy of the image's WORKDIR, with writable copies of the
    other trees the build made (`task_trees`) and the harness's staging mounts."""
    if backend == "docker":
        assert net is None, "prepare_environment refuses sidecars on docker"
        share_with_engine(image)
    for sub in ("tests", "solution", "logs/verifier", "logs/agent", "home", "extra"):
        (staging / sub).mkdir(parents=True)
    workdir = image.workdir(task.workdir)
    extra: dict[str, Path] = {}
    for i, tree in enumerate(task_trees(image, workdir)):
        extra[tree] = staging / "extra" / str(i)
        # the image is the host's (built from the task's files), not a sandbox's: a
        # plain copy, links kept as links
        shutil.copytree(image.rootfs / tree.lstrip("/"), extra[tree], symlinks=True)
    base = runtime_env(task, tools)
    # The image's own tools first, the offline stand-ins (uv, curl ...) for what a test
    # script would download; never the host's Python (the agent sees the image's).
    image_path = image.config.env.get("PATH", IMAGE_PATH)
    run_env = {**image.config.env, **CA_ENV, **base, "PATH": f"{tools.bin}:{image_path}"}
    mounts = [Mount(source=tools.host_dir, target=HARNESS_MOUNT, writable=False),
              Mount(source=staging / "tests", target=TESTS_PATH, writable=False),
              Mount(source=staging / "solution", target=SOLUTION_PATH, writable=False),
              Mount(source=staging / "logs", target=LOGS_PATH, writable=True),
              *interpreter_mounts(tools)]
    if workdir != base["HOME"]:   # an image whose WORKDIR is /root: the workspace is HOME
        mounts.append(Mount(source=staging / "home", target=base["HOME"], writable=True))
    mounts += [Mount(source=h, target=t, writable=True) for t, h in extra.items()]
    wheel_mounts, wheel_env = wheel_mounts_for(task, image=True)
    mounts += wheel_mounts
    run_env.update(wheel_env)
    mounts += network_mounts(task, staging, net)   # service names, the internet's DNS
    spec = SandboxSpec(workspace_path=workdir, workdir=workdir, mounts=mounts,
                       workspace_from=image.seed(workdir),
                       env={**run_env, **(env or {})},
                       limits=sandbox_limits(task), network=NetworkPolicy.LOOPBACK,
                       network_namespace=net.path if net is not None else None)
    if backend == "docker":   # the engine's container runs the image itself
        spec = spec.model_copy(update={"image": image.ref})
    else:                     # bwrap: podman's mount of the image is the root
        spec = spec.model_copy(update={"tools_root": image.rootfs})
    return _create_sandbox(spec, backend), extra
