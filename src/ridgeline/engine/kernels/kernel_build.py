"""Building and loading the engine's C kernels (the sources in `csrc/`).

Each kernel module (`cpu_kernels`, `linear_kernel`, `decode_ops`, `decode_stack`) reads its
source with `read_source`, compiles it on first use with the system C compiler
(`compile_library`: the first of its flag sets that compiles wins) and loads it with ctypes
through a `LazyLibrary`. A build lands in `~/.cache/ridgeline/kernels/` (or
`$RIDGELINE_CACHE_DIR/kernels/`) under a name keyed by the source text, the flags, the
compiler and the CPU's flags, so it is compiled once per machine and rebuilt when any of
them changes. The source is compiled from its text (written to a temporary file in the
cache directory), not from the package's file, so an installed wheel builds the same way.

Without a compiler, or where no flag set compiles, a build is None and callers keep their
PyTorch path, which computes the same thing.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.resources
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from ridgeline.cpu import cpu_info

log = logging.getLogger(__name__)

#: Changes when the way the library is built changes (part of the cache key).
_RECIPE = "compile, then link without -ffast-math"


def read_source(name: str) -> str:
    """The C source `csrc/<name>.c`, as packaged (read from a wheel too)."""
    csrc = importlib.resources.files("ridgeline.engine.kernels") / "csrc"
    return (csrc / f"{name}.c").read_text(encoding="utf-8")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (`ridgeline.cpu`; empty off Linux), read once."""
    return cpu_info().flags


def _cpu_signature() -> str:
    return platform.machine() + " ".join(sorted(cpu_flags()))


def _cache_dir() -> Path:
    env = os.environ.get("RIDGELINE_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "ridgeline") / "kernels"


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc or gcc on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_flags(flags: list[str]) -> list[str]:
    """A flag set's flags for the compile step (the link step takes -shared and -l...)."""
    return [f for f in flags if not f.startswith("-l") and f != "-shared"]


def compile_library(name: str, source: str, flag_sets: list[list[str]],
                    recipe: str = _RECIPE) -> Path | None:
    """`source` compiled into a shared library under the kernel cache (built once per
    source, flags, compiler and CPU; the first flag set that compiles wins), or None when
    no compiler is found or none of the flag sets compiles. Shared by the C kernels."""
    compiler = find_compiler()
    if compiler is None:
        log.info("no C compiler found: %s uses the PyTorch path", name)
        return None
    key = hashlib.sha256((source + repr(flag_sets) + compiler + _cpu_signature() + recipe)
                         .encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    if target.is_file():
        return target
    errors = []
    for flags in flag_sets:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / f"{name}.c"
                src.write_text(source)
                obj, so = Path(tmp) / "out.o", Path(tmp) / "out.so"
                libs = [f for f in flags if f.startswith("-l")]
                # Compile and link apart: linking with -ffast-math adds crtfastmath.o,
                # whose constructor sets flush-to-zero for the whole process on load
                # (every later float op in Python, numpy and torch would lose subnormals).
                subprocess.run([compiler, *compile_flags(flags), "-c", "-o", str(obj),
                                str(src)], check=True, capture_output=True, timeout=120)
                subprocess.run([compiler, "-shared", "-fPIC", "-o", str(so), str(obj), *libs],
                               check=True, capture_output=True, timeout=120)
                os.replace(so, target)  # atomic: concurrent builders race harmlessly
            return target
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    log.warning("could not compile the %s kernel (%s); using the PyTorch path", name,
                "; ".join(errors))
    return None


def open_library(name: str, source: str, flag_sets: list[list[str]]) -> ctypes.CDLL | None:
    """`compile_library`'s result loaded with ctypes; None off Linux (the kernels' thread
    and memory calls are Linux's) or where nothing compiles."""
    if not sys.platform.startswith("linux"):
        return None
    target = compile_library(name, source, flag_sets)
    return None if target is None else ctypes.CDLL(str(target))


class LazyLibrary:
    """A kernel library built on first call, once per process; None where it cannot be
    built. Once built it is read without the lock: the kernels run on every small op.
    Every C kernel of the engine loads through one (`load` of each module)."""

    def __init__(self, build: Callable[[], ctypes.CDLL | None]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._built = False

    def __call__(self) -> ctypes.CDLL | None:
        if self._built:
            return self._lib
        with self._lock:
            if not self._built:
                self._lib = self._build()
                self._built = True  # only now: no reader sees "built" before the library
        return self._lib
