"""The engine's C kernels live in C files (`ridgeline/engine/kernels/csrc/`), not in Python strings:
each compiles without a warning in every variant the engine builds (and for the other CPUs
those variants stand for), the package ships them, and the limits the Python side checks
against are the C's."""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib.resources
import platform
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

import ridgeline
from ridgeline.engine.kernels import (
    cpu_kernels,
    decode_ops,
    decode_stack,
    kernel_build,
    linear_kernel,
)

SRC = Path(ridgeline.__file__).parent
CSRC = SRC / "engine" / "kernels" / "csrc"
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

X86 = platform.machine().lower() in ("x86_64", "amd64")
_NO_AVX512 = ["-mno-avx512f"] if X86 else []
# Each module's flag sets with the extra flags of each of its builds (`load()`, and
# cpu_kernels' `avx2_library`/`portable_library`, linear_kernel's `portable_library`).
VARIANTS = {
    "paged_attention": [[*flags, *extra] for extra in
                        ([], _NO_AVX512, [*_NO_AVX512, "-DRIDGELINE_PORTABLE"])
                        for flags in cpu_kernels._FLAG_SETS],
    "small_linear": [[*linear_kernel._FLAGS, *extra] for extra in ([], _NO_AVX512)],
    "decode_ops": decode_ops._FLAGS,
    "decode_stack": decode_stack._FLAGS,
}
# -march=native builds what this CPU has; these stand for the CPUs it may lack (AVX-512
# with and without AVX512_BF16, AVX2 + FMA), which the compiler targets all the same. (The
# builds with extra flags pin a narrower path: -march=native covers them.)
OTHER_CPUS = (["-march=x86-64-v4", "-mavx512bf16"], ["-march=x86-64-v4"],
              ["-march=x86-64-v3"]) if X86 else ()


def _compiles(name: str) -> list[tuple[str, ...]]:
    """The compile flags of every variant of source `name`, each once."""
    out: dict[tuple[str, ...], None] = {}
    for flags in VARIANTS[name]:
        flags = kernel_build.compile_flags(flags)
        out[tuple(flags)] = None
        if "-march=native" in flags and not ({"-mno-avx512f", "-DRIDGELINE_PORTABLE"}
                                             & set(flags)):
            at = flags.index("-march=native")
            for cpu in OTHER_CPUS:
                out[tuple(flags[:at] + cpu + flags[at + 1:])] = None
    return list(out)


CASES = [(name, flags) for name in VARIANTS for flags in _compiles(name)]


def test_every_c_file_is_a_kernel_built_here() -> None:
    assert sorted(p.stem for p in CSRC.glob("*.c")) == sorted(VARIANTS)


@functools.cache
def _compiler() -> str:
    compiler = kernel_build.find_compiler()
    if compiler is None:
        pytest.skip("no C compiler")
    return compiler


@functools.cache
def _knows(compiler: str, march: str) -> bool:
    return subprocess.run([compiler, march, "-E", "-x", "c", "-"], input="",
                          capture_output=True).returncode == 0


@pytest.mark.parametrize(("name", "flags"), CASES,
                         ids=[f"{n}:{' '.join(f)}" for n, f in CASES])
def test_each_variant_compiles_without_warnings(name: str, flags: tuple[str, ...]) -> None:
    compiler = _compiler()
    march = next((f for f in flags if f.startswith("-march=")), "-march=native")
    if not _knows(compiler, march):
        pytest.skip(f"{compiler} does not know {march}")
    run = subprocess.run([compiler, *flags, "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                          str(CSRC / f"{name}.c")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


def _c_define(name: str, macro: str) -> int:
    found = re.findall(rf"^#define {macro} (\d+)\b", (CSRC / f"{name}.c").read_text(), re.M)
    assert len(found) == 1, f"#define {macro} in {name}.c: {found}"
    return int(found[0])


def test_the_python_limits_are_the_kernels() -> None:
    assert _c_define("paged_attention", "MAXQV") == cpu_kernels.MAX_QUERY_VECTORS
    assert _c_define("paged_attention", "MAXD") == cpu_kernels.MAX_HEAD_DIM
    assert _c_define("paged_attention", "MAXBS") == cpu_kernels.MAX_BLOCK_SIZE
    assert _c_define("paged_attention", "PLANES") == cpu_kernels.PREFILL_LANES


def test_the_package_ships_the_c_sources() -> None:
    csrc = importlib.resources.files("ridgeline.engine.kernels") / "csrc"
    for name in VARIANTS:
        assert kernel_build.read_source(name) == (csrc / f"{name}.c").read_text()
    if not PYPROJECT.is_file():
        pytest.skip("not run from a source checkout")
    patterns = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-data"]
    for path in CSRC.iterdir():
        rel = path.relative_to(SRC).as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns["ridgeline"]), rel


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes of a module and its classes and functions"""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, kinds) and node.body and isinstance(node.body[0], ast.Expr)
            and isinstance(node.body[0].value, ast.Constant)
            and isinstance(node.body[0].value.value, str)}


def test_no_module_holds_a_long_program_in_a_string() -> None:
    """Code in another language (C, Lua, SQL, HTML...) over 100 lines goes to a file of its
    own, where it can be read, linted and compiled as what it is."""
    long = []
    for path in SRC.rglob("*.py"):
        if "builtin" in path.relative_to(SRC).parts:  # the tasks' programs, some broken
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant)
                                                    and isinstance(node.value, str))) \
                    and id(node) not in docs and node.end_lineno - node.lineno >= 100:
                long.append(f"{path.relative_to(SRC)}:{node.lineno} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
