"""Loading tasks from disk, in either Terminal-Bench layout.

Version 1 (also Ridgeline's own built-in layout)::

    task.yaml  run-tests.sh  tests/  solution.sh | solution.yaml
    [Dockerfile | docker-compose.yaml]  [setup.sh]  [files/]

Version 2 (Harbor)::

    instruction.md  task.toml  environment/Dockerfile  solution/solve.sh  tests/test.sh

Errors name the file and, for YAML/TOML, the line and the field.

A task directory is untrusted input: every file the loader reads or hands on (to be
copied into a sandbox) must resolve inside the task directory, symlinks included, and a
compose file's `build.context`/`dockerfile` likewise; otherwise loading fails with a
`TaskError`, like any other malformed task. The direct children of `tests/` and
`solution/` are checked too, because they are copied following links; deeper symlinks
are copied as links and so only mean something inside the sandbox.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ridgeline.errors import NotFoundError, RidgelineError, TaskError
from ridgeline.tasks.dockerfile import inside, plan_build
from ridgeline.tasks.model import (Resources, Sidecar, SolutionStep, Task, TaskLayout,
                                    TaskStep)

# The files each layout reads or copies into a sandbox (relative to the task directory),
# and the directories whose direct children are copied following links.
V1_FILES = ("task.yaml", "run-tests.sh", "tests", "solution.sh", "solution.yaml",
            "Dockerfile", "docker-compose.yaml", "docker-compose.yml", "setup.sh", "files")
V2_FILES = ("task.toml", "instruction.md", "tests", "tests/test.sh", "environment",
            "environment/Dockerfile", "environment/docker-compose.yaml",
            "environment/setup.sh", "solution", "solution/solve.sh", "setup.sh")
STAGED_DIRS = ("tests", "solution")

log = logging.getLogger(__name__)

# Values Terminal-Bench's compose files interpolate; everything else becomes "".
COMPOSE_VARS = {"T_BENCH_TEST_DIR": "/tests", "T_BENCH_CONTAINER_LOGS_PATH": "/logs",
                "T_BENCH_CONTAINER_AGENT_LOGS_PATH": "/agent-logs", "TEST_DIR": "/tests"}


# --- task.yaml (Terminal-Bench v1) ----------------------------------------------------

class _Description(BaseModel):
    key: str = "base"
    description: str


class _ResourcesYaml(BaseModel):
    """Ridgeline extension of task.yaml (v1 has no resource section)."""

    model_config = ConfigDict(extra="forbid")
    cpus: float = Field(1.0, gt=0)
    memory_mb: int = Field(2048, gt=0)
    storage_mb: int = Field(10240, gt=0)
    allow_internet: bool = False


class _TaskYaml(BaseModel):
    model_config = ConfigDict(extra="allow")
    instruction: str | None = None
    descriptions: list[_Description] | None = None
    author_email: str | None = None
    author_name: str | None = None
    difficulty: str = "unknown"
    category: str = "software-engineering"
    tags: list[str] = Field(default_factory=list)
    parser_name: str = "pytest"
    max_agent_timeout_sec: float = Field(360.0, gt=0)
    max_test_timeout_sec: float = Field(60.0, gt=0)
    run_tests_in_same_shell: bool = False
    resources: _ResourcesYaml = Field(default_factory=_ResourcesYaml)

    @model_validator(mode="after")
    def _has_instruction(self) -> "_TaskYaml":
        if not (self.instruction or "").strip() and not self.descriptions:
            raise ValueError("missing 'instruction' (the text the agent is given)")
        return self

    @property
    def text(self) -> str:
        if self.instruction and self.instruction.strip():
            return self.instruction
        assert self.descriptions
        by_key = {d.key: d.description for d in self.descriptions}
        return by_key.get("base", self.descriptions[0].description)


class _SolutionStepYaml(BaseModel):
    model_config = ConfigDict(extra="allow")
    command: str
    min_timeout_sec: float = Field(0.0, ge=0)
    block: bool = True
    append_enter: bool = True


# --- task.toml (Harbor) ---------------------------------------------------------------

class _HarborVerifier(BaseModel):
    model_config = ConfigDict(extra="allow")
    timeout_sec: float = Field(600.0, gt=0)
    env: dict[str, str] = Field(default_factory=dict)
    # "separate": the tests run in an image of their own (tests/Dockerfile), given the
    # task's declared `artifacts`; "shared" (Harbor's default): in the agent's
    environment_mode: str = "shared"


class _HarborAgent(BaseModel):
    model_config = ConfigDict(extra="allow")
    timeout_sec: float = Field(600.0, gt=0)


class _HarborEnvironment(BaseModel):
    model_config = ConfigDict(extra="allow")
    build_timeout_sec: float = Field(600.0, gt=0)
    cpus: float = Field(1.0, gt=0)
    memory_mb: int | None = Field(None, gt=0)
    storage_mb: int | None = Field(None, gt=0)
    memory: str | None = None        # older spelling: "4G"
    storage: str | None = None
    allow_internet: bool = True      # Harbor's default
    gpus: int = Field(0, ge=0)
    docker_image: str | None = None


class _HarborSolution(BaseModel):
    model_config = ConfigDict(extra="allow")
    env: dict[str, str] = Field(default_factory=dict)


class _TaskToml(BaseModel):
    model_config = ConfigDict(extra="allow")
    version: str = "1.0"
    metadata: dict[str, Any] = Field(default_factory=dict)
    task: dict[str, Any] = Field(default_factory=dict)
    verifier: _HarborVerifier = Field(default_factory=_HarborVerifier)
    agent: _HarborAgent = Field(default_factory=_HarborAgent)
    environment: _HarborEnvironment = Field(default_factory=_HarborEnvironment)
    solution: _HarborSolution = Field(default_factory=_HarborSolution)


# --- error locations ------------------------------------------------------------------

def _yaml_line(text: str, loc: tuple) -> int | None:
    """The line of the deepest key of `loc` that exists in the YAML document."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if str(key.value) == str(part):
                    line, node = key.start_mark.line + 1, value
                    break
            else:
                break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) \
                and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _toml_line(text: str, loc: tuple) -> int | None:
    """The line where `loc` (table path + key) is assigned in a TOML document, or the
    line of its table header when the key itself is absent."""
    keys = [str(p) for p in loc]
    table: list[str] = []
    header_line = None
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if m := re.match(r"^\[+\s*([^\]]+?)\s*\]+$", line):
            table = [k.strip().strip("\"'") for k in m.group(1).split(".")]
            if table == keys[: len(table)] and header_line is None:
                header_line = n
            continue
        if m := re.match(r"^([A-Za-z0-9_.\-\"' ]+?)\s*=", line):
            full = table + [k.strip().strip("\"'") for k in m.group(1).split(".")]
            if full == keys[: len(full)]:
                return n
    return header_line


def _validation_error(path: Path, err: ValidationError, text: str, toml: bool) -> TaskError:
    parts = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p != "__root__")
        field = ".".join(str(p) for p in loc) or "<root>"
        line = (_toml_line if toml else _yaml_line)(text, loc) if loc else None
        where = f"line {line}: " if line else ""
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{path}: {where}field '{field}': {msg}" if loc else f"{path}: {msg}")
    return TaskError("; ".join(parts), hint="fix the task file")


def _read_yaml(path: Path) -> tuple[Any, str]:
    text = path.read_text(encoding="utf-8")
    try:
        return yaml.safe_load(text), text
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        ctx = getattr(e, "context", None)
        raise TaskError(f"{path}: {where}invalid YAML: {problem}"
                        + (f" ({ctx})" if ctx else ""), hint="fix the YAML syntax") from None


def _read_toml(path: Path) -> tuple[dict, str]:
    text = path.read_text(encoding="utf-8")
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as e:
        msg = str(e)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        where = f"line {m.group(1)}, column {m.group(2)}: " if m else ""
        msg = re.sub(r"\s*\(at line \d+, column \d+\)", "", msg)
        raise TaskError(f"{path}: {where}invalid TOML: {msg}",
                        hint="fix the TOML syntax") from None


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise TaskError(f"task {path.parent.name!r} is missing {path.name} ({what}): "
                        f"expected {path}", hint="add the file or fix the task directory")
    return path


def _size_mb(text: str, source: Path, field: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if not m:
        raise TaskError(f"{source}: field '{field}': cannot read size {text!r}",
                        hint="use a number with a unit, like '4G' or '512M'")
    factor = {"": 1 / 1024 / 1024, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2}
    return max(1, int(float(m.group(1)) * factor[m.group(2).upper()]))


# --- confinement to the task directory -------------------------------------------------

def _confine(d: Path, names: tuple[str, ...]) -> None:
    """Refuse a task whose files (or the children of its staged directories) lead
    outside `d`, e.g. `tests -> /etc` or `solution.sh -> ~/.ssh/id_rsa`."""
    paths = [d / n for n in names]
    for sub in STAGED_DIRS:
        if (d / sub).is_dir() and inside(d / sub, d):
            paths.extend(sorted((d / sub).iterdir()))
    for p in paths:
        if not inside(p, d):
            raise TaskError(f"task {d.name!r}: {p.relative_to(d)} resolves to "
                            f"{os.path.realpath(p)}, outside the task directory {d}",
                            hint="a task may only use files inside its directory: copy "
                            "the file in instead of linking to it")


def _compose_path(compose: Path, text: str, loc: tuple, value: str, base: Path,
                  task_dir: Path) -> Path:
    """`base / value`, resolved, for a path field of a compose file, which must stay in
    the task directory."""
    field = ".".join(str(p) for p in loc)
    where = f"{compose}: line {_yaml_line(text, loc) or 1}: field '{field}'"
    hint = "compose paths must be relative and stay inside the task directory"
    if PurePosixPath(value).is_absolute() or value.startswith("~"):
        raise TaskError(f"{where}: {value!r} is an absolute path", hint=hint)
    path = base / value
    if not inside(path, task_dir):
        raise TaskError(f"{where}: {value!r} resolves to {os.path.realpath(path)}, "
                        f"outside the task directory {task_dir}", hint=hint)
    return Path(os.path.realpath(path))


# --- the two layouts ------------------------------------------------------------------

def _compose_build(compose: Path, task_dir: Path
                   ) -> tuple[Path | None, Path, str | None, dict[str, str], list[str],
                              str, tuple[Sidecar, ...]]:
    """(Dockerfile, context, image, environment, problems, service name, sidecars) of a
    compose file: the task's own service (`client`, `main`, else the first) and every
    other service as a sidecar. Build contexts and Dockerfiles must be inside
    `task_dir`."""
    data, text = _read_yaml(compose)
    services = data.get("services") if isinstance(data, dict) else None
    if not isinstance(services, dict) or not services:
        raise TaskError(f"{compose}: line {_yaml_line(text, ('services',)) or 1}: field "
                        f"'services': expected a mapping of services")
    problems = []
    if len(services) > 1:   # host_problems too: the image mode runs sidecars
        problems.append(f"{compose.name} defines {len(services)} services "
                        f"({', '.join(services)}); multi-container tasks need the image "
                        f"mode (RIDGELINE_TASK_ENV=image)")
    name = next((n for n in ("client", "main") if n in services), next(iter(services)))
    dockerfile, context, image, env = _compose_service(compose, text, task_dir, name,
                                                       services[name] or {}, main=True)
    sidecars = []
    for other, svc in services.items():
        if other == name:
            continue
        svc = svc or {}
        if not isinstance(svc, dict):
            raise TaskError(f"{compose}: service {other!r}: expected a mapping")
        sdf, sctx, simg, senv = _compose_service(compose, text, task_dir, other, svc)
        sidecars.append(Sidecar(other, sdf, sctx, simg, senv,
                                _words(svc.get("entrypoint")), _words(svc.get("command")),
                                _ports(svc)))
    return dockerfile, context, image, env, problems, name, tuple(sidecars)


def _interp(value: str) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}?",
                  lambda m: COMPOSE_VARS.get(m.group(1), m.group(2) or ""), value)


def _words(value: object) -> tuple[str, ...] | None:
    """A compose `command`/`entrypoint`: a list as is, a string split as a shell would."""
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(_interp(str(v)) for v in value)
    return tuple(shlex.split(_interp(str(value))))


def _ports(svc: dict) -> tuple[int, ...]:
    """The container ports a service declares (`expose`, or the container side of
    `ports`): the sidecar is ready when they accept connections."""
    out: list[int] = []
    for item in [*(svc.get("expose") or []), *(svc.get("ports") or [])]:
        text = str(item.get("target", "")) if isinstance(item, dict) else str(item)
        port = text.split("/")[0].rsplit(":", 1)[-1]
        if port.isdigit():
            out.append(int(port))
    return tuple(dict.fromkeys(out))


def _compose_service(compose: Path, text: str, task_dir: Path, name: str, svc: dict,
                     main: bool = False
                     ) -> tuple[Path | None, Path, str | None, dict[str, str]]:
    """(Dockerfile, context, image, environment) of one service. The task's own service
    may name neither a build nor an image (Harbor builds it from environment/Dockerfile):
    then both are None and the caller takes the Dockerfile beside the compose file."""
    env: dict[str, str] = {}
    raw_env = svc.get("environment") or {}
    items = raw_env.items() if isinstance(raw_env, dict) else (
        (e.partition("=")[0], e.partition("=")[2]) for e in raw_env)
    for k, v in items:
        env[str(k)] = _interp(str(v if v is not None else ""))
    build = svc.get("build")
    image = svc.get("image")
    if build is None:
        if not image:
            if main and (compose.parent / "Dockerfile").is_file():
                return None, compose.parent, None, env
            raise TaskError(f"{compose}: service {name!r} has neither 'build' nor 'image'")
        return None, compose.parent, _interp(str(image)), env
    loc = ("services", name, "build")
    if isinstance(build, str):
        raw_context, raw_dockerfile, context_loc = build, "Dockerfile", loc
    else:
        raw_context = str(build.get("context", "."))
        raw_dockerfile = str(build.get("dockerfile", "Dockerfile"))
        context_loc = (*loc, "context")
    context = _compose_path(compose, text, context_loc, _interp(raw_context),
                            compose.parent, task_dir)
    dockerfile = _compose_path(compose, text, (*loc, "dockerfile"), _interp(raw_dockerfile),
                               context, task_dir)
    return _require(dockerfile, "the image the compose file builds"), context, None, env


def _load_v1(d: Path) -> Task:
    _confine(d, V1_FILES)
    spec_path = _require(d / "task.yaml", "the task definition")
    data, text = _read_yaml(spec_path)
    if not isinstance(data, dict):
        raise TaskError(f"{spec_path}: line 1: expected a mapping of fields, got "
                        f"{type(data).__name__}")
    try:
        spec = _TaskYaml.model_validate(data)
    except ValidationError as e:
        raise _validation_error(spec_path, e, text, toml=False) from None
    test_script = _require(d / "run-tests.sh", "the script that runs the tests")
    tests_dir = d / "tests"
    if not tests_dir.is_dir():
        _require(tests_dir, "the tests copied to /tests before verification")
    solution_script = d / "solution.sh" if (d / "solution.sh").is_file() else None
    steps = None
    if solution_script is None and (d / "solution.yaml").is_file():
        raw, stext = _read_yaml(d / "solution.yaml")
        if not isinstance(raw, list):
            raise TaskError(f"{d / 'solution.yaml'}: line 1: expected a list of commands")
        parsed = []
        for i, item in enumerate(raw):
            try:
                parsed.append(SolutionStep(**_SolutionStepYaml.model_validate(item)
                                           .model_dump(include={"command", "min_timeout_sec",
                                                                "block", "append_enter"})))
            except ValidationError as e:
                err = _validation_error(d / "solution.yaml", e, stext, toml=False)
                raise TaskError(err.message.replace("field '", f"field '{i}.", 1)) from None
        steps = tuple(parsed)
    env: dict[str, str] = {}
    problems: list[str] = []
    dockerfile, context, image = None, d, None
    service, sidecars = "client", ()
    compose = next((c for c in (d / "docker-compose.yaml", d / "docker-compose.yml")
                    if c.is_file()), None)
    if compose is not None:
        dockerfile, context, image, env, problems, service, sidecars = _compose_build(
            compose, d)
        if dockerfile is None and (image is None or (d / "Dockerfile").is_file()):
            # the task's own Dockerfile, as before compose files were read for sidecars
            dockerfile, context, image = d / "Dockerfile", d, None
    elif (d / "Dockerfile").is_file():
        dockerfile = d / "Dockerfile"
    build = plan_build(dockerfile, context, base_image=image)
    if problems:
        build = _with_problems(build, problems, host_only=bool(sidecars))
    res = spec.resources
    return Task(
        id=d.name, path=d, layout=TaskLayout.TB_V1, instruction=spec.text.strip(),
        difficulty=spec.difficulty.lower(), category=spec.category,
        tags=tuple(spec.tags), agent_timeout_s=spec.max_agent_timeout_sec,
        test_timeout_s=spec.max_test_timeout_sec,
        resources=Resources(res.cpus, res.memory_mb, res.storage_mb, res.allow_internet),
        build=build, test_script=test_script, tests_dir=tests_dir,
        solution_script=solution_script, solution_steps=steps,
        setup_script=d / "setup.sh" if (d / "setup.sh").is_file() else None,
        files_dir=d / "files" if dockerfile is None and (d / "files").is_dir() else None,
        parser_name=spec.parser_name, verifier_env={k: v for k, v in env.items()
                                                    if k != "TEST_DIR"},
        metadata={k: v for k, v in data.items() if k not in ("instruction", "descriptions")},
        sidecars=sidecars, service_name=service,
    )


def _with_problems(build, problems: list[str], host_only: bool = False):
    """`problems` added to the build's; `host_only` ones do not stop the image mode."""
    from dataclasses import replace
    return replace(build, problems=tuple(build.problems) + tuple(problems),
                   host_problems=tuple(build.host_problems) + (tuple(problems) if host_only
                                                               else ()))


def _load_v2(d: Path) -> Task:
    _confine(d, V2_FILES)
    spec_path = _require(d / "task.toml", "the task configuration")
    instruction_path = d / "instruction.md"
    data, text = _read_toml(spec_path)
    try:
        spec = _TaskToml.model_validate(data)
    except ValidationError as e:
        raise _validation_error(spec_path, e, text, toml=True) from None
    task_steps: tuple[TaskStep, ...] = ()
    if data.get("steps"):
        # each step's instruction, tests and oracle live in steps/<name>/
        task_steps = _load_steps(d, spec_path, data["steps"], spec)
        first = task_steps[0]
        instruction, test_script = first.instruction, first.test_script
    else:
        instruction_path = _require(instruction_path, "the instruction given to the agent")
        instruction = instruction_path.read_text(encoding="utf-8").strip()
        if not instruction:
            raise TaskError(f"{instruction_path}: is empty",
                            hint="write the task's instruction")
        test_script = _require(d / "tests" / "test.sh", "the verifier script")
    env_dir = d / "environment"
    envv = spec.environment
    memory = envv.memory_mb or (_size_mb(envv.memory, spec_path, "environment.memory")
                                if envv.memory else 2048)
    storage = envv.storage_mb or (_size_mb(envv.storage, spec_path, "environment.storage")
                                  if envv.storage else 10240)
    dockerfile, context, image, cenv, problems = None, env_dir, envv.docker_image, {}, []
    service, sidecars = "main", ()
    compose = next((c for c in (env_dir / "docker-compose.yaml",
                                env_dir / "docker-compose.yml") if c.is_file()), None)
    if compose is not None and not envv.docker_image:
        dockerfile, context, image, cenv, problems, service, sidecars = _compose_build(
            compose, d)
        if dockerfile is None and image is None:
            dockerfile = env_dir / "Dockerfile"
    elif (env_dir / "Dockerfile").is_file() and not envv.docker_image:
        dockerfile = env_dir / "Dockerfile"
    build = plan_build(dockerfile, context if context.exists() else d, base_image=image)
    if problems:
        build = _with_problems(build, problems, host_only=bool(sidecars))
    verifier_dockerfile, artifacts = None, ()
    if spec.verifier.environment_mode == "separate":
        verifier_dockerfile = _require(d / "tests" / "Dockerfile", "the verifier's image "
                                       "(verifier.environment_mode = 'separate')")
        raw_artifacts = data.get("artifacts") or []
        if not isinstance(raw_artifacts, list) or not all(
                isinstance(a, str) and a.startswith("/") for a in raw_artifacts):
            raise TaskError(f"{spec_path}: 'artifacts' must be a list of absolute paths")
        artifacts = tuple(raw_artifacts)
        build = _with_problems(build, ["a verifier environment of its own (verifier."
                                       "environment_mode = 'separate') needs the image "
                                       "mode (RIDGELINE_TASK_ENV=image)"], host_only=True)
    elif spec.verifier.environment_mode != "shared":
        build = _with_problems(build, [f"verifier.environment_mode = "
                                       f"{spec.verifier.environment_mode!r} is not known"])
    meta = dict(spec.metadata)
    tags = meta.get("tags") or spec.task.get("keywords") or []
    solve = d / "solution" / "solve.sh"
    tests_dir, solve_dir = d / "tests", d / "solution"
    if task_steps:
        tests_dir, solve = task_steps[0].tests_dir, task_steps[0].solution_script
        solve_dir = task_steps[0].solution_dir
    solve_ok = solve is not None and solve.is_file()
    setup = next((p for p in (env_dir / "setup.sh", d / "setup.sh") if p.is_file()), None)
    return Task(
        id=d.name, path=d, layout=TaskLayout.HARBOR, instruction=instruction,
        difficulty=str(meta.get("difficulty", "unknown")).lower(),
        category=str(meta.get("category", "software-engineering")),
        tags=tuple(str(t) for t in tags), agent_timeout_s=spec.agent.timeout_sec,
        test_timeout_s=spec.verifier.timeout_sec,
        resources=Resources(envv.cpus, memory, storage, envv.allow_internet, envv.gpus),
        build=build, test_script=test_script, tests_dir=tests_dir,
        solution_script=solve if solve_ok else None,
        solution_dir=solve_dir if solve_ok else None,
        setup_script=setup, verifier_env={**cenv, **spec.verifier.env},
        solution_env=dict(spec.solution.env), metadata={**meta, **spec.task},
        sidecars=sidecars, service_name=service, steps=task_steps,
        verifier_dockerfile=verifier_dockerfile, artifacts=artifacts,
    )


def _load_steps(d: Path, spec_path: Path, raw: object, spec: _TaskToml
                ) -> tuple[TaskStep, ...]:
    """`[[steps]]` of a Harbor task: each step's files in steps/<name>/ (instruction.md,
    tests/test.sh, solution/solve.sh), timeouts from its own tables, else the task's."""
    if not isinstance(raw, list) or not all(isinstance(s, dict) for s in raw):
        raise TaskError(f"{spec_path}: 'steps' must be an array of tables ([[steps]])")
    out = []
    for i, st in enumerate(raw):
        name = str(st.get("name") or "")
        if not name or "/" in name or name in (".", ".."):
            raise TaskError(f"{spec_path}: step {i + 1} has no usable name ({name!r})",
                            hint="name each [[steps]] after its folder in steps/")
        sd = d / "steps" / name
        if not inside(sd, d):
            raise TaskError(f"task {d.name!r}: steps/{name} leads outside the task directory")
        instruction_path = _require(sd / "instruction.md", f"step {name!r}'s instruction")
        instruction = instruction_path.read_text(encoding="utf-8").strip()
        if not instruction:
            raise TaskError(f"{instruction_path}: is empty", hint="write the instruction")
        test_script = _require(sd / "tests" / "test.sh", f"step {name!r}'s verifier script")
        for p in (instruction_path, test_script, sd / "tests", sd / "solution"):
            if os.path.lexists(p) and not inside(p, d):
                raise TaskError(f"task {d.name!r}: {p.relative_to(d)} leads outside the "
                                f"task directory")
        solve = sd / "solution" / "solve.sh"
        agent = st.get("agent") if isinstance(st.get("agent"), dict) else {}
        verifier = st.get("verifier") if isinstance(st.get("verifier"), dict) else {}
        try:
            min_reward = float(st.get("min_reward", 1.0))
        except (TypeError, ValueError):
            raise TaskError(f"{spec_path}: step {name!r}: min_reward must be a number"
                            ) from None
        out.append(TaskStep(
            name, instruction, test_script, sd / "tests",
            solve if solve.is_file() and inside(solve, d) else None,
            sd / "solution" if solve.is_file() and inside(solve, d) else None,
            float(agent.get("timeout_sec", spec.agent.timeout_sec)),
            float(verifier.get("timeout_sec", spec.verifier.timeout_sec)), min_reward,
            bool(st.get("inherit_prior_session", False))))
    return tuple(out)


def is_task_dir(d: Path) -> bool:
    return (d / "task.yaml").is_file() or (d / "task.toml").is_file()


def load_task(path: str | Path) -> Task:
    """Load one task directory (either layout)."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise NotFoundError(f"task directory not found: {d}", hint="check the path")
    d = d.resolve()
    if (d / "task.toml").is_file() or (d / "instruction.md").is_file():
        return _load_v2(d)
    if (d / "task.yaml").is_file():
        return _load_v1(d)
    raise TaskError(f"{d} is not a task: it has neither task.yaml (Terminal-Bench v1) nor "
                    f"task.toml + instruction.md (Harbor)",
                    hint="point at a task directory or a directory of tasks")


def builtin_suite_dir() -> Path:
    """The directory of Ridgeline's built-in task suite."""
    return Path(__file__).resolve().parent / "builtin"


@dataclass(frozen=True)
class BrokenTask:
    """A directory of a suite that looks like a task but does not load, and why."""

    id: str
    path: Path
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "path": str(self.path), "reason": self.reason}


@dataclass
class Suite:
    """What a suite directory holds: the tasks that load, and the ones that do not."""

    tasks: list[Task]
    broken: list[BrokenTask]


def _looks_like_task(d: Path) -> bool:
    """A task directory, or what was meant as one (its task file unreadable, a link
    to nowhere, or only Harbor's instruction.md there)."""
    return any(os.path.lexists(d / n) for n in ("task.yaml", "task.toml", "instruction.md"))


def _why(d: Path, e: Exception) -> str:
    dangling = [n for n in ("task.yaml", "task.toml", "instruction.md")
                if os.path.islink(d / n) and not (d / n).exists()]
    if dangling:
        return f"{d / dangling[0]} is a link to nothing ({os.readlink(d / dangling[0])})"
    if isinstance(e, RidgelineError):
        return e.message
    if isinstance(e, UnicodeDecodeError):
        return f"a task file is not UTF-8 text ({e})"
    return f"{type(e).__name__}: {e}"


def load_suite(source: str | Path | None = None, *, only_valid: bool = False,
               backend: str = "bwrap", concurrency: int = 4) -> Suite:
    """Like `load_tasks`, but a task directory of the suite that does not load (bad
    YAML/TOML, missing files, files leading outside it) is set aside as a `BrokenTask`
    with the reason, and the rest load: one bad task of someone else's collection never
    stops `tasks list`, `tasks check` or `eval` for the others. A single task directory
    given as `source` still raises."""
    return _load(source, only_valid, backend, concurrency, strict=False)


def _load(source: str | Path | None, only_valid: bool, backend: str, concurrency: int,
          *, strict: bool) -> Suite:
    """The suite at `source`; `strict`: a task directory that does not load raises,
    and only directories with a task file count as tasks."""
    root = _suite_root(source)
    if is_task_dir(root) or (root / "instruction.md").is_file():
        tasks, broken = [load_task(root)], []
    else:
        looks = is_task_dir if strict else _looks_like_task
        dirs = sorted(p for p in root.iterdir()
                      if p.is_dir() and not p.name.startswith((".", "_")) and looks(p))
        if not dirs:
            raise NotFoundError(f"no tasks under {root}", hint="a task directory has "
                                "task.yaml (Terminal-Bench v1) or task.toml (Harbor)")
        tasks, broken = [], []
        for p in dirs:
            try:
                tasks.append(load_task(p))
            except Exception as e:  # noqa: BLE001 - any failure of one task is its own
                if strict:
                    raise
                # the caller reports it (Suite.broken); logged for the record only
                broken.append(BrokenTask(p.name, p, _why(p, e)))
                log.info("skipping task %s: %s", p.name, broken[-1].reason)
    if only_valid:
        from ridgeline.tasks.checks import valid_tasks
        tasks = valid_tasks(tasks, backend=backend, concurrency=concurrency)
    return Suite(tasks, broken)


def _suite_root(source: str | Path | None) -> Path:
    if source is None or str(source) == "builtin":
        root = builtin_suite_dir()
    else:
        root = Path(source).expanduser()
    if not root.is_dir():
        raise NotFoundError(f"task directory not found: {root}", hint="check the path")
    return root


def load_tasks(source: str | Path | None = None, *, only_valid: bool = False,
               backend: str = "bwrap", concurrency: int = 4) -> list[Task]:
    """Load a task directory, a directory of tasks, or the built-in suite (`None` or
    "builtin"), sorted by id. A malformed task (bad YAML, or files leading outside its
    directory) fails the whole load with a `TaskError` naming it: a suite is never
    silently partial (`load_suite` sets such tasks aside and says why instead).

    With `only_valid=True` tasks that fail the quality checks are left out: each task's
    check result is cached by the hash of its files (see `ridgeline.tasks.checks`), and
    tasks that were never checked are checked now, which runs their oracle and a null
    agent in sandboxes (seconds per task)."""
    return _load(source, only_valid, backend, concurrency, strict=True).tasks
