"""`PlatformToolEnvironment`: the agent's `ToolEnvironment` on the platform, the sandbox's
tools (bash, files) next to the registry tools the task's principal may use.

    env = PlatformToolEnvironment(Workbench(sandbox, 8000), registry, principal,
                                  idempotency_prefix=task.id)
    episode = Episode(agent, task, env, None, on_step=checkpoint)
    env.step = lambda: episode.n_steps      # keys by step: safe across resumes

The registry tools are fixed when the environment is made (the prompt lists them); a
call goes through `ToolRegistry.call`, so scopes, validation, metrics and spans apply,
and a tool's failure is an observation the model can act on.

Side effects and resumes: every registry call carries an idempotency key,
`{idempotency_prefix}:step-{n}` when the environment knows the episode's step number
(`step`), else `{idempotency_prefix}:{call_id}` (the model's tool-call id; a repeated id
gets a `#k` suffix) or `{idempotency_prefix}:exec-{k}` for text-format calls, which have
none. A platform worker resumes a task by loading the last checkpoint and asking the
model again for the step that was cut short; a native call id is then new, the step
number is not, so only step keys make the replayed step return the recorded result
instead of acting twice. Without a sandbox (`workbench=None`) only registry tools and
`finish` are offered.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

from ridgeline.agent.config import AgentConfig, fill
from ridgeline.agent.environment import describe_tools, tool_call_format_help
from ridgeline.agent.observation import truncate_middle
from ridgeline.agent.tools import TOOLS, ActionError, Workbench
from ridgeline.agent.trajectory import Action, Observation
from ridgeline.errors import ConfigError, ConflictError, NotFoundError, PermissionDeniedError
from ridgeline.llm.base import ToolSpec
from ridgeline.platform.principal import Principal
from ridgeline.platform.tools import ToolArgumentsError, ToolRegistry

FINISH = next(t for t in TOOLS if t.name == "finish")

# Added to the sandbox's own format help when registry tools are offered too.
NATIVE_PLATFORM_TOOLS_HELP = "You also have these tools: {names}."
TEXT_PLATFORM_TOOLS_HELP = """\
Other tools, one per reply, written as
<tool_call>{"name": "TOOL", "arguments": {"PARAMETER": VALUE}}</tool_call>
{tools}"""


class PlatformToolEnvironment:
    def __init__(self, workbench: Workbench | None, registry: ToolRegistry,
                 principal: Principal, *, idempotency_prefix: str,
                 step: Callable[[], int] | None = None, max_bytes: int = 8_000,
                 only: Collection[str] | None = None) -> None:
        # only: offer just these registry tools (the ones a task asked for), still
        # within what the principal may use
        if not idempotency_prefix:
            raise ConfigError("a platform tool environment needs an idempotency prefix",
                              hint="use the task id, so that keys are unique per task")
        self.workbench = workbench
        self.registry = registry
        self.principal = principal
        self.idempotency_prefix = idempotency_prefix
        self.step = step
        self.max_bytes = max_bytes
        self._registry_specs = [ToolSpec(name=t.name, description=t.description,
                                         parameters=t.parameters)
                                for t in registry.tools_for(principal)
                                if only is None or t.name in only]
        self._registry_names = {s.name for s in self._registry_specs}
        sandbox_specs = [t for t in (workbench.tools if workbench is not None else [])
                         if t.name != FINISH.name]
        clash = self._registry_names & ({t.name for t in sandbox_specs} | {FINISH.name})
        if clash:
            raise ConfigError(f"registry tools named like the sandbox's: {', '.join(sorted(clash))}",
                              hint="rename them (a name prefix) so the model can tell them apart")
        self.tools: list[ToolSpec] = [*sandbox_specs, *self._registry_specs, FINISH]
        self._sandbox_names = {t.name for t in sandbox_specs}
        self._executed = 0
        self._call_ids: dict[str, int] = {}

    # -- the ToolEnvironment protocol ----------------------------------------------------------
    def format_help(self, config: AgentConfig, native: bool) -> str:
        if self.workbench is None:
            return tool_call_format_help(config, self.tools, native)
        base = self.workbench.format_help(config, native)
        if not self._registry_specs:
            return base
        if native:
            extra = fill(NATIVE_PLATFORM_TOOLS_HELP,
                         names=", ".join(s.name for s in self._registry_specs))
        else:
            extra = fill(TEXT_PLATFORM_TOOLS_HELP, tools=describe_tools(self._registry_specs))
        return f"{base}\n{extra}"

    def validate(self, tool: str, args: dict[str, Any], call_id: str | None = None) -> Action:
        if tool in self._registry_names:
            try:
                self.registry.get(tool).validate(args)
            except ToolArgumentsError as e:
                raise ActionError(e.message) from None
            except NotFoundError:  # removed from the registry since the episode began
                raise ActionError(f"the tool {tool!r} is no longer available") from None
            return Action(tool=tool, args=dict(args), call_id=call_id)
        if self.workbench is not None and (tool in self._sandbox_names or tool == FINISH.name):
            return self.workbench.validate(tool, args, call_id)
        if tool == FINISH.name:
            summary = args.get("summary", args.get("message", ""))
            return Action(tool=tool, args={"summary": str(summary or "")}, call_id=call_id)
        raise ActionError(f"unknown tool {tool!r}; use one of "
                          f"{', '.join(t.name for t in self.tools)}")

    def execute(self, action: Action, timeout: float) -> Observation:
        self._executed += 1
        if action.tool in self._registry_names:
            return self._call_registry(action, timeout)
        if self.workbench is not None:
            return self.workbench.execute(action, timeout)
        return Observation(text=f"error: the tool {action.tool!r} is not available here",
                           ok=False)

    def close(self) -> None:
        if self.workbench is not None:
            self.workbench.close()

    # -- registry calls -----------------------------------------------------------------------
    def idempotency_key(self, action: Action) -> str:
        """The key of the call `action` makes now (see the module doc)."""
        prefix = self.idempotency_prefix
        if self.step is not None:
            return f"{prefix}:step-{self.step()}"
        if action.call_id:
            seen = self._call_ids.get(action.call_id, 0)
            self._call_ids[action.call_id] = seen + 1
            return f"{prefix}:{action.call_id}" + (f"#{seen + 1}" if seen else "")
        return f"{prefix}:exec-{self._executed}"

    def _call_registry(self, action: Action, timeout: float) -> Observation:
        t0 = time.perf_counter()
        key = self.idempotency_key(action)
        try:
            result = self.registry.call(action.tool, action.args, self.principal,
                                        idempotency_key=key, call_id=action.call_id,
                                        timeout_s=timeout)
        except (NotFoundError, PermissionDeniedError, ConflictError) as e:
            # a tool removed or a scope revoked since the episode began, or a resumed step
            # that asks for another side effect than the one already made: tell the model
            return Observation(text=f"error: {e}", ok=False,
                               duration_s=time.perf_counter() - t0)
        # a replayed result reads exactly as the first run's (the model never saw that one)
        text, truncated = truncate_middle(result.text(), self.max_bytes)
        return Observation(text=text, ok=result.ok, truncated=truncated,
                           duration_s=time.perf_counter() - t0)
