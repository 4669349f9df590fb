"""Python packages a task's test script installs at test time, fetched before it runs.

Terminal-Bench test scripts install their test dependencies when they run (`uv pip
install pytest pandas==2.2.3`, `uvx --with rdflib pytest`, `pip install -r
/tests/requirements.txt`): under Docker they reach PyPI. Here the tests run with no
network, so those lines are read from the scripts when the environment is prepared, the
packages are downloaded on the host into a wheelhouse (PyPI is reachable from the host,
as during image builds), and the wheelhouse is mounted read-only in the sandbox, where
the offline `uv`/`pip` stand-ins install from it (`RIDGELINE_WHEELS`), and so does a
task image's own pip (`PIP_FIND_LINKS`, `PIP_NO_INDEX`). The wheels are for the host's
Python (3.11, as the Debian images' python3), which the stand-ins run the tests with.

Wheelhouses are cached by the requirement set; a set that cannot be downloaded (no
network, no such package) is remembered for this process only, and the test script then
fails to install it as before (reported unsupported by the offline tools, never scored).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ridgeline.tasks.images import cache_dir
from ridgeline.tasks.model import Task

log = logging.getLogger(__name__)
MOUNT = "/ridgeline-wheels"
ENV = "RIDGELINE_WHEELS"
DOWNLOAD_TIMEOUT_S = 600.0
#: options of the install commands that take a value (skipped with it)
_VALUED = {"-i", "--index-url", "--extra-index-url", "-c", "--constraint", "--python", "-p",
           "--prefix", "--root", "--target", "-t", "--cache-dir", "--platform",
           "--python-version", "--index-strategy", "-f", "--find-links", "--from"}
_SPEC = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9,._-]+\])?"
                   r"([<>=!~]=?[^\s;]+(,[<>=!~]=?[^\s,;]+)*)?$")
_failed: set[str] = set()
#: A shell redirection (`2>&1`, `>/dev/null`, `>>log`, `<in`): never a requirement; a bare
#: operator (`>`, `2>`) also takes the next word (its file).
_REDIRECT = re.compile(r"^(\d*|&)(>>?|<)(&?\d+|.*)$")
_BARE_REDIRECT = re.compile(r"^(\d*|&)(>>?|<)$")


def _segments(text: str) -> list[list[str]]:
    """The script's simple commands as word lists (continuations joined)."""
    text = text.replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            words = _without_redirections(words)
            if words:
                out.append(words)
    return out


def _without_redirections(words: list[str]) -> list[str]:
    kept, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif _BARE_REDIRECT.match(w):
            skip = True
        elif not _REDIRECT.match(w):
            kept.append(w)
    return kept


def _specs_after(words: list[str], start: int, tests_dir: Path, out: list[str]) -> None:
    it = iter(range(start, len(words)))
    for i in it:
        w = words[i]
        if w in ("-r", "--requirement") and i + 1 < len(words):
            _read_requirements(words[i + 1], tests_dir, out)
            next(it, None)
        elif w in _VALUED:
            next(it, None)
        elif w.startswith("-") or "$" in w or "/" in w:
            continue
        elif _SPEC.match(w):
            out.append(w)


def _read_requirements(path: str, tests_dir: Path, out: list[str]) -> None:
    """A requirements file the script names under the task's /tests (its only files)."""
    name = path.split("/tests/", 1)[-1] if "/tests/" in path else None
    if name is None:
        return
    f = (tests_dir / name).resolve()
    if not f.is_file() or tests_dir.resolve() not in f.parents:
        return
    for line in f.read_text(errors="replace").splitlines():
        line = line.split("#", 1)[0].strip()
        if line and _SPEC.match(line.replace(" ", "")):
            out.append(line.replace(" ", ""))


def script_requirements(task: Task) -> list[str]:
    """The requirement specs the task's test scripts install (every step's)."""
    out: list[str] = []
    for view in task.step_views():
        try:
            text = view.test_script.read_text(errors="replace")
        except OSError:
            continue
        for words in _segments(text):
            for i, w in enumerate(words):
                nxt = words[i + 1] if i + 1 < len(words) else ""
                if w == "install" and i > 0 and words[i - 1] in ("pip", "pip3"):
                    _specs_after(words, i + 1, view.tests_dir, out)
                elif w in ("add", "install") and i > 0 and words[i - 1] in ("uv", "tool"):
                    _specs_after(words, i + 1, view.tests_dir, out)
                elif w in ("--with", "-w") and nxt and _SPEC.match(nxt):
                    out.append(nxt)
                elif w.startswith("--with=") and _SPEC.match(w[7:]):
                    out.append(w[7:])
    return sorted(dict.fromkeys(out))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache   # ~50 ms a walk of site-packages; what is installed does not change
def _on_host() -> frozenset[str]:
    """Distributions the offline stand-ins already satisfy from this interpreter (their
    versions are not enforced offline), and the ones the harness provides itself."""
    import importlib.metadata as md
    return frozenset({_norm(d.metadata["Name"]) for d in md.distributions()
                      if d.metadata["Name"]} | {"pytest-json-ctrf"})


def prefetch(task: Task, everything: bool = False) -> Path | None:
    """A wheelhouse holding what the task's test scripts install and this machine lacks
    (with their dependencies; with `everything`, all of it: a task's own image has only
    what its build installed, and its real pip installs from the wheelhouse), downloaded
    once per requirement set; None when there is nothing to fetch or it cannot be
    fetched."""
    have = frozenset() if everything else _on_host()
    specs = [s for s in script_requirements(task)
             if _norm(re.split(r"[\[<>=!~]", s, maxsplit=1)[0]) not in have]
    if not specs:
        return None
    key = hashlib.sha256(("\n".join(specs) + sys.version).encode()).hexdigest()[:20]
    if key in _failed:
        return None
    root = cache_dir() / "wheels"
    root.mkdir(exist_ok=True)
    dest = root / key
    if (dest / ".complete").exists():
        return dest
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / ".complete").exists():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=root))
        try:
            # wheels only: an sdist's build backend would run the task's code on the host
            res = subprocess.run([sys.executable, "-m", "pip", "download", "-q",
                                  "--only-binary=:all:", "--disable-pip-version-check",
                                  "-d", str(tmp), *specs], capture_output=True, text=True,
                                 timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            res = None
        if res is None or res.returncode != 0:
            why = "timed out" if res is None else (res.stderr or res.stdout).strip()[-300:]
            log.warning("task %s: could not fetch its test requirements %s: %s",
                        task.id, specs, why)
            _failed.add(key)
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        (tmp / ".complete").write_text("\n".join(specs) + "\n")
        for p in [tmp, *tmp.iterdir()]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        tmp.rename(dest)
    return dest
