"""Task images built for real: a task's Dockerfile built by podman (runc) on a local
Debian base, its root filesystem mounted read-only and run by the bwrap sandbox.

Why podman: it builds Dockerfiles exactly as Docker does (real `apt-get`, `pip`, `uv`,
users, writes anywhere in the image, multi-stage builds and `COPY --from`), caches
layers, and needs no daemon. What Ridgeline adds:

* **Base images from the reachable Debian mirror.** Docker Hub is not reachable here,
  so `FROM` lines are mapped onto local images (`map_base`): `debian:*`, `ubuntu:*`
  and Terminal-Bench's ubuntu bases onto `ridgeline/debian:bookworm` (made once by
  `mmdebstrap`), `python:*` and Terminal-Bench's python bases onto
  `ridgeline/python:bookworm` (that plus Debian's python3, pip and venv). A file named
  by `RIDGELINE_IMAGE_MAP` (TOML, `[map]` table of glob pattern -> local image) adds to
  or overrides the mapping. The host's CA bundle is added to the base image at build
  time: it is what makes the registries' TLS trusted on these machines.
* **Content-addressed tasks.** A task's image is tagged with a digest of its rewritten
  Dockerfile, its build context and the base images' ids, so a second build of the same
  task is a lookup (milliseconds) and a changed file rebuilds (with podman's layer
  cache for the unchanged prefix).
* **Typed failures.** An unmapped base image, `RUN --mount=type=secret|ssh`, a package
  the registries do not have or a build that needs the open internet is
  `TaskUnsupported` with the Dockerfile line; podman itself failing is an
  `EnvironmentSetupError` (infrastructure).
* **Network during builds only**: a build's steps run in podman's own network (NAT to
  what this machine reaches: the package registries), never the host's, so a task's
  `RUN` cannot reach services on the host's loopback; the sandbox that runs the image
  has no network at all.

The image's root is `podman image mount`ed (a read-only overlay; nothing is copied)
under /var/lib/containers, which only root may enter, so the image's setuid files are
never reachable by host users; the sandbox binds it with nosuid.

Machine quirks handled here: crun refuses the hybrid cgroup layout (runc is used), and
podman's default ulimits exceed the hard limits of these VMs (explicit `--ulimit`s).
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import fcntl
import fnmatch
import functools
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from ridgeline.errors import ConfigError, SandboxError
from ridgeline.sandbox.docker import container_ulimits
from ridgeline.tasks.dockerfile import HEREDOC, Instruction, expand, parse_dockerfile

DEBIAN_IMAGE = "localhost/ridgeline/debian:bookworm"
PYTHON_IMAGE = "localhost/ridgeline/python:bookworm"
BUILDPACK_IMAGE = "localhost/ridgeline/buildpack-deps:bookworm"
JDK17_IMAGE = "localhost/ridgeline/jdk:17"
UV_IMAGE = "localhost/ridgeline/uv"   # :<version>, from PyPI's uv
#: Terminal-Bench's own base images: tmux and asciinema (its harness's), WORKDIR /app
TB_DEBIAN_IMAGE = "localhost/ridgeline/t-bench-debian:bookworm"
TB_PYTHON_IMAGE = "localhost/ridgeline/t-bench-python:bookworm"
#: Glob patterns over a normalised image reference (registry docker.io and library/
#: dropped) -> local image. Python tags map to Debian's python3 (3.11): an approximation
#: recorded in docs/architecture.md.
DEFAULT_MAP: tuple[tuple[str, str], ...] = (
    ("debian", DEBIAN_IMAGE), ("debian:*", DEBIAN_IMAGE),
    ("ubuntu", DEBIAN_IMAGE), ("ubuntu:*", DEBIAN_IMAGE),
    ("python", PYTHON_IMAGE), ("python:*", PYTHON_IMAGE),
    ("ghcr.io/laude-institute/t-bench/python-*", TB_PYTHON_IMAGE),
    ("ghcr.io/laude-institute/t-bench/ubuntu-*", TB_DEBIAN_IMAGE),
    ("ghcr.io/laude-institute/t-bench/debian-*", TB_DEBIAN_IMAGE),
    ("buildpack-deps", BUILDPACK_IMAGE), ("buildpack-deps:*", BUILDPACK_IMAGE),
    # Debian's OpenJDK 17 for the Temurin 17 JDK images
    ("eclipse-temurin:17*jdk*", JDK17_IMAGE), ("openjdk:17*", JDK17_IMAGE),
)
#: `COPY --from=ghcr.io/astral-sh/uv:0.8.15 /uv /uvx /bin/` (uv's own install idiom):
#: an image holding PyPI's uv of that version at /uv and /uvx, on the python image.
UV_REF = re.compile(r"^ghcr\.io/astral-sh/uv(?::(\d+(?:\.\d+){0,2}|latest))?$")
MAP_ENV = "RIDGELINE_IMAGE_MAP"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
#: The runtime environment's CA variables, so pip, requests, curl and uv trust the same
#: bundle (python:* images' pip would otherwise use certifi's).
CA_ENV = {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
          "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt",
          "REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt",
          "CURL_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt"}
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TASK_REPO = "localhost/ridgeline/task"
BUILD_TIMEOUT_S = 1800.0
MAX_IDLE_MOUNTS = 4
BUILDPACK_RECIPE = f"""FROM {DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends build-essential curl \\
    wget git procps python3 python3-pip python3-venv unzip xz-utils \\
    && rm -rf /var/lib/apt/lists/*
ENV PIP_BREAK_SYSTEM_PACKAGES=1
"""
JDK17_RECIPE = f"""FROM {DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends openjdk-17-jdk-headless \\
    && rm -rf /var/lib/apt/lists/*
ENV JAVA_HOME=/usr/lib/jvm/java-17-openjdk-amd64
"""
TB_RECIPE = """FROM {base}
RUN apt-get update && apt-get install -y --no-install-recommends tmux asciinema \\
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
"""
UV_RECIPE = """FROM {python}
RUN pip install --no-cache-dir {spec} && cp "$(command -v uv)" /uv && cp "$(command -v uvx)" /uvx
"""
PYTHON_RECIPE = f"""FROM {DEBIAN_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip \\
    python3-venv python-is-python3 && rm -rf /var/lib/apt/lists/*
# python:* images let pip install into the system interpreter; Debian's refuses (PEP 668)
ENV PIP_BREAK_SYSTEM_PACKAGES=1
"""
#: Our base images made from a Dockerfile: image -> (the image it starts from, recipe)
RECIPES: dict[str, tuple[str, str]] = {
    PYTHON_IMAGE: (DEBIAN_IMAGE, PYTHON_RECIPE),
    BUILDPACK_IMAGE: (DEBIAN_IMAGE, BUILDPACK_RECIPE),
    JDK17_IMAGE: (DEBIAN_IMAGE, JDK17_RECIPE),
    TB_DEBIAN_IMAGE: (DEBIAN_IMAGE, TB_RECIPE.format(base=DEBIAN_IMAGE)),
    TB_PYTHON_IMAGE: (PYTHON_IMAGE, TB_RECIPE.format(base=PYTHON_IMAGE)),
}
#: The bases `make images` (`ridgeline tasks images`) prepares on a machine
PREPARED_BASES = (DEBIAN_IMAGE, PYTHON_IMAGE, TB_DEBIAN_IMAGE, TB_PYTHON_IMAGE)


def recipe_of(ref: str) -> tuple[str, str] | None:
    """(parent image, Dockerfile) of one of our recipe-made base images, uv's included."""
    if ref.startswith(UV_IMAGE + ":"):
        version = ref.rsplit(":", 1)[1]
        spec = "uv" if version == "latest" else f"uv=={version}"
        return PYTHON_IMAGE, UV_RECIPE.format(python=PYTHON_IMAGE, spec=spec)
    return RECIPES.get(ref)
CONTAINERS_CONF = """# Written by Ridgeline (tasks/images.py): runc, since crun refuses the hybrid
# cgroup layout of these machines; events to a file (no journald here).
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""


class ImagesUnavailable(SandboxError):
    """This machine cannot build task images (no podman, not root, no mirror)."""


@dataclass(frozen=True)
class ImageConfig:
    """What the image says about how its processes run."""

    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()


@dataclass(frozen=True)
class BuiltImage:
    ref: str                 # the content-addressed tag
    image_id: str
    rootfs: Path             # the mounted, read-only root filesystem
    config: ImageConfig
    build_s: float           # 0 when it was already built
    cached: bool

    def workdir(self, default: str) -> str:
        """Where its processes start: the image's WORKDIR, else `default`."""
        return self.config.workdir if self.config.workdir not in ("", "/") else default

    def seed(self, workdir: str) -> Path | None:
        """The image's tree at `workdir`, to seed a workspace there (None: it has none)."""
        tree = self.rootfs / workdir.lstrip("/")
        return tree if tree.is_dir() and not tree.is_symlink() else None


class BuildRefused(Exception):
    """The Dockerfile cannot be built here; `line` is its Dockerfile line (or None)."""

    def __init__(self, reason: str, line: int | None = None) -> None:
        self.reason, self.line = reason, line
        super().__init__(f"Dockerfile line {line}: {reason}" if line else reason)


def cache_dir() -> Path:
    env = os.environ.get("RIDGELINE_IMAGE_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "ridgeline" / "images"
    base.mkdir(parents=True, exist_ok=True, mode=0o700)
    return base


def normalise_ref(ref: str) -> str:
    """`docker.io/library/python:3.13` -> `python:3.13`; other registries kept."""
    ref = ref.split("@", 1)[0]
    for prefix in ("docker.io/library/", "docker.io/", "index.docker.io/library/",
                   "public.ecr.aws/docker/library/"):   # ECR's mirror of Docker Hub
        if ref.startswith(prefix):
            return ref[len(prefix):]
    return ref


def image_map() -> list[tuple[str, str]]:
    """The user's mapping (RIDGELINE_IMAGE_MAP) first, then the defaults."""
    path = os.environ.get(MAP_ENV)
    user: list[tuple[str, str]] = []
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{MAP_ENV}={path}: cannot read the image map: {e}",
                              hint='a TOML file with a [map] table: "python:3.*" = '
                                   f'"{PYTHON_IMAGE}"') from e
        table = data.get("map", {})
        if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
            raise ConfigError(f"{MAP_ENV}={path}: [map] must map patterns to image names",
                              hint='e.g. "node:*" = "localhost/my/node:20"')
        user = list(table.items())
    return user + list(DEFAULT_MAP)


def map_base(ref: str, mapping: list[tuple[str, str]] | None = None) -> str | None:
    """The local image that stands in for `ref`, or None if there is none."""
    norm = normalise_ref(ref)
    if norm.startswith("localhost/"):
        return norm
    if (m := UV_REF.match(norm)) is not None:
        return f"{UV_IMAGE}:{m.group(1) or 'latest'}"
    for pattern, local in (mapping if mapping is not None else image_map()):
        if fnmatch.fnmatchcase(norm, pattern):
            return local
    return None


def rewrite_dockerfile(dockerfile: Path, mapping: list[tuple[str, str]] | None = None
                       ) -> tuple[str, list[str]]:
    """The Dockerfile with every external `FROM` (and `COPY --from=<image>`) mapped to a
    local image, and the local base images it needs. Raises `BuildRefused` for what
    cannot be built here."""
    mapping = mapping if mapping is not None else image_map()
    instructions = parse_dockerfile(dockerfile)
    lines = dockerfile.read_text(encoding="utf-8").splitlines()
    args: dict[str, str] = {}
    stages: set[str] = set()
    bases: list[str] = []
    seen_from = False
    shell = ["/bin/sh", "-c"]
    for ins in instructions:
        if ins.keyword == "SHELL" and ins.exec_form:
            shell = list(ins.exec_form)
        if ins.keyword == "FROM":
            shell = ["/bin/sh", "-c"]
        if ins.heredocs and ins.keyword in ("RUN", "COPY", "ADD"):
            _replace_heredoc(lines, ins, shell)
        if ins.keyword == "ARG" and not seen_from:
            name, _, default = ins.args.partition("=")
            args[name.strip()] = default.strip().strip('"')
        if ins.keyword == "RUN":
            mount = ins.flags.get("mount", "")
            if "type=secret" in mount or "type=ssh" in mount:
                raise BuildRefused("RUN --mount=type=secret/ssh is not supported (the "
                                   "build has no secrets to give)", ins.line)
        if ins.keyword in ("COPY", "ADD") and (src := ins.flags.get("from")):
            if src not in stages and not src.isdigit():
                local = map_base(src, mapping)
                if local is None:
                    raise BuildRefused(f"COPY --from={src}: no local image stands in "
                                       f"for {src!r}", ins.line)
                lines[ins.line - 1] = lines[ins.line - 1].replace(
                    f"--from={src}", f"--from={local}", 1)
                bases.append(local)
        if ins.keyword != "FROM":
            continue
        seen_from = True
        words = [w for w in ins.args.split() if not w.startswith("--")]  # --platform
        if not words:
            raise BuildRefused("FROM without an image", ins.line)
        image = expand(words[0], args)
        alias = words[2] if len(words) >= 3 and words[1].lower() == "as" else None
        if image in stages:
            local = image
        elif (local := map_base(image, mapping)) is None:
            raise BuildRefused(f"base image {image!r} has no local equivalent (map it "
                               f"with {MAP_ENV}, see docs/architecture.md)", ins.line)
        else:
            bases.append(local)
        if ins.line - 1 < len(lines) and lines[ins.line - 1].lstrip().upper().startswith("FROM"):
            lines[ins.line - 1] = f"FROM {local}" + (f" AS {alias}" if alias else "")
        else:
            raise BuildRefused("a FROM split over several lines is not supported", ins.line)
        if alias:
            stages.add(alias)
    return "\n".join(lines) + "\n", sorted(set(bases))


def _replace_heredoc(lines: list[str], ins: Instruction, shell: list[str]) -> None:
    """Podman 4.3's builder (buildah 1.28) predates Dockerfile heredocs: an instruction
    with heredocs becomes one exec-form RUN whose script is the same shell text (the
    documents inline, as the shell reads them), in place of its lines."""
    start = ins.line - 1
    end = start
    while end < len(lines) - 1 and lines[end].rstrip().endswith("\\"):
        end += 1
    for m in HEREDOC.finditer(ins.args):
        strip_tabs, delim = m.group(1) == "-", m.group(3)
        end += 1
        while end < len(lines) and (lines[end].lstrip("\t") if strip_tabs
                                    else lines[end]) != delim:
            end += 1
    flags = " ".join(f"--{k}={v}" for k, v in ins.flags.items())
    if ins.keyword == "RUN":
        if not HEREDOC.sub("", ins.args).strip():   # the document is the script itself
            script = ins.heredocs[0]
            if script.startswith("#!"):   # BuildKit runs it as a file: its interpreter
                b64 = base64.b64encode(script.encode()).decode()
                script = (f"printf %s {b64} | base64 -d > /tmp/.ridgeline-run && chmod +x "
                          "/tmp/.ridgeline-run && /tmp/.ridgeline-run; rc=$?; "
                          "rm -f /tmp/.ridgeline-run; exit $rc")
        else:
            script, docs = ins.args, iter(ins.heredocs)
            for m in HEREDOC.finditer(ins.args):
                script += "\n" + next(docs, "") + m.group(3)
            script += "\n"
        new = f"RUN {flags} {json.dumps([*shell, script])}"
    else:   # COPY/ADD <<EOF dest: write the document with the image's own tools
        dest = ins.args.split()[-1]
        b64 = base64.b64encode(ins.heredocs[0].encode()).decode()
        mode = ins.flags.get("chmod")
        cmd = (f'mkdir -p "$(dirname {shlex.quote(dest)})" && printf %s {b64} | base64 -d'
               f' > {shlex.quote(dest)}' + (f" && chmod {mode} {shlex.quote(dest)}"
                                             if mode else ""))
        new = f"RUN {json.dumps(['/bin/sh', '-c', cmd])}"
    lines[start] = new
    for k in range(start + 1, min(end + 1, len(lines))):
        lines[k] = ""


def _context_entries(context: Path):
    """(path, path relative to `context`, lstat) of every entry, in a fixed order."""
    for dirpath, dirnames, filenames in os.walk(context):
        dirnames.sort()
        for name in sorted(filenames) + [d for d in dirnames
                                         if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, name)
            yield p, os.path.relpath(p, context), os.lstat(p)


def context_digest(context: Path) -> str:
    """A digest of every path, mode, link target and file content under `context`."""
    h = hashlib.sha256()
    for p, rel, st in _context_entries(context):
        h.update(f"{rel}\0{st.st_mode:o}\0".encode())
        if os.path.islink(p):
            h.update(os.readlink(p).encode())
        elif os.path.isfile(p):
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def context_stamp(context: Path) -> str:
    """What `context` looks like without reading a file (paths, modes, sizes, mtimes):
    while it is unchanged, its `context_digest` is too."""
    h = hashlib.sha256(str(context).encode())
    for _, rel, st in _context_entries(context):
        h.update(f"{rel}\0{st.st_mode:o}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()


class ImageBuilder:
    """Builds and mounts task images with podman. One per process is enough."""

    def __init__(self, podman: str | None = None) -> None:
        self.podman = podman or shutil.which("podman") or ""
        self.dir = cache_dir()
        self.conf = self.dir / "containers.conf"
        # Podman calls cost ~30 ms each: what this process built or found is kept, so
        # preparing the same task again costs a digest of its files, no podman call.
        self._bases: dict[str, str] = {}
        self._built: dict[str, BuiltImage] = {}
        self._digests: dict[str, str] = {}    # context_stamp -> context_digest
        # Every mount in the host's namespace is copied into each new sandbox's: ~0.3 ms
        # of start-up apiece (68 image mounts took a sandbox from 26 to 46 ms). Images in
        # use stay mounted; of the idle ones only the MAX_IDLE_MOUNTS latest.
        self._users: dict[str, int] = {}
        self._mounted: dict[str, None] = {}   # the refs this process mounted, oldest first
        self._mount_lock = threading.Lock()

    # -- availability -----------------------------------------------------------------

    @functools.cache   # noqa: B019 - one builder per process; the machine does not change
    def unavailable_reason(self) -> str | None:
        if not self.podman:
            return "podman is not installed (`make install` installs it)"
        if os.geteuid() != 0:
            return "building task images needs root (rootful podman and image mounts)"
        if not shutil.which("runc", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"):
            return "runc is not installed (crun cannot run here)"
        return None

    @functools.cached_property
    def _env(self) -> dict[str, str]:
        """podman's environment: our containers.conf, written once per process."""
        if not self.conf.exists() or self.conf.read_text() != CONTAINERS_CONF:
            tmp = self.conf.with_suffix(".tmp")
            tmp.write_text(CONTAINERS_CONF)
            tmp.replace(self.conf)
        return {**os.environ, "CONTAINERS_CONF": str(self.conf)}

    def _podman(self, *args: str, timeout: float = 120.0,
                check: bool = True) -> subprocess.CompletedProcess:
        try:
            res = subprocess.run([self.podman, *args], capture_output=True, text=True,
                                 timeout=timeout, env=self._env)
        except subprocess.TimeoutExpired as e:
            raise SandboxError(f"podman {args[0]} timed out after {timeout:.0f} s") from e
        if check and res.returncode != 0:
            raise SandboxError(f"podman {' '.join(args[:2])} failed: "
                               f"{(res.stderr or res.stdout).strip()[-600:]}")
        return res

    def image_id(self, ref: str) -> str | None:
        res = self._podman("image", "inspect", "--format", "{{.Id}}", ref, check=False)
        return res.stdout.strip() or None if res.returncode == 0 else None

    def _ulimits(self) -> list[str]:
        return [a for k, v in container_ulimits().items() for a in ("--ulimit", f"{k}={v}:{v}")]

    @contextlib.contextmanager
    def _lock(self, name: str):
        """One builder per image at a time, across processes."""
        locks = self.dir / "locks"
        locks.mkdir(exist_ok=True)
        with open(locks / f"{name}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    # -- base images ------------------------------------------------------------------

    def ensure_base(self, ref: str) -> str:
        """The id of the local base image `ref`, building it if it is one of ours."""
        if ref in self._bases:
            return self._bases[ref]
        if (iid := self.image_id(ref)) is not None:
            self._bases[ref] = iid
            return iid
        with self._lock(re.sub(r"[^A-Za-z0-9_.-]", "_", ref)):
            iid = self.image_id(ref)
            if iid is None:
                if ref == DEBIAN_IMAGE:
                    self._build_debian()
                elif (recipe := recipe_of(ref)) is not None:
                    self.ensure_base(recipe[0])
                    self._build_recipe(ref, recipe[1])
                else:
                    raise BuildRefused(f"local image {ref!r} does not exist (build or "
                                       f"load it with podman first)")
                iid = self.image_id(ref)
                assert iid is not None
        self._bases[ref] = iid
        return iid

    def _build_debian(self) -> None:
        mmdebstrap = shutil.which("mmdebstrap")
        if mmdebstrap is None:
            raise ImagesUnavailable("mmdebstrap is not installed",
                                    hint="apt-get install -y mmdebstrap (make install does)")
        hook = ""
        if HOST_CA_BUNDLE.is_file():
            hook = ('mkdir -p "$1/usr/local/share/ca-certificates" && cp '
                    f'{HOST_CA_BUNDLE} "$1/usr/local/share/ca-certificates/host.crt" && '
                    'chroot "$1" update-ca-certificates >/dev/null')
        with tempfile.TemporaryDirectory(prefix="ridgeline-base-") as tmp:
            tar = Path(tmp) / "rootfs.tar"
            argv = [mmdebstrap, "--quiet", "--variant=minbase", "--include=ca-certificates",
                    *(["--customize-hook", hook] if hook else []), "bookworm", str(tar)]
            res = subprocess.run(argv, capture_output=True, text=True, timeout=900)
            if res.returncode != 0:
                raise ImagesUnavailable(
                    f"mmdebstrap could not build the Debian base image: "
                    f"{(res.stderr or res.stdout).strip()[-600:]}",
                    hint="the Debian mirror must be reachable (apt-get update works?)")
            changes = [f"ENV=PATH={IMAGE_PATH}", *(f"ENV={k}={v}" for k, v in CA_ENV.items()),
                       'CMD=["/bin/bash"]']
            self._podman("import", *(x for c in changes for x in ("--change", c)), str(tar),
                         DEBIAN_IMAGE, timeout=300)

    def _build_recipe(self, ref: str, recipe: str) -> None:
        with tempfile.TemporaryDirectory(prefix="ridgeline-recipe-") as tmp:
            (Path(tmp) / "Dockerfile").write_text(recipe)
            res = self._podman("build", "--pull=never", *self._ulimits(),
                               "-t", ref, tmp, timeout=BUILD_TIMEOUT_S, check=False)
            if res.returncode != 0:
                raise ImagesUnavailable(f"building {ref} failed: "
                                        f"{(res.stderr + res.stdout).strip()[-600:]}")

    # -- task images ------------------------------------------------------------------

    def build(self, dockerfile: Path, context: Path, *, no_cache: bool = False
              ) -> BuiltImage:
        """Build (or find) the image of `dockerfile` with `context`; mount its root.
        `no_cache` rebuilds every layer (a first build's cost, for benchmarks).
        Raises `BuildRefused` for what cannot be built here."""
        if (why := self.unavailable_reason()) is not None:
            raise ImagesUnavailable(why)
        text, bases = rewrite_dockerfile(dockerfile)
        h = hashlib.sha256(text.encode())
        for b in bases:
            h.update(self.ensure_base(b).encode())
        # the files' contents are read once per process while the context is unchanged
        # (a task's data can be large; every episode prepares its environment)
        stamp = context_stamp(context)
        if (digest := self._digests.get(stamp)) is None:
            digest = self._digests[stamp] = context_digest(context)
        h.update(digest.encode())
        ref = f"{TASK_REPO}:{h.hexdigest()[:24]}"
        known = self._built.get(ref)
        if known is not None and not no_cache and known.rootfs.joinpath("usr").is_dir():
            return known if known.cached else replace(known, build_s=0.0, cached=True)
        t0 = time.perf_counter()
        cached = True
        with self._lock(ref.rsplit(":", 1)[1]):
            iid = None if no_cache else self.image_id(ref)
            if iid is None:
                cached = False
                self._build_task(ref, text, dockerfile, context, no_cache)
                iid = self.image_id(ref)
                if iid is None:
                    raise SandboxError(f"podman built {ref} but cannot find it")
            rootfs = self._mount(ref)
            config = self.config(ref)
        image = BuiltImage(ref, iid, rootfs, config,
                           0.0 if cached else time.perf_counter() - t0, cached)
        self._built[ref] = image
        return image

    def _mount(self, ref: str) -> Path:
        rootfs = Path(self._podman("image", "mount", ref).stdout.strip())
        with self._mount_lock:
            self._mounted.pop(ref, None)
            self._mounted[ref] = None
        return rootfs

    def acquire(self, image: BuiltImage) -> None:
        """A sandbox runs on `image`: it stays mounted until `release`."""
        with self._mount_lock:
            self._users[image.ref] = self._users.get(image.ref, 0) + 1
            if image.ref in self._mounted:   # most recently used last
                self._mounted.pop(image.ref)
                self._mounted[image.ref] = None

    def unmount_idle(self, keep: int = 0) -> None:
        """Unmount the images this process mounted that no sandbox runs on, but for the
        `keep` latest (at exit, none: mounts outlive the process otherwise). A sandbox
        still on an unmounted image keeps its own bind of the tree."""
        with self._mount_lock:
            idle = [r for r in self._mounted if not self._users.get(r)]
            drop = idle[:max(0, len(idle) - keep)]
            for r in drop:
                self._mounted.pop(r)
                self._built.pop(r, None)
        for r in drop:
            self._podman("image", "unmount", r, check=False)

    def release(self, image: BuiltImage) -> None:
        """A sandbox on `image` closed; unmount idle images beyond the few kept."""
        with self._mount_lock:
            self._users[image.ref] = max(0, self._users.get(image.ref, 0) - 1)
        self.unmount_idle(keep=MAX_IDLE_MOUNTS)

    def save(self, ref: str, path: Path) -> None:
        """`ref` as a `docker save` archive at `path` (for a Docker engine whose image
        store is not podman's)."""
        self._podman("save", "--format", "docker-archive", "-o", str(path), ref,
                     timeout=BUILD_TIMEOUT_S)

    def api_service(self, socket_path: Path) -> subprocess.Popen:
        """podman's Docker-compatible API on a unix socket, with our containers.conf
        (runc): the docker backend's engine where no Docker daemon runs. The caller
        stops it (terminate)."""
        if (why := self.unavailable_reason()) is not None:
            raise ImagesUnavailable(why)
        proc = subprocess.Popen([self.podman, "system", "service", "--time=0",
                                 f"unix://{socket_path}"], env=self._env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while not socket_path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise SandboxError(f"podman system service did not start: {err[-400:]}")
            time.sleep(0.05)
        return proc

    def local(self, ref: str) -> BuiltImage:
        """A mapped base image (`python:3.12` -> ours) as a runnable image: for compose
        services that name an image instead of a build."""
        if (why := self.unavailable_reason()) is not None:
            raise ImagesUnavailable(why)
        local = map_base(ref)
        if local is None:
            raise BuildRefused(f"image {ref!r} has no local equivalent (map it with "
                               f"{MAP_ENV})")
        iid = self.ensure_base(local)
        return BuiltImage(local, iid, self._mount(local), self.config(local), 0.0, True)

    def _build_task(self, ref: str, text: str, dockerfile: Path, context: Path,
                    no_cache: bool = False) -> None:
        fd, path = tempfile.mkstemp(prefix="ridgeline-", suffix=".Dockerfile")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            res = self._podman("build", "--pull=never",
                               "--no-cache" if no_cache else "--layers",
                               *self._ulimits(), "-f", path, "-t", ref, str(context),
                               timeout=BUILD_TIMEOUT_S, check=False)
        finally:
            os.unlink(path)
        if res.returncode != 0:
            raise build_failure(res.stdout + "\n" + res.stderr, dockerfile)

    def config(self, ref: str) -> ImageConfig:
        raw = self._podman("image", "inspect", "--format", "{{json .Config}}", ref).stdout
        cfg = json.loads(raw or "{}") or {}
        env = dict(e.split("=", 1) for e in cfg.get("Env") or [] if "=" in e)
        return ImageConfig(env=env, workdir=cfg.get("WorkingDir") or "/",
                           user=cfg.get("User") or "",
                           entrypoint=tuple(cfg.get("Entrypoint") or ()),
                           cmd=tuple(cfg.get("Cmd") or ()))


#: Build output that means the registries do not have something, or the open internet
#: is needed: the task is unsupported here (never an infrastructure error).
_NEEDS = [
    (re.compile(r"Unable to locate package (\S+)|E: Package '([^']+)' has no installation"),
     "the Debian mirror has no package {0}"),
    (re.compile(r"No matching distribution found for (\S+)"), "PyPI has no {0}"),
    (re.compile(r"Could not resolve host: (\S+)|Failed to resolve '([^']+)'|"
                r"Temporary failure in name resolution|Name or service not known"),
     "the build needs the open internet ({0})"),
]
_INFRA = re.compile(r"runc create failed|OCI runtime|no space left on device|"
                    r"error creating overlay|storage driver", re.IGNORECASE)


def build_failure(output: str, dockerfile: Path) -> Exception:
    """A failed `podman build` as `BuildRefused` (the task's build cannot work here) or
    `SandboxError` (podman itself failed), naming the Dockerfile line."""
    # a multi-stage build prefixes each step with its stage: "[2/2] STEP 6/10: ..."
    steps = re.findall(r"^(?:\[\d+/\d+\] )?STEP \d+/\d+: (.*)$", output, re.MULTILINE)
    step = steps[-1] if steps else None
    line = _instruction_line(step, dockerfile) if step else None
    tail = " | ".join(ln.strip() for ln in output.strip().splitlines()[-4:] if ln.strip())
    if _INFRA.search(output):
        return SandboxError(f"podman failed building the task image at {step!r}: "
                            f"{tail[-500:]}")
    for pattern, what in _NEEDS:
        if (m := pattern.search(output)) is not None:
            name = next((g for g in m.groups() if g), m.group(0))
            return BuildRefused(what.format(name) + f" ({(step or '')[:80]})", line)
    return BuildRefused(f"the build failed here: {(step or '')[:80]!r}: {tail[-400:]}", line)


def _instruction_line(step: str, dockerfile: Path) -> int | None:
    want = " ".join(step.split())
    try:
        instructions = parse_dockerfile(dockerfile)
    except Exception:   # noqa: BLE001 - a line number is a courtesy, never a new failure
        return None
    for ins in instructions:
        flags = " ".join(f"--{k}={v}" for k, v in ins.flags.items())
        for text in (f"{ins.keyword} {ins.args}", f"{ins.keyword} {flags} {ins.args}"):
            if " ".join(text.split()) == want:
                return ins.line
    kw = want.split(" ", 1)[0]
    for ins in instructions:   # podman may print the instruction reformatted
        if ins.keyword == kw and " ".join(ins.args.split())[:40] in want:
            return ins.line
    return None


MODE_ENV = "RIDGELINE_TASK_ENV"
MODES = ("auto", "image", "host")
_builder: ImageBuilder | None = None


def environment_mode() -> str:
    """How task environments with a Dockerfile are made: `image` (built for real by
    podman), `host` (the Dockerfile interpreted onto the host's root filesystem, the
    fallback where images cannot be built) or `auto` (image where possible)."""
    mode = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise ConfigError(f"{MODE_ENV}={mode!r} is not one of {', '.join(MODES)}",
                          hint="auto picks image where podman can build, else host")
    return mode


def uses_images(mode: str | None = None) -> bool:
    """Whether Dockerfile tasks get real images under `mode` (default: from the env)."""
    mode = mode or environment_mode()
    if mode == "host":
        return False
    return mode == "image" or builder().unavailable_reason() is None


def builder() -> ImageBuilder:
    global _builder
    if _builder is None:
        _builder = ImageBuilder()
        atexit.register(_builder.unmount_idle)
    return _builder
