"""What a terminal task is, independent of the on-disk layout it was loaded from."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from ridgeline.tasks.dockerfile import BuildPlan


class TaskLayout(str, Enum):
    TB_V1 = "terminal-bench-v1"  # task.yaml, run-tests.sh, tests/, solution.sh|yaml, Dockerfile
    HARBOR = "harbor"            # Terminal-Bench 2: instruction.md, task.toml, environment/...


@dataclass(frozen=True)
class Resources:
    """What the task asks of its machine; mapped onto sandbox limits where we can."""

    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    allow_internet: bool = False
    gpus: int = 0


@dataclass(frozen=True)
class SolutionStep:
    """One entry of a Terminal-Bench v1 `solution.yaml` (commands typed into a terminal)."""

    command: str
    min_timeout_sec: float = 0.0
    block: bool = True
    append_enter: bool = True


@dataclass(frozen=True)
class Sidecar:
    """A compose service beside the task's own (an API server, a simulated user, an MCP
    server): built and started with the task, reachable from it by `name`."""

    name: str
    dockerfile: Path | None            # built like the task's; or `image`
    context: Path
    image: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    entrypoint: tuple[str, ...] | None = None   # compose overrides of the image's
    command: tuple[str, ...] | None = None
    ports: tuple[int, ...] = ()        # container ports to wait for (expose/ports)

    def __hash__(self) -> int:
        return hash((self.name, str(self.context)))


@dataclass(frozen=True)
class TaskStep:
    """One step of a multi-step Harbor task (`[[steps]]`, files in steps/<name>/): its
    own instruction, tests and oracle, run after the steps before it in the same
    environment; the task goes on only if its reward reaches `min_reward`."""

    name: str
    instruction: str
    test_script: Path
    tests_dir: Path
    solution_script: Path | None = None
    solution_dir: Path | None = None
    agent_timeout_s: float = 600.0
    test_timeout_s: float = 600.0
    min_reward: float = 1.0
    inherit_prior_session: bool = False   # the agent goes on with the last step's talk


@dataclass(frozen=True)
class Task:
    id: str
    path: Path
    layout: TaskLayout
    instruction: str
    difficulty: str
    category: str
    tags: tuple[str, ...]
    agent_timeout_s: float
    test_timeout_s: float
    resources: Resources
    build: BuildPlan
    test_script: Path                  # run-tests.sh (v1) or tests/test.sh (Harbor)
    tests_dir: Path                    # copied to /tests before the verifier runs
    solution_script: Path | None = None   # solution.sh (v1) or solution/solve.sh (Harbor)
    solution_steps: tuple[SolutionStep, ...] | None = None  # solution.yaml (v1)
    solution_dir: Path | None = None   # Harbor: the whole solution/ folder, at /solution
    setup_script: Path | None = None   # ours: run in the sandbox after the Dockerfile
    files_dir: Path | None = None      # ours, when there is no Dockerfile: seeds the workspace
    parser_name: str = "pytest"
    verifier_env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, object] = field(default_factory=dict)
    sidecars: tuple[Sidecar, ...] = ()  # compose services beside the task's (image mode)
    service_name: str = "client"        # the task's own compose service
    steps: tuple[TaskStep, ...] = ()    # multi-step Harbor tasks, in order
    #: Harbor's separate verifier environment: the tests' own image (tests/Dockerfile),
    #: given the task's `artifacts` (absolute paths) from the agent's environment
    verifier_dockerfile: Path | None = None
    artifacts: tuple[str, ...] = ()

    def step_views(self) -> list["Task"]:
        """The task as each of its steps sees it (its instruction, tests, oracle and
        timeouts; the same directory, environment and id), or [self] without steps."""
        from dataclasses import replace
        if not self.steps:
            return [self]
        return [replace(self, instruction=s.instruction, test_script=s.test_script,
                        tests_dir=s.tests_dir, solution_script=s.solution_script,
                        solution_dir=s.solution_dir, solution_steps=None,
                        agent_timeout_s=s.agent_timeout_s, test_timeout_s=s.test_timeout_s,
                        metadata={**self.metadata, "step": s.name}, steps=())
                for s in self.steps]

    def __hash__(self) -> int:      # the dict fields are not hashable; a task is its dir
        return hash((self.layout, str(self.path)))

    @property
    def domain(self) -> str:
        return self.category

    @property
    def workdir(self) -> str:
        """The Dockerfile's final WORKDIR (/app by default): where commands start."""
        return self.build.workdir

    @property
    def has_solution(self) -> bool:
        return self.solution_script is not None or self.solution_steps is not None

    @property
    def unsupported_reason(self) -> str | None:
        """Why this task cannot run here at all (known before any sandbox starts), in
        the environment mode this process uses (images.environment_mode)."""
        from ridgeline.tasks.images import uses_images
        return self.unsupported_reason_in(
            images=self.build.source is not None and uses_images())

    def unsupported_reason_in(self, images: bool) -> str | None:
        """`unsupported_reason` for a real image build (`images`) or the host mode."""
        reasons = [p for p in self.build.problems
                   if not (images and p in self.build.host_problems)]
        if self.parser_name != "pytest":
            reasons.append(f"parser {self.parser_name!r} is not supported (only 'pytest')")
        if self.resources.gpus > 0:
            reasons.append(f"needs {self.resources.gpus} GPU(s); none here")
        return "; ".join(reasons) or None
