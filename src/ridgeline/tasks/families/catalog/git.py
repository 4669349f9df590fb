"""Git: committing, branching, searching history and undoing commits.

Instances carry no set-up script, so each repository is built at generation time with the
host's `git` (fixed names and dates: the same seed gives the same hashes) and shipped as
plain files, `.git` included. The index is rebuilt without stat data (as `git read-tree`
writes it), so the bytes do not depend on the machine; git refreshes it on first use.
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ridgeline.errors import TaskError
from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS, SERVICES

AUTHOR = ("Ada Lovelace", "ada@example.com")

#: The helper every test module uses (git run in the repository, output stripped).
_GIT_TEST = '''import subprocess
from pathlib import Path

REPO = Path("/app/{repo}")


def git(*args):
    r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, f"git {{' '.join(args)}}: {{r.stderr}}"
    return r.stdout.strip()
'''


@dataclass
class Repo:
    files: dict[str, str | bytes]   # workspace files: the work tree and its .git
    commits: list[str]              # hashes, oldest first
    trees: list[str]                # the tree of each commit


def _build_repo(prefix: str, commits: list[tuple[str, dict[str, str | None]]],
                untracked: dict[str, str] | None = None, branch: str = "main") -> Repo:
    """A repository at `prefix` with `commits` ((message, {path: content, or None to
    delete})) on `branch`, then `untracked` files written to the work tree."""
    if shutil.which("git") is None:
        raise TaskError("the git families build their repositories with git, which is "
                        "not installed here", hint="install git on the generating machine")
    with tempfile.TemporaryDirectory(prefix="ridgeline-gitfam-") as tmp:
        work, home, tmpl = Path(tmp) / "repo", Path(tmp) / "home", Path(tmp) / "tmpl"
        for d in (work, home, tmpl):
            d.mkdir()
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
               "LC_ALL": "C", "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
               "GIT_AUTHOR_NAME": AUTHOR[0], "GIT_AUTHOR_EMAIL": AUTHOR[1],
               "GIT_COMMITTER_NAME": AUTHOR[0], "GIT_COMMITTER_EMAIL": AUTHOR[1]}

        def git(*args: str, **extra: str) -> str:
            r = subprocess.run(["git", *args], cwd=work, env={**env, **extra},
                               capture_output=True, text=True, timeout=60, check=False)
            if r.returncode != 0:
                raise TaskError(f"building a task repository: git {' '.join(args)}: "
                                f"{r.stderr.strip()}")
            return r.stdout.strip()

        git("init", "-q", f"--template={tmpl}", "-b", branch)
        git("config", "user.name", AUTHOR[0])
        git("config", "user.email", AUTHOR[1])
        hashes, trees = [], []
        for i, (message, changes) in enumerate(commits):
            for rel, content in changes.items():
                p = work / rel
                if content is None:
                    p.unlink()
                else:
                    p.parent.mkdir(parents=True, exist_ok=True)
                    p.write_text(content)
            git("add", "-A")
            when = f"2024-03-{1 + i // 20:02d}T{9 + i % 20 // 2:02d}:{(i % 2) * 30 + 7:02d}:00Z"
            git("commit", "-q", "-m", message, GIT_AUTHOR_DATE=when, GIT_COMMITTER_DATE=when)
            hashes.append(git("rev-parse", "HEAD"))
            trees.append(git("rev-parse", "HEAD^{tree}"))
        dot = work / ".git"
        for junk in ("logs", "hooks", "info", "description", "COMMIT_EDITMSG", "ORIG_HEAD",
                     "index"):
            p = dot / junk
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        git("read-tree", "HEAD")   # an index without stat data: reproducible bytes
        for rel, content in (untracked or {}).items():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_text(content)
        files: dict[str, str | bytes] = {}
        for p in sorted(work.rglob("*")):
            if p.is_file():
                rel = p.relative_to(work).as_posix()
                files[f"{prefix}/{rel}"] = (p.read_bytes() if rel.startswith(".git/")
                                            else p.read_text())
    return Repo(files, hashes, trees)


def _history(rng: random.Random, n: int) -> list[tuple[str, dict[str, str | None]]]:
    """`n` ordinary commits: a README first, then files added and edited."""
    name = rng.choice(NOUNS)
    commits: list[tuple[str, dict[str, str | None]]] = [
        ("Initial commit", {"README.md": f"# {name.capitalize()}\n\nA small project.\n"})]
    known: dict[str, str] = {}
    while len(commits) < n:
        if known and rng.random() < 0.4:
            path = rng.choice(sorted(known))
            known[path] += f"{rng.choice(NOUNS)} = {rng.randint(1, 99)}\n"
            msg = rng.choice((f"Update {path}", f"Tune {path.rsplit('/', 1)[-1]}",
                              f"Change {rng.choice(NOUNS)} in {path}"))
        else:
            path = rng.choice((f"src/{rng.choice(NOUNS)}.py", f"{rng.choice(SERVICES)}.conf",
                               f"docs/{rng.choice(NOUNS)}.md", f"{rng.choice(NOUNS)}.txt"))
            if path in known:
                continue
            known[path] = f"{rng.choice(NOUNS)} = {rng.randint(1, 99)}\n"
            msg = rng.choice((f"Add {path}", f"Introduce {path.rsplit('/', 1)[-1]}",
                              f"Create {path}"))
        commits.append((msg, {path: known[path]}))
    return commits


@family("git-commit-new-file", skill="git", split="train")
def git_commit_new_file(rng: random.Random) -> Instance:
    """One of two untracked files committed with a given message; the other left alone."""
    repo = rng.choice(("repo", "project", "app", "work"))
    history = _history(rng, rng.randint(2, 4))
    target = rng.choice((f"{rng.choice(NOUNS)}.txt", f"docs/{rng.choice(NOUNS)}.md",
                         f"src/{rng.choice(NOUNS)}.py", f"{rng.choice(SERVICES)}.yaml"))
    while any(target in changes for _m, changes in history):
        target = f"new_{target}"
    scratch = rng.choice(("scratch.txt", "local.env", "debug.log", "tmp_notes.md"))
    content = f"{rng.choice(NOUNS)}: {rng.randint(1, 999)}\nowner: {rng.choice(NAMES)}\n"
    message = rng.choice((f"Add {target.rsplit('/', 1)[-1]}", f"Add {rng.choice(NOUNS)} "
                          f"settings", f"Track {target}", f"Document {rng.choice(NOUNS)}"))
    built = _build_repo(repo, history, {target: content, scratch: "do not commit\n"})
    instruction = rng.choice((
        f"/app/{repo} is a git repository with two untracked files. Commit {target} on the "
        f"current branch with the commit message `{message}`; {scratch} must stay "
        f"untracked and uncommitted.",
        f"In the repository /app/{repo}, record a new commit that adds the file {target} "
        f"(and nothing else) with the message `{message}`. Leave {scratch} untracked.",
        f"Add /app/{repo}/{target} to the history of the git repository /app/{repo} as a "
        f"new commit on top of the current one, message `{message}`. Do not commit "
        f"{scratch} and do not rewrite the existing commits.",
    ))
    subjects = [message] + [m for m, _c in reversed(history)]
    tests = (f'"""git-commit-new-file: {target} committed as {message!r}."""\n'
             + _GIT_TEST.format(repo=repo)) + f'''

def test_history():
    assert git("log", "--format=%s").splitlines() == {subjects!r}
    assert git("rev-parse", "HEAD~1") == {built.commits[-1]!r}


def test_on_main():
    assert git("symbolic-ref", "--short", "HEAD") == "main"


def test_file_committed():
    assert git("show", "HEAD:{target}") + "\\n" == {content!r}
    assert git("diff-tree", "--no-commit-id", "--name-only", "-r", "HEAD") == {target!r}


def test_scratch_untracked():
    assert git("status", "--porcelain") == "?? {scratch}"
    assert (REPO / "{scratch}").read_text() == "do not commit\\n"
'''
    solution = (f"git -C {repo} add {shlex.quote(target)}\n"
                f"git -C {repo} commit -q -m {shlex.quote(message)}\n")
    return Instance(instruction, built.files, solution, tests, tags=("git", "commit"))


@family("git-branch-and-commit", skill="git", split="train")
def git_branch_and_commit(rng: random.Random) -> Instance:
    """A new branch from main, switched to, with one commit on it; main unchanged."""
    repo = rng.choice(("repo", "service", "site", "tool"))
    history = _history(rng, rng.randint(3, 5))
    branch = rng.choice((f"feature/{rng.choice(NOUNS)}", f"fix-{rng.choice(NOUNS)}",
                         f"{rng.choice(NAMES)}/{rng.choice(NOUNS)}", f"exp-{rng.randint(1, 99)}"))
    path = rng.choice((f"{rng.choice(NOUNS)}.txt", f"notes/{rng.choice(NAMES)}.md",
                       f"src/{rng.choice(NOUNS)}_v2.py"))
    while any(path in changes for _m, changes in history):
        path = f"new_{path}"
    line = f"{rng.choice(NOUNS)} {rng.choice(NOUNS)} {rng.randint(1, 999)}"
    message = rng.choice((f"Start {branch}", f"Add {path}", f"Draft {rng.choice(NOUNS)}",
                          f"WIP: {rng.choice(NOUNS)}"))
    built = _build_repo(repo, history)
    main = built.commits[-1]
    instruction = rng.choice((
        f"In the git repository /app/{repo}, create a branch named `{branch}` starting at "
        f"the tip of main and switch to it. On that branch, add a file {path} containing "
        f"the single line `{line}` and commit it with the message `{message}`. main itself "
        f"must not move.",
        f"Start new work in /app/{repo}: a branch `{branch}` off the current main, checked "
        f"out, with one commit `{message}` that creates {path} (one line: `{line}`). "
        f"Leave the main branch where it is and the working tree clean.",
        f"Branch `{branch}` must exist in /app/{repo}, be the checked-out branch, and be "
        f"exactly one commit ahead of main: a commit with message `{message}` adding "
        f"{path}, whose content is the line `{line}`. Do not commit to main.",
    ))
    tests = (f'"""git-branch-and-commit: {branch} off main with one commit."""\n'
             + _GIT_TEST.format(repo=repo)) + f'''

def test_checked_out_branch():
    assert git("symbolic-ref", "--short", "HEAD") == {branch!r}


def test_main_unchanged():
    assert git("rev-parse", "refs/heads/main") == {main!r}


def test_one_commit_on_branch():
    assert git("rev-parse", "{branch}~1") == {main!r}
    assert git("log", "-1", "--format=%s", {branch!r}) == {message!r}
    assert git("diff-tree", "--no-commit-id", "--name-only", "-r", {branch!r}) == {path!r}
    assert git("show", "{branch}:{path}").rstrip("\\n") == {line!r}


def test_clean():
    assert git("status", "--porcelain") == ""
'''
    d = path.rsplit("/", 1)[0] if "/" in path else ""
    solution = (f"cd {repo}\n"
                f"git checkout -q -b {shlex.quote(branch)}\n"
                + (f"mkdir -p {d}\n" if d else "")
                + f"printf '%s\\n' {shlex.quote(line)} > {path}\n"
                f"git add {path}\n"
                f"git commit -q -m {shlex.quote(message)}\n")
    return Instance(instruction, built.files, solution, tests, difficulty="medium",
                    tags=("git", "branch", "commit"))


@family("git-find-commit-hash", skill="git", split="heldout")
def git_find_commit_hash(rng: random.Random) -> Instance:
    """The full hash of the one commit whose message mentions an issue or a keyword."""
    repo = rng.choice(("repo", "project", "backend", "library"))
    n = rng.randint(6, 12)
    base = _history(rng, n)
    by_issue = rng.random() < 0.5
    issues = rng.sample(range(100, 1000), n)
    words = rng.sample(NOUNS, n)
    commits = []
    for i, (msg, changes) in enumerate(base):
        if i and by_issue and rng.random() < 0.7:
            msg = f"{msg} (#{issues[i]})"
        elif i and not by_issue:
            msg = f"{msg}: handle {words[i]}"
        commits.append((msg, changes))
    unique = [i for i in range(1, n) if sum(words[i] in m for m, _c in commits) == 1]
    if by_issue or not unique:
        k = rng.randrange(1, n)
        key = f"#{issues[k]}"
        commits[k] = (f"{base[k][0]} (fixes {key})", commits[k][1])
        what = f"issue {key}"
    else:  # a keyword that no other message contains
        k = rng.choice(unique)
        key = words[k]
        what = f"the word `{key}`"
    assert [key in m for m, _c in commits].count(True) == 1
    built = _build_repo(repo, commits)
    out = rng.choice(("commit.txt", "answer.txt", "hash.txt", "found.txt"))
    instruction = rng.choice((
        f"One commit in the git repository /app/{repo} has a message that mentions "
        f"{what}. Write that commit's full 40-character hash to /app/{out}.",
        f"Which commit of /app/{repo} refers to {what} in its message? Save its complete "
        f"hash (40 hex digits, nothing else) in /app/{out}. Do not change the repository.",
        f"Look through the history of /app/{repo} for the commit whose message contains "
        f"{what}, and put its full commit id in /app/{out}.",
    ))
    tests = (f'"""git-find-commit-hash: the commit mentioning {key}."""\n'
             + _GIT_TEST.format(repo=repo)) + f'''

def test_hash_written():
    assert Path("/app/{out}").read_text().strip() == {built.commits[k]!r}


def test_repository_unchanged():
    assert git("rev-parse", "HEAD") == {built.commits[-1]!r}
    assert git("status", "--porcelain") == ""
'''
    solution = f"git -C {repo} log -F --grep={shlex.quote(key)} --format=%H > {out}\n"
    return Instance(instruction, built.files, solution, tests, tags=("git", "log", "search"))


@family("git-undo-last-commit", skill="git", split="heldout")
def git_undo_last_commit(rng: random.Random) -> Instance:
    """The last commit undone by a new commit on top (history kept, files restored)."""
    repo = rng.choice(("repo", "config", "infra", "website"))
    history = _history(rng, rng.randint(3, 6))
    state: dict[str, str] = {}
    for _m, changes in history:
        state.update({p: c for p, c in changes.items() if c is not None})
    # The bad commit edits one file, adds another and sometimes deletes a third.
    edited = rng.choice(sorted(state))
    bad: dict[str, str | None] = {edited: state[edited] + f"broken = {rng.randint(1, 9)}\n"}
    added = f"{rng.choice(('experimental', 'hack', 'temp'))}_{rng.choice(NOUNS)}.txt"
    bad[added] = f"{rng.choice(NOUNS)}\n"
    rest = [p for p in sorted(state) if p not in (edited, "README.md")]
    if rest and rng.random() < 0.5:
        bad[rng.choice(rest)] = None
    bad_msg = rng.choice((f"Try {rng.choice(NOUNS)} tweak", f"Quick fix for {edited}",
                          f"Refactor {rng.choice(NOUNS)}", "Temporary changes"))
    built = _build_repo(repo, [*history, (bad_msg, bad)])
    instruction = rng.choice((
        f"The latest commit of the git repository /app/{repo} (\"{bad_msg}\") was a "
        f"mistake. Undo it without rewriting history: it must stay in the log, and a new "
        f"commit on top must bring every file back to how it was before it.",
        f"Revert the most recent commit of /app/{repo}: add one new commit that cancels "
        f"all of its changes. The existing commits must remain unchanged, and the working "
        f"tree must be clean afterwards.",
        f"In /app/{repo}, the last commit broke things. Make a new commit that reverses "
        f"exactly what it changed (so the files match the commit before it), keeping the "
        f"bad commit in the history rather than deleting it.",
    ))
    tests = (f'"""git-undo-last-commit: {bad_msg!r} reverted by a new commit."""\n'
             + _GIT_TEST.format(repo=repo)) + f'''

def test_history_kept():
    assert git("rev-parse", "HEAD~1") == {built.commits[-1]!r}
    assert git("rev-list", "--count", "HEAD") == "{len(built.commits) + 1}"


def test_files_restored():
    assert git("rev-parse", "HEAD^{{tree}}") == {built.trees[-2]!r}


def test_clean_on_main():
    assert git("symbolic-ref", "--short", "HEAD") == "main"
    assert git("status", "--porcelain") == ""
'''
    return Instance(instruction, built.files, f"git -C {repo} revert --no-edit HEAD\n", tests,
                    difficulty="medium", tags=("git", "revert"))
