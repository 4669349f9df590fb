"""The agent's tools and their execution against a sandbox.

`TOOLS` are offered to models with native tool calling; the text format maps onto the
same names and arguments. `Workbench` runs one validated action and returns an
`Observation`; anything the model can fix (a missing file, a non-unique edit, a failing
command, a shell it killed) comes back as an observation, never as an exception.
"""

from __future__ import annotations

import base64
import logging
import shlex
import time
from typing import Any

from ridgeline.agent.config import AgentConfig
from ridgeline.agent.observation import truncate_middle
from ridgeline.agent.trajectory import Action, Observation
from ridgeline.errors import RidgelineError
from ridgeline.llm.base import ToolSpec
from ridgeline.sandbox.base import ExecResult, Sandbox, ShellSession

TOOLS: list[ToolSpec] = [
    ToolSpec(name="bash", description="Run a command in a persistent bash shell "
             "(directory and variables persist between calls). Returns exit code and output.",
             parameters={"type": "object", "required": ["command"],
                         "properties": {"command": {"type": "string"}}}),
    ToolSpec(name="read_file", description="Read a text file.",
             parameters={"type": "object", "required": ["path"],
                         "properties": {"path": {"type": "string"}}}),
    ToolSpec(name="write_file", description="Create or overwrite a file with the given content.",
             parameters={"type": "object", "required": ["path", "content"],
                         "properties": {"path": {"type": "string"},
                                        "content": {"type": "string"}}}),
    ToolSpec(name="edit", description="Replace the exact text `old` by `new` in a file; "
             "`old` must occur exactly once.",
             parameters={"type": "object", "required": ["path", "old", "new"],
                         "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                        "new": {"type": "string"}}}),
    ToolSpec(name="finish", description="End the episode when the task is done.",
             parameters={"type": "object",
                         "properties": {"summary": {"type": "string",
                                                    "description": "what was done"}}}),
]
TOOL_NAMES = {t.name for t in TOOLS}

log = logging.getLogger(__name__)

# Names small models (and other agent frameworks) use for the same arguments.
_ALIASES = {"cmd": "command", "file": "path", "filename": "path", "file_path": "path",
            "text": "content", "old_str": "old", "new_str": "new", "old_text": "old",
            "new_text": "new", "message": "summary"}


class ActionError(Exception):
    """An action the model got wrong (bad tool, missing argument); its message goes back
    to the model as a format hint."""


def validate_action(tool: str, args: dict[str, Any], call_id: str | None = None) -> Action:
    if tool not in TOOL_NAMES:
        raise ActionError(f"unknown tool {tool!r}; use one of {', '.join(sorted(TOOL_NAMES))}")
    args = {_ALIASES.get(k, k): v for k, v in args.items()}
    spec = next(t for t in TOOLS if t.name == tool)
    for name in spec.parameters.get("required", []):
        if name not in args:
            raise ActionError(f"{tool} needs the argument {name!r}")
        if not isinstance(args[name], str):
            raise ActionError(f"{tool}: {name!r} must be a string")
    if tool == "bash" and not args["command"].strip():
        raise ActionError("bash got an empty command")
    if tool in ("read_file", "write_file", "edit") and not args["path"].strip():
        raise ActionError(f"{tool} got an empty path")
    known = set(spec.parameters.get("properties", {}))
    return Action(tool=tool, args={k: v for k, v in args.items() if k in known}, call_id=call_id)


class Workbench:
    """The sandbox `ToolEnvironment`: executes actions in one sandbox through its
    persistent shell session.

    The file tools run in the same shell as `bash` (file contents travel base64-encoded),
    so a relative path means what it means to the model's shell after a `cd`, paths
    outside the workspace behave as they do for bash, and rewriting a file keeps its
    mode (an edited script stays executable)."""

    tools: list[ToolSpec] = TOOLS

    def __init__(self, sandbox: Sandbox, max_bytes: int, file_timeout_s: float = 30.0) -> None:
        self.sandbox = sandbox
        self.max_bytes = max_bytes
        self.file_timeout_s = file_timeout_s
        self._shell: ShellSession | None = None

    def validate(self, tool: str, args: dict[str, Any], call_id: str | None = None) -> Action:
        return validate_action(tool, args, call_id)

    def execute(self, action: Action, timeout: float) -> Observation:
        """Run one action. Raises `SandboxError` only when no shell can be started."""
        t0 = time.perf_counter()
        handler = getattr(self, f"_{action.tool}")
        try:
            obs = handler(timeout=timeout, **action.args)
        except _ShellFailed as e:
            obs = Observation(text=f"error: the shell failed ({e}); a new shell will be started "
                                   "(directory and variables were reset)", ok=False)
        obs.duration_s = time.perf_counter() - t0
        return obs

    def format_help(self, config: AgentConfig, native: bool) -> str:
        """The sandbox's own prompts: its tools are the ones they describe."""
        return config.tool_format_help if native else config.text_format_help

    def close(self) -> None:
        if self._shell is not None:
            try:
                self._shell.close()
            except RidgelineError:
                pass  # the sandbox is already closed: nothing is left to release
            except OSError as e:  # unexpected: the shell's processes may still run
                log.warning("closing the agent's shell failed: %s", e)
            self._shell = None

    def _send(self, command: str, timeout: float) -> ExecResult:
        if self._shell is None:
            self._shell = self.sandbox.shell()  # SandboxError here ends the episode
        try:
            return self._shell.send(command, timeout=timeout)
        except RidgelineError as e:
            # The session ended (the model ran `exit`, a limit killed bash): start a new
            # one for the next action.
            self.close()
            raise _ShellFailed(str(e)) from None

    # -- tools --------------------------------------------------------------------------
    def _bash(self, command: str, timeout: float) -> Observation:
        res = self._send(command, timeout)
        output = res.stdout
        if res.stderr:
            output = f"{output}\n{res.stderr}" if output else res.stderr
        text, truncated = truncate_middle(output, self.max_bytes)
        header = f"exit code: {res.exit_code}"
        if res.timed_out:
            header = f"timed out after {timeout:.0f} s; the command was stopped"
        elif res.killed_by:
            header += f" (stopped: {res.killed_by})"
        body = text if text.strip() else "(no output)"
        if not res.timed_out and self._shell is not None and \
                getattr(self._shell, "alive", True) is False:
            # The command ended the shell itself (`exit`, `exec`): say so now, and start
            # a fresh one for the next action.
            self.close()
            body += "\n(the shell exited; the next command starts a new shell: directory " \
                    "and variables were reset)"
        return Observation(text=f"{header}\n{body}", ok=res.ok, exit_code=res.exit_code,
                           timed_out=res.timed_out, truncated=truncated or res.truncated)

    def _read_bytes(self, path: str, limit: int | None) -> bytes | Observation:
        head = f"command head -c {limit} -- {shlex.quote(path)}" if limit else \
            f"command cat -- {shlex.quote(path)}"
        res = self._send(f"( set -o pipefail; {head} | command base64 -w0 )", self.file_timeout_s)
        if not res.ok:
            why = res.stderr.strip() or res.stdout.strip()
            return Observation(text=f"error: cannot read {path}: {why}", ok=False,
                               exit_code=res.exit_code)
        if res.truncated:
            return Observation(text=f"error: {path} is too large for this tool; use bash "
                               "(sed -n, head, tail, grep) to look at parts of it", ok=False)
        return base64.b64decode(res.stdout_bytes.strip())

    def _write_bytes(self, path: str, data: bytes) -> Observation | None:
        q = shlex.quote(path)
        encoded = base64.b64encode(data).decode()
        res = self._send(f"command mkdir -p -- \"$(command dirname -- {q})\" && "
                         f"builtin printf '%s' '{encoded}' | command base64 -d > {q}",
                         self.file_timeout_s)
        if not res.ok:
            why = res.stderr.strip() or res.stdout.strip()
            return Observation(text=f"error: cannot write {path}: {why}", ok=False,
                               exit_code=res.exit_code)
        return None

    def _read_file(self, path: str, timeout: float) -> Observation:
        limit = self.max_bytes * 4
        data = self._read_bytes(path, limit + 1)
        if isinstance(data, Observation):
            return data
        try:
            text = data[:limit].decode("utf-8")
        except UnicodeDecodeError:
            return Observation(text=f"error: {path} is not a UTF-8 text file", ok=False)
        shown, truncated = truncate_middle(text, self.max_bytes)
        if len(data) > limit:
            shown, truncated = shown + "\n[... the file continues; use bash to see the rest]", True
        return Observation(text=shown if shown else f"({path} is empty)", ok=True,
                           truncated=truncated)

    def _write_file(self, path: str, content: str, timeout: float) -> Observation:
        data = content.encode("utf-8")
        return self._write_bytes(path, data) or Observation(
            text=f"wrote {len(data)} bytes to {path}", ok=True)

    def _edit(self, path: str, old: str, new: str, timeout: float) -> Observation:
        if not old:
            return Observation(text="error: edit needs a non-empty `old` text", ok=False)
        data = self._read_bytes(path, None)
        if isinstance(data, Observation):
            return data
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return Observation(text=f"error: {path} is not a UTF-8 text file", ok=False)
        count = text.count(old)
        if count == 0:
            return Observation(text=f"error: the `old` text was not found in {path}; read the "
                               "file and copy the text exactly (whitespace included)", ok=False)
        if count > 1:
            return Observation(text=f"error: the `old` text occurs {count} times in {path}; "
                               "include more surrounding lines so it is unique", ok=False)
        return self._write_bytes(path, text.replace(old, new, 1).encode("utf-8")) or Observation(
            text=f"edited {path}: replaced 1 occurrence", ok=True)

    def _finish(self, timeout: float, summary: str = "") -> Observation:
        return Observation(text="finished", ok=True)


class _ShellFailed(Exception):
    pass
