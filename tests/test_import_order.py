"""The import order of shared/DESIGN.md, `sandbox, engine -> llm -> tasks -> agent -> rl,
eval -> platform`, with `serve` above engine and llm (docs/architecture.md): a module may
import a subsystem to its left, never one beside it or to its right. Checked on the source
(every import, lazy ones inside functions included) and on what importing loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import ridgeline

SRC = Path(ridgeline.__file__).parent
# Lower layers first (errors and config are the foundation every subsystem uses);
# packages in one layer may not import each other.
LAYERS = [{"errors", "cpu"}, {"config"}, {"wire", "chat_format"}, {"sandbox", "engine"}, {"llm"}, {"tasks", "serve"},
          {"agent"}, {"rl", "eval"}, {"platform"}, {"cli"}]
LAYER = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """`(dotted name, line)` for every absolute import in a file, lazy ones included;
    `from pkg import name` counts as `pkg.name` for `ridgeline` and `ridgeline.engine`
    (whose names may be modules)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
            if node.module in ("ridgeline", "ridgeline.engine"):  # from ridgeline import engine
                names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(name, node.lineno) for name in names]
    return found


def imported_subsystems(path: Path) -> list[tuple[str, int]]:
    """`(subsystem, line)` for every absolute `ridgeline.<subsystem>` import in a file."""
    found = []
    for name, line in imported_modules(path):
        parts = name.split(".")
        if parts[0] == "ridgeline" and len(parts) > 1 and parts[1] in LAYER:
            found.append((parts[1], line))
    return found


def source_files() -> list[Path]:
    # builtin tasks hold the programs agents fix (some deliberately broken): not ours
    return [p for p in SRC.rglob("*.py") if "builtin" not in p.relative_to(SRC).parts]


def test_no_module_imports_beside_or_to_its_right() -> None:
    wrong = []
    for path in source_files():
        owner = path.relative_to(SRC).parts[0].removesuffix(".py")
        if owner not in LAYER:  # ridgeline/__init__.py
            continue
        for target, line in imported_subsystems(path):
            if target != owner and LAYER[target] >= LAYER[owner]:
                wrong.append(f"{path.relative_to(SRC)}:{line} ({owner}) imports ridgeline.{target}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("module", "must_not_load"), [
    ("ridgeline.engine", ("ridgeline.llm", "ridgeline.serve")),
    # EngineClient imports the engine when it builds one, not before
    ("ridgeline.llm", ("ridgeline.engine", "ridgeline.serve", "torch")),
    # `ridgeline --help` mounts serve's CLI; FastAPI loads only when serving
    ("ridgeline.serve.cli", ("ridgeline.serve.app", "fastapi")),
    # the platform's API processes and workers never run a model in-process, and speak
    # the wire format without the model server (ridgeline.wire)
    ("ridgeline.platform.service", ("torch", "ridgeline.serve")),
])
def test_importing_loads_only_what_is_to_the_left(module: str,
                                                  must_not_load: tuple[str, ...]) -> None:
    code = (f"import sys, {module}; "
            f"print(sorted(m for m in sys.modules if m.startswith({must_not_load!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", f"importing {module} loaded {out.strip()}"


def test_the_platform_imports_nothing_from_the_model_server() -> None:
    """The platform speaks OpenAI's wire format through `ridgeline.wire`; `serve` is a
    model server it may call over HTTP, never a library it imports."""
    wrong = [f"{path.relative_to(SRC)}:{line}"
             for path in (SRC / "platform").rglob("*.py")
             for target, line in imported_subsystems(path) if target == "serve"]
    assert not wrong, "\n".join(wrong)


# Inside the engine, from the bottom up: the data every layer passes around, the C
# kernels, running a model, speculative decoding, the step loop, and the public entry
# points. `ridgeline.engine` itself (the lazy public names) counts as the top.
ENGINE_LAYERS = [{"config", "sampling_params", "sequence", "outputs", "structured"}, {"kernels"},
                 {"model_executor"}, {"spec_decode"}, {"core"},
                 {"llm", "cli", "draft_training", "__init__"}]
ENGINE_LAYER = {part: i for i, layer in enumerate(ENGINE_LAYERS) for part in layer}


def engine_part(module: str) -> str | None:
    """The engine layer part a dotted `ridgeline.engine...` module belongs to."""
    parts = module.split(".")
    if parts[:2] != ["ridgeline", "engine"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def test_engine_packages_import_only_those_below_them() -> None:
    engine = SRC / "engine"
    assert set(ENGINE_LAYER) >= {p.name.removesuffix(".py") for p in engine.iterdir()
                                 if p.suffix == ".py" or (p / "__init__.py").exists()}, \
        "a new engine module or package needs its place in ENGINE_LAYERS"
    wrong = []
    for path in engine.rglob("*.py"):
        owner = path.relative_to(engine).parts[0].removesuffix(".py")
        for name, line in imported_modules(path):
            target = engine_part(name)
            if target is None or target == owner:
                continue
            if target not in ENGINE_LAYER:  # `from ridgeline.engine import LLM`
                target = "__init__"
            if ENGINE_LAYER[target] > ENGINE_LAYER[owner]:
                wrong.append(f"engine/{path.relative_to(engine)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


BENCHMARKS = SRC.parents[1] / "benchmarks"


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.py")), ids=lambda p: p.name)
def test_a_benchmark_imports_bench_common_before_torch(path: Path) -> None:
    """bench_common sets OMP_WAIT_POLICY before torch loads its OpenMP runtime; a benchmark
    that loads torch first measures spinning idle workers (an import sorter once moved
    `import torch` up and cost spec_bench's `:fast-q` a third of its speed)."""
    top = [(n, line) for n, line in imported_modules(path) if n.split(".")[0] in ("torch", "bench_common")]
    first = {}
    for name, line in top:
        first.setdefault(name.split(".")[0], line)
    if "torch" in first and "bench_common" in first:
        assert first["bench_common"] < first["torch"], f"{path.name}: import bench_common before torch"
