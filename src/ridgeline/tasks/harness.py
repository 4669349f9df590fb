"""The harness's own tools, mounted read-only into every task sandbox.

One directory per host Python, made once and reused::

    offline_tools.py   the offline uv/curl/apt-get/... (see its docstring)
    ridgeline_ctrf.py  pytest plugin for `--ctrf` reports
    config.json        the host interpreter and its site-packages
    bin/               uv, uvx, curl, wget, apt-get, apt, apk: first on PATH at run time
    build-bin/         pip, pip3, python, python3, rm: first on PATH for Dockerfile RUN

Inside the sandbox it is at `HARNESS_MOUNT`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import site
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

HARNESS_MOUNT = "/ridgeline"
RUNTIME_TOOLS = ("uv", "uvx", "curl", "wget", "apt-get", "apt", "apk")
BUILD_TOOLS = {"pip": "pip", "pip3": "pip3", "python": "python", "python3": "python",
               "rm": "rm"}
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OFFLINE_MARK = "ridgeline-offline:"
_SOURCES = ("offline_tools.py", "ridgeline_ctrf.py")


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


@functools.cache
def harness_tools() -> HarnessTools:
    """Build (once per host Python and tool version) and return the tools directory."""
    here = Path(__file__).resolve().parent
    python = sys.executable
    config = {"python": python, "site_dirs": _site_dirs()}
    h = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in (*_SOURCES, "harness.py"):
        h.update((here / name).read_bytes())
    root = Path(tempfile.gettempdir()) / f"ridgeline-harness-{h.hexdigest()[:16]}"
    if not (root / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix="ridgeline-harness-build-"))
        for name in _SOURCES:
            shutil.copy2(here / name, tmp / name)
        for sub, tools in (("bin", {t: t for t in RUNTIME_TOOLS}), ("build-bin", BUILD_TOOLS)):
            (tmp / sub).mkdir()
            for name, tool in tools.items():
                wrapper = tmp / sub / name
                # resolved from the wrapper's own location: links to it ($HOME/.local/bin
                # after the uv installer idiom) and host-side use both work
                wrapper.write_text(f'#!/bin/sh\nhere=$(dirname "$(readlink -f "$0")")\n'
                                   f'exec "{python}" -I -S "$here/../offline_tools.py" '
                                   f'{tool} "$@"\n')
                wrapper.chmod(0o755)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tmp.chmod(0o755)
        try:
            tmp.rename(root)
        except OSError:         # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return HarnessTools(root, python)
