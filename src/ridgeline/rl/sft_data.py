"""The episodes supervised fine-tuning trains on, in exactly the token format the agent
samples in RL.

    episodes, excluded = oracle_episodes(tasks, tokenizer, agent_config, backend="bwrap")
    write_episodes(run_dir / "episodes" / "oracle.jsonl", episodes, tokenizer, identity)
    episodes = read_episodes(path, tokenizer, identity)   # checked: ids re-tokenise

An oracle episode is a task's reference solution played by the agent loop itself: the
same `run_task_episode` as evaluation and RL (the task's environment in a fresh sandbox,
the agent's prompts, the verifier), with a `ScriptedReplies` model in place of the
engine. The scripted model answers each turn with the token ids of a reply a policy could
have sampled) and `TokenChat` records the episode as it records a sampled one: the chat
template's prompt ids, the reply ids (loss on these only), the observation ids appended
as the next turn's prompt. An oracle episode the tests do not pass is left out with its
reason.

Two styles of oracle episode. `direct`: a plan and the solution in one shell block, then
finish. `inspect` (the default) works as the agent's prompt asks: look at the inputs the
instruction names, run the solution, look at what it produced, then finish. A policy
trained only on `direct` episodes learned to finish right after any command, failed or
not, and to guess file names it had never looked at.

Rejection sampling (`rejection_sampled`) keeps the policy's own passing rollouts, with
the ids it sampled.

Episode files (JSON lines) carry, besides the ids and the mask, the text of each run of
policy / non-policy tokens and the model's identity; reading one checks both, so a file
written for another model or tokenizer is refused at the start, never trained on.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ridgeline.errors import ConfigError
from ridgeline.llm.base import Completion, Sampling, ToolSpec
from ridgeline.rl.protocols import Tokenizer
from ridgeline.rl.token_chat import TokenChat
from ridgeline.rl.tokens import TokenEpisode

if TYPE_CHECKING:
    from ridgeline.agent import AgentConfig
    from ridgeline.rl.agent_rollout import AgentRollout
    from ridgeline.rl.policy import PolicyIdentity
    from ridgeline.tasks import Task

FORMAT = 1
Source = Literal["oracle", "rollout", "file"]
OracleStyle = Literal["inspect", "direct"]
#: replies an oracle episode of each style takes
ORACLE_REPLIES: dict[OracleStyle, int] = {"inspect": 4, "direct": 2}

#: The first reply's short plan (the agent's prompt asks for one), picked per task.
PLANS = (
    "Plan: do it in the shell in one go, then finish.",
    "Plan: one shell command does this; run it and finish.",
    "I will solve this with a short shell command.",
)
INSPECT_PLANS = (
    "Plan: look at the input first, solve it with a shell command, check the result, finish.",
    "Plan: read the files the task names, then do it in the shell and check the output.",
    "First I will look at the input, then run the command, then verify what it wrote.",
)
SOLVE_THOUGHTS = ("Now the command that does it.", "I know the input; solving it now.",
                  "This does what the task asks:")
CHECK_THOUGHTS = ("Checking the result.", "Let me verify the output.",
                  "Now I check that it worked.")
FINISH = "<finish>Done: the task's goal is met.</finish>"
# lines of a solution script that only make sense as a script, not typed into a shell
_SCRIPT_ONLY = re.compile(r"^\s*(#!|set\s+-[euxo]|#)")


@dataclass
class SFTEpisode:
    """One training episode: its token record and where it came from."""

    task_id: str
    source: Source
    tokens: TokenEpisode


# ---- oracle solutions as agent episodes ------------------------------------------------


def oracle_replies(task: Task, style: OracleStyle = "inspect") -> list[str]:
    """The replies an agent would write to solve `task` with its reference solution, in
    `style` (see the module docstring), the solution's commands as one ```bash block.
    `ConfigError` when the solution cannot be typed into a shell (it runs files of a
    solution folder the agent does not have)."""
    if task.solution_steps is not None:
        commands = [s.command.rstrip("\n") for s in task.solution_steps]
    elif task.solution_script is not None:
        if task.solution_dir is not None and any(
                p.name != task.solution_script.name for p in task.solution_dir.iterdir()):
            raise ConfigError(f"the solution of {task.id} uses files of its solution folder",
                              hint="an agent cannot see /solution; use another task")
        text = task.solution_script.read_text()
        commands = [line for line in text.splitlines() if not _SCRIPT_ONLY.match(line)]
    else:
        raise ConfigError(f"task {task.id} has no reference solution",
                          hint="add solution.sh, or leave the task out of SFT")
    script = "\n".join(commands).strip("\n")
    if not script or "```" in script:
        raise ConfigError(f"the solution of {task.id} cannot be written as one shell block",
                          hint="leave the task out of SFT")
    pick = zlib.crc32(task.id.encode())
    if style == "direct":
        return [f"{PLANS[pick % len(PLANS)]}\n```bash\n{script}\n```", FINISH]
    look, check = inspect_commands(task)
    if re.search(r"(^|[;&|\s])cd\s", script):   # the shell keeps the solution's directory
        check = f"cd {task.workdir}\n{check}"
    return [f"{INSPECT_PLANS[pick % len(INSPECT_PLANS)]}\n```bash\n{look}\n```",
            f"{SOLVE_THOUGHTS[pick % len(SOLVE_THOUGHTS)]}\n```bash\n{script}\n```",
            f"{CHECK_THOUGHTS[pick % len(CHECK_THOUGHTS)]}\n```bash\n{check}\n```",
            FINISH]


_ARCHIVE = re.compile(r"\.(gz|tgz|tar|zip|bz2|xz|zst)$")
_PATH_WORD = re.compile(r"[A-Za-z0-9_./~-]+")


def inspect_commands(task: Task) -> tuple[str, str]:
    """(look, check): shell commands that show the inputs the instruction names before
    the solution, and what it produced after it. A named path is a file, folder or git
    repository of the task's seeded workspace that the instruction mentions, or an
    absolute path under the workdir that the workspace lacks (what the task creates: a
    folder when its name has no suffix). The check shows the created paths, else the named
    inputs (edited in place); `ls -la` where the instruction names nothing."""
    files, dirs, repos = _workspace(task)
    prefix = task.workdir.rstrip("/") + "/"
    named: list[str] = []
    for word in _PATH_WORD.findall(task.instruction):
        word = word.rstrip(".,;:")
        rel = word.removeprefix(prefix).rstrip("/")
        known = rel in files or rel in dirs
        if rel and rel not in named and (known or word.startswith(prefix)):
            named.append(rel)
    inputs = [p for p in named if p in files or p in dirs]
    new = [p for p in named if p not in inputs]
    created = [p for p in new if not any(p.startswith(q + "/") for q in new)]  # tops only
    created_files = {p for p in created if "." in p.rsplit("/", 1)[-1]}
    look = [_show(p, files, repos) for p in inputs[:2]] or ["ls -la"]
    check = [_show(p, files | created_files, repos) for p in (created or inputs)[:2]]
    return "\n".join(look), "\n".join(check or ["ls -la"])


def _show(path: str, files: set[str] | frozenset[str], repos: set[str]) -> str:
    """A command that shows `path`: a repository's log and status, a folder's tree with
    modes, an archive's size, a Python file whole, another file's first lines."""
    if path in repos:
        return f"git -C {path} log --oneline | head -n 5; git -C {path} status --short"
    if path not in files:
        return f"ls -lR {path} | head -n 30"
    if _ARCHIVE.search(path):
        return f"ls -l {path}"
    return f"cat {path}" if path.endswith(".py") else f"head -n 8 {path}"


def _workspace(task: Task) -> tuple[set[str], set[str], set[str]]:
    """(files, folders, git repositories) of the task's seeded workspace, relative to it
    (a repository counts as a folder too); all empty for a task built from a Dockerfile."""
    if task.files_dir is None or not task.files_dir.is_dir():
        return set(), set(), set()
    files: set[str] = set()
    dirs: set[str] = set()
    repos: set[str] = set()
    for p in task.files_dir.rglob("*"):
        rel = p.relative_to(task.files_dir)
        if ".git" in rel.parts:
            if rel.name == ".git":
                repos.add(str(rel.parent))
            continue
        (dirs if p.is_dir() else files).add(str(rel))
    return files, dirs | repos, repos


class ScriptedReplies:
    """A `TokenGenerator` that answers each turn with the next scripted reply, as the
    engine would have returned it had the policy sampled it: the reply's ids (cut after
    the first of the request's stop strings, which the text then leaves out, as servers
    do; otherwise ended by the end-of-turn token) with logprob 0 each."""

    def __init__(self, replies: list[str], tokenizer: Tokenizer, *, name: str,
                 context_window: int, eos_id: int | None) -> None:
        self.replies = list(replies)
        self.tokenizer = tokenizer
        self.name = name
        self.context_window = context_window
        self.eos_id = eos_id
        self.turn = 0

    def complete_ids(self, prompt_ids: list[int], sampling: Sampling | None = None,
                     tools: list[ToolSpec] | None = None) -> Completion:
        if self.turn >= len(self.replies):
            raise ConfigError(f"the scripted episode asked for reply {self.turn + 1} of "
                              f"{len(self.replies)}",
                              hint="the agent did not finish where the script did")
        reply = self.replies[self.turn]
        self.turn += 1
        stops = [(reply.find(s), s) for s in (sampling.stop if sampling else []) if s in reply]
        if stops:
            at, stop = min(stops)
            ids = self.tokenizer.encode(reply[:at + len(stop)], add_special_tokens=False)
            text, reason = reply[:at], stop
        else:
            ids = self.tokenizer.encode(reply, add_special_tokens=False)
            ids += [self.eos_id] if self.eos_id is not None else []
            text, reason = reply, None
        return Completion(text=text, finish_reason="stop", stop_reason=reason,
                          prompt_token_ids=list(prompt_ids), token_ids=list(ids),
                          logprobs=[0.0] * len(ids))


def oracle_episode(task: Task, tokenizer: Tokenizer, agent_config: AgentConfig, *,
                   context_window: int, backend: str = "bwrap",
                   style: OracleStyle = "inspect") -> SFTEpisode | str:
    """The task's reference solution played by the agent loop, recorded as tokens; or
    why it cannot be trained on (no shell-typed solution, the tests failed, ...). An
    `inspect` episode whose look or check failed (the instruction names a path the
    workspace never has, e.g. a task built from a Dockerfile) is played `direct` instead:
    an episode that finishes after a failed command would teach just that."""
    from ridgeline.agent.run import run_task_episode
    from ridgeline.rl.agent_rollout import rl_agent_config

    try:
        replies = oracle_replies(task, style)
    except ConfigError as e:
        return str(e)
    model = ScriptedReplies(replies, tokenizer, name="oracle", context_window=context_window,
                            eos_id=getattr(tokenizer, "eos_token_id", None))
    chat = TokenChat(model, tokenizer)
    ep = run_task_episode(task, chat, rl_agent_config(agent_config), backend=backend)
    if ep.verdict.reward != 1.0:
        detail = f"{ep.verdict.status.value}: {ep.verdict.reason}"
        return f"the oracle played by the agent did not pass ({detail})"
    tokens, unusable = chat.sample()
    if tokens is None or unusable is not None:
        return f"the oracle episode has no usable token record ({unusable})"
    if model.turn != len(replies):
        return f"the agent stopped after {model.turn} of {len(replies)} scripted replies"
    failed = [r.action.tool for r in ep.agent.trajectory.steps
              if r.observation is not None and not r.observation.ok] if ep.agent else []
    if failed and style == "inspect":
        return oracle_episode(task, tokenizer, agent_config, context_window=context_window,
                              backend=backend, style="direct")
    if failed:
        return f"a scripted action failed in the oracle episode ({failed[0]})"
    return SFTEpisode(task.id, "oracle", tokens)


def oracle_episodes(tasks: Iterable[Task], tokenizer: Tokenizer, agent_config: AgentConfig, *,
                    context_window: int, backend: str = "bwrap", concurrency: int = 4,
                    style: OracleStyle = "inspect") -> tuple[list[SFTEpisode], dict[str, str]]:
    """Every task's oracle episode (in task order), and the tasks left out -> why."""
    tasks = list(tasks)
    with ThreadPoolExecutor(max(1, min(concurrency, len(tasks)))) as ex:
        results = list(ex.map(lambda t: oracle_episode(
            t, tokenizer, agent_config, context_window=context_window, backend=backend,
            style=style), tasks))
    kept = [r for r in results if isinstance(r, SFTEpisode)]
    excluded = {t.id: r for t, r in zip(tasks, results) if isinstance(r, str)}
    return kept, excluded


# ---- rejection sampling -------------------------------------------------------------------


def rejection_sampled(rollout: AgentRollout, tasks: list[Task], samples: int, seed: int,
                      concurrency: int = 8) -> tuple[list[SFTEpisode], int]:
    """`samples` episodes of the policy per task; the passing ones with a usable token
    record (each distinct reply sequence once per task), and the number of episodes
    played."""
    from ridgeline.rl.rollouts import passed
    from ridgeline.rl.sampler import episode_seed

    jobs = [(i, t, j) for i, t in enumerate(tasks) for j in range(samples)]
    with ThreadPoolExecutor(max(1, min(concurrency, len(jobs)))) as ex:
        outcomes = list(ex.map(lambda job: rollout.episode(
            job[1], episode_seed(seed, job[0], job[2]), job[2])[0], jobs))
    kept: list[SFTEpisode] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for (_, task, _), out in zip(jobs, outcomes):
        if not passed(out) or out.sample is None or out.unusable is not None:
            continue
        key = (task.id, tuple(out.sample.token_ids))
        if key not in seen:
            seen.add(key)
            kept.append(SFTEpisode(task.id, "rollout", out.sample))
    return kept, len(jobs)


# ---- episode files ------------------------------------------------------------------------


def token_runs(tokens: TokenEpisode) -> list[tuple[int, list[int]]]:
    """Maximal runs of equal mask: (mask, ids)."""
    runs: list[tuple[int, list[int]]] = []
    for tid, m in zip(tokens.token_ids, tokens.loss_mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(tid)
        else:
            runs.append((m, [tid]))
    return runs


def write_episodes(path: Path, episodes: Iterable[SFTEpisode], tokenizer: Tokenizer,
                   identity: PolicyIdentity) -> Path:
    """Write `episodes` as JSON lines (atomically: a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    model = {k: identity[k] for k in ("architecture", "vocab_size") if k in identity}
    with open(tmp, "w", encoding="utf-8") as f:
        for ep in episodes:
            t = ep.tokens
            f.write(json.dumps({
                "format": FORMAT, "task": ep.task_id, "source": ep.source, "model": model,
                "token_ids": t.token_ids, "loss_mask": t.loss_mask,
                "texts": [tokenizer.decode(ids) for _, ids in token_runs(t)]}) + "\n")
    tmp.replace(path)
    return path


def read_episodes(path: Path, tokenizer: Tokenizer,
                  identity: PolicyIdentity | None = None) -> list[SFTEpisode]:
    """The episodes of a file `write_episodes` wrote, each checked: the ids decode to the
    recorded texts and the non-policy runs (template renderings) re-tokenise to exactly
    the recorded ids, and the model matches `identity`. `ConfigError` naming the first
    bad lines otherwise: broken data is refused, never trained on."""
    if not path.is_file():
        raise ConfigError(f"no SFT episode file {path}",
                          hint="write one with `ridgeline sft` (RUN/episodes/*.jsonl)")
    episodes: list[SFTEpisode] = []
    problems: list[str] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ep = _episode(rec, tokenizer, identity)
        except (ValueError, KeyError, TypeError) as e:
            problems.append(f"line {n}: {e}")
            continue
        episodes.append(ep)
    if problems:
        raise ConfigError(f"{len(problems)} episodes of {path} cannot be trained on: "
                          + "; ".join(problems[:3]),
                          hint="episodes must be of this model's tokenizer and chat template "
                               "(write them with `ridgeline sft`), not re-rendered text")
    if not episodes:
        raise ConfigError(f"{path} holds no episodes", hint="point data.episodes at a file "
                          "`ridgeline sft` wrote")
    return episodes


def _episode(rec: dict[str, object], tokenizer: Tokenizer,
             identity: PolicyIdentity | None) -> SFTEpisode:
    if rec.get("format") != FORMAT:
        raise ValueError(f"format {rec.get('format')!r}, this Ridgeline reads {FORMAT}")
    model = rec.get("model") or {}
    if identity is not None and isinstance(model, dict):
        for k, v in model.items():
            if k in identity and identity[k] != v:  # type: ignore[literal-required]
                raise ValueError(f"written for another model ({k}={v}, the policy's is "
                                 f"{identity[k]})")  # type: ignore[literal-required]
    ids, mask = rec["token_ids"], rec["loss_mask"]
    if not (isinstance(ids, list) and isinstance(mask, list)) or len(ids) != len(mask):
        raise ValueError("token_ids and loss_mask must be lists of one length")
    if not set(mask) <= {0, 1} or 1 not in mask:
        raise ValueError("loss_mask must be 0/1 with at least one policy token")
    tokens = TokenEpisode()
    for m, run in token_runs(TokenEpisode(token_ids=ids, loss_mask=mask)):
        if m:
            tokens.add_completion(run, [0.0] * len(run), [-1] * len(run))
        else:
            tokens.add_context(run)
    texts = rec["texts"]
    runs = token_runs(tokens)
    if not isinstance(texts, list) or len(texts) != len(runs):
        raise ValueError("texts must hold one text per run of policy / non-policy tokens")
    for (m, run), text in zip(runs, texts):
        if tokenizer.decode(run) != text:
            raise ValueError(f"ids {run[:6]}... do not decode to the recorded text "
                             f"{str(text)[:40]!r}")
        if not m and list(tokenizer.encode(text, add_special_tokens=False)) != run:
            raise ValueError(f"the text {str(text)[:40]!r} does not re-tokenise to the "
                             f"recorded ids")
    source = rec.get("source", "file")
    return SFTEpisode(str(rec.get("task", "?")), source if source in ("oracle", "rollout")
                      else "file", tokens)  # type: ignore[arg-type]
