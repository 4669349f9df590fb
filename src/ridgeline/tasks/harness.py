"""The harness's own tools, mounted read-only into every task sandbox.

One directory per host Python, made once and reused::

    offline_tools.py   the offline uv/curl/apt-get/... (see its docstring)
    ridgeline_ctrf.py  pytest plugin for `--ctrf` reports
    ridgeline_report.py  the verifier's reporter (pytest plugin; see its docstring)
    config.json        the host interpreter and its site-packages
    bin/               uv, uvx, curl, wget, apt-get, apt, apk: first on PATH at run time
    build-bin/         pip, pip3, python, python3, rm: first on PATH for Dockerfile RUN

Inside the sandbox it is at `HARNESS_MOUNT`.

The shared directory lives in the system temp dir under a predictable name, so another
host user could make it first and plant tools that sandboxes (and their host-side
callers) would run. It is therefore used only when it is exactly what this process
would build: a real directory (not a symlink), owned by our effective uid, mode 0755
(sandboxes may run as another uid and must read it, nobody else may write it), holding
exactly the expected regular files, each with the expected mode and bytes. Anything
else is left alone and this process builds and uses a fresh private copy (an
unpredictable `mkdtemp` name that nobody can pre-create), with a warning.
"""

from __future__ import annotations

import atexit
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import stat
import site
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ridgeline.errors import SandboxError

log = logging.getLogger(__name__)

HARNESS_MOUNT = "/ridgeline"
RUNTIME_TOOLS = ("uv", "uvx", "curl", "wget", "apt-get", "apt", "apk")
BUILD_TOOLS = {"pip": "pip", "pip3": "pip3", "python": "python", "python3": "python",
               "rm": "rm"}
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OFFLINE_MARK = "ridgeline-offline:"
_SOURCES = ("offline_tools.py", "ridgeline_ctrf.py", "ridgeline_report.py")


@dataclass(frozen=True)
class HarnessTools:
    host_dir: Path          # where the directory is on the host
    python: str             # the interpreter that runs tests and tools inside

    @property
    def bin(self) -> str:
        return f"{HARNESS_MOUNT}/bin"

    @property
    def build_bin(self) -> str:
        return f"{HARNESS_MOUNT}/build-bin"

    @property
    def python_bin(self) -> str:
        """The directory of the host interpreter (a venv's bin: python, pip, pytest)."""
        return str(Path(self.python).parent)

    def runtime_path(self) -> str:
        return f"{self.bin}:{self.python_bin}:{SYSTEM_PATH}"


def _site_dirs() -> list[str]:
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    try:
        dirs += site.getsitepackages()
    except AttributeError:
        pass
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


class HarnessDirError(SandboxError):
    """The harness tools directory could not be made trustworthy."""


# relative path -> (bytes, mode): the whole tree, so it can be built and verified
Tree = dict[str, tuple[bytes, int]]


def _wrapper(python: str, tool: str) -> str:
    # resolved from the wrapper's own location: links to it ($HOME/.local/bin after
    # the uv installer idiom) and host-side use both work
    return (f'#!/bin/sh\nhere=$(dirname "$(readlink -f "$0")")\n'
            f'exec "{python}" -I -S -B "$here/../offline_tools.py" {tool} "$@"\n')


def _tree(python: str) -> Tree:
    here = Path(__file__).resolve().parent
    config = {"python": python, "site_dirs": _site_dirs()}
    tree: Tree = {name: ((here / name).read_bytes(), 0o644) for name in _SOURCES}
    for sub, tools in (("bin", {t: t for t in RUNTIME_TOOLS}), ("build-bin", BUILD_TOOLS)):
        for name, tool in tools.items():
            tree[f"{sub}/{name}"] = (_wrapper(python, tool).encode(), 0o755)
    tree["config.json"] = (json.dumps(config, indent=2).encode(), 0o644)
    return tree


def _shared_name(tree: Tree) -> str:
    h = hashlib.sha256((Path(__file__).resolve()).read_bytes())
    for rel in sorted(tree):
        h.update(rel.encode() + b"\0" + tree[rel][0])
    return f"ridgeline-harness-{h.hexdigest()[:16]}"


def _dirs(tree: Tree) -> list[str]:
    return sorted({"", *(os.path.dirname(rel) for rel in tree)})


def untrusted_reason(root: Path, tree: Tree) -> str | None:
    """None when `root` is exactly `tree`, built by us and writable only by us (checked
    with lstat, so no symlink is followed); otherwise what is wrong."""
    uid = os.geteuid()
    want = {**{d: (None, 0o755) for d in _dirs(tree)}, **tree}
    for rel, (data, mode) in sorted(want.items()):
        path = root / rel if rel else root
        try:
            st = os.lstat(path)
        except OSError as e:
            return f"{path}: {e.strerror}"
        kind = stat.S_ISDIR if data is None else stat.S_ISREG
        if not kind(st.st_mode):
            return f"{path} is not a {'directory' if data is None else 'regular file'}"
        if st.st_uid != uid:
            return f"{path} is owned by uid {st.st_uid}, not {uid}"
        if stat.S_IMODE(st.st_mode) != mode:
            return f"{path} has mode {stat.S_IMODE(st.st_mode):o}, not {mode:o}"
        if data is not None and _read_nofollow(path) != data:
            return f"{path} has unexpected contents"
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            rel = os.path.relpath(os.path.join(dirpath, n), root)
            if rel not in want and not _own_bytecode(root / rel, uid):
                return f"{root / rel} is not part of the harness"
    return None


def _own_bytecode(path: Path, uid: int) -> bool:
    """A `__pycache__` directory (or a .pyc in one) that Python wrote for us when a host
    process imported the harness's modules: ours and writable only by us, so as trusted
    as the rest of the tree (anyone else's is refused like any other stray entry)."""
    parts = path.parts
    if "__pycache__" not in parts or (path.name != "__pycache__"
                                      and not path.name.endswith(".pyc")):
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    kind_ok = stat.S_ISDIR(st.st_mode) if path.name == "__pycache__" else \
        stat.S_ISREG(st.st_mode)
    return (kind_ok and st.st_uid == uid
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _read_nofollow(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _build(parent: Path, tree: Tree) -> Path:
    """Write `tree` into a fresh private directory under `parent`; modes set explicitly
    (the umask and the checkout's own modes must not leak in)."""
    tmp = Path(tempfile.mkdtemp(prefix="ridgeline-harness-build-", dir=parent))
    for d in _dirs(tree)[1:]:
        (tmp / d).mkdir()
        os.chmod(tmp / d, 0o755)
    for rel, (data, mode) in tree.items():
        fd = os.open(tmp / rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp / rel, mode)
    os.chmod(tmp, 0o755)
    return tmp


def _remove_at_exit(path: Path) -> None:
    pid = os.getpid()       # a forked child must not remove its parent's directory
    atexit.register(lambda: os.getpid() == pid and shutil.rmtree(path, ignore_errors=True))


def tools_dir(parent: Path, python: str) -> Path:
    """The verified tools directory under `parent`: the shared one when it can be
    trusted (making it if missing), otherwise a fresh private one for this process."""
    tree = _tree(python)
    root = parent / _shared_name(tree)
    if untrusted_reason(root, tree) is None:
        return root
    tmp = _build(parent, tree)
    try:
        os.rename(tmp, root)    # fails if anything (not an empty dir) is there already
        tmp = root
    except OSError as e:        # whatever is at `root` is checked just below
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):  # not "another process made it"
            log.warning("could not move the harness directory %s to %s: %s", tmp, root, e)
    if (reason := untrusted_reason(root, tree)) is None:
        if tmp != root:         # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
        return root
    if (bad := untrusted_reason(tmp, tree)) is not None:
        raise HarnessDirError(f"cannot build the harness tools directory: {bad}",
                              hint="point TMPDIR at a directory only you can write")
    log.warning("not using the shared harness directory (%s); using a private copy at "
                "%s for this process", reason, tmp)
    _remove_at_exit(tmp)
    return tmp


_tools_lock = threading.Lock()


def harness_tools() -> HarnessTools:
    """Build (once per host Python and tool version) and return the tools directory.
    Parallel episodes ask at once: one builds or checks it, the others wait."""
    with _tools_lock:
        return _harness_tools()


@functools.cache
def _harness_tools() -> HarnessTools:
    python = sys.executable
    return HarnessTools(tools_dir(Path(tempfile.gettempdir()), python), python)
