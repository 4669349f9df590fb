"""Offline stand-ins for the network tools that Terminal-Bench scripts expect.

This file runs *inside* a task sandbox as a plain script (stdlib only, started with
`python -I -S`); `ridgeline.tasks.harness` puts small wrappers named after each tool
first on PATH. There is no network in the sandbox, so each tool does what the standard
test scripts need from what this machine already has, and says so when it cannot: every
refusal prints a line starting with ``ridgeline-offline:`` (the harness reports such a
task as *unsupported*, never as the agent's failure).

Supported:

* ``curl`` / ``wget``: the uv installer idiom ``curl -LsSf https://astral.sh/uv/<v>/install.sh
  | sh`` (the "installer" links the offline ``uv``/``uvx`` into ``$HOME/.local/bin`` and
  writes ``$HOME/.local/bin/env``), ``file://`` URLs, ``-o``/``-O`` outputs. Any other
  URL fails like an unresolvable host (curl exit code 6, wget 4).
* ``apt-get`` / ``apt`` / ``apk``: ``update``, ``clean``, ... succeed; ``install P...``
  succeeds when every package is installed on the host (dpkg) or provided here.
* ``uv``: ``venv [DIR]`` (a light venv whose python is the host's, plus its own
  ``lib/site-packages``), ``pip install`` (requirements present on the host are
  satisfied; local paths and ``--find-links`` wheelhouses are installed with the host's
  pip; versions are not enforced), ``pip list|freeze|show``, ``init``, ``add``, ``sync``,
  ``run [--with R] CMD``, ``tool run``/``uvx [--from R] [--with R] CMD``, ``python find``,
  ``--version``. ``-p/--python`` requests are answered with the host's Python.
* ``pytest`` (through ``uv run``/``uvx``/the venv): the host's pytest, with plugin
  auto-loading off (start-up in 0.3 s instead of 2 s) and the plugins the script asked
  for (``--with``, ``uv add``, ``pip install``) loaded explicitly; ``--ctrf FILE`` is
  served by Ridgeline's own CTRF writer when pytest-json-ctrf is not on the host.
* Verification (``RIDGELINE_VERIFY`` set by the verifier): every pytest loads the
  verifier's reporter (``ridgeline_report.py``); ``uv venv`` replaces whatever is at its
  path, and a venv this verification did not make (the agent's ``/app/.venv``, a
  pre-populated ``.tbench-testing-venv``) is never used to run the tests.
* ``RIDGELINE_WHEELS`` (set where the harness fetched what the task's test scripts
  install, tasks/wheelhouse.py): a wheelhouse every install also looks in.
* Image build only (Dockerfile ``RUN``): ``pip``/``pip3``/``python -m pip install``
  check requirements against the host; ``rm`` skips image cache directories
  (``/var/lib/apt/lists`` ...) that only exist in Docker images.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).absolute().parent
CONFIG = json.loads((HERE / "config.json").read_text())
HOST_PYTHON: str = CONFIG["python"]
SITE_DIRS: list[str] = CONFIG["site_dirs"]
BIN = HERE / "bin"
MARK = "ridgeline-offline:"
UV_VERSION = "0.0.0"
PROVIDED = {"curl", "wget", "uv", "uvx", "ca-certificates", "apt-transport-https", "gnupg",
            "software-properties-common", "lsb-release"}
# Python packages the harness provides itself (pytest-json-ctrf: ridgeline_ctrf.py).
HARNESS_PROVIDES = {"pytest-json-ctrf"}
CACHE_DIRS = ("/var/lib/apt/lists", "/var/cache", "/root/.cache", "/usr/share/doc",
              "/usr/share/man", "/var/log")


def refuse(msg: str, code: int = 1) -> int:
    print(f"{MARK} {msg}", file=sys.stderr)
    return code


def note(msg: str) -> None:
    if not os.environ.get("RIDGELINE_OFFLINE_QUIET"):
        print(f"ridgeline: {msg}", file=sys.stderr)


# --- what the host has ----------------------------------------------------------------

def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(extra_dirs: list[str] = ()) -> dict[str, Path]:
    """Normalized distribution name -> its metadata directory."""
    found: dict[str, Path] = {}
    for d in [*extra_dirs, *SITE_DIRS]:
        try:
            entries = os.listdir(d)
        except OSError:
            continue  # a site directory this machine lacks, or the sandbox hides
        for e in entries:
            if e.endswith((".dist-info", ".egg-info")):
                name = e.rsplit(".", 1)[0].split("-", 1)[0]
                found.setdefault(normalize(name), Path(d) / e)
    return found


def req_name(spec: str) -> str | None:
    """The distribution name of a requirement, or None for a path/URL."""
    spec = spec.strip()
    if is_local(spec) or "://" in spec:
        return None
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    return normalize(m.group(1)) if m else None


def is_local(spec: str) -> bool:
    return (spec.startswith((".", "/", "~", "file:")) or
            spec.endswith((".whl", ".tar.gz", ".zip", ".tar.bz2")) or
            (os.sep in spec and os.path.exists(spec)))


def pinned_version(spec: str) -> str | None:
    m = re.search(r"==\s*([A-Za-z0-9.+!*-]+)", spec)
    return m.group(1) if m else None


def dist_version(meta: Path) -> str:
    stem = meta.name.rsplit(".", 1)[0]
    return stem.split("-", 1)[1] if "-" in stem else "?"


def pytest_plugins(names: list[str], extra_dirs: list[str] = ()) -> list[str]:
    """Modules registered under the pytest11 entry point by the named distributions."""
    have = installed(extra_dirs)
    mods = []
    for n in names:
        meta = have.get(normalize(n))
        if meta is None:
            continue
        eps = meta / "entry_points.txt"
        if not eps.is_file():
            continue
        group = None
        for line in eps.read_text().splitlines():
            line = line.strip()
            if line.startswith("["):
                group = line.strip("[]").strip()
            elif group == "pytest11" and "=" in line:
                mods.append(line.split("=", 1)[1].strip().split(":")[0])
    return mods


# --- state: which requirements a script asked for (to load their pytest plugins) --------

def state_file() -> Path:
    base = os.environ.get("RIDGELINE_STATE") or os.path.join(
        os.environ.get("HOME", "/tmp"), ".cache", "ridgeline-offline")
    return Path(base) / "requested.txt"


def record(names: list[str], venv: Path | None = None) -> None:
    targets = [state_file()] + ([venv / "requested.txt"] if venv else [])
    for t in targets:
        try:
            t.parent.mkdir(parents=True, exist_ok=True)
            with t.open("a") as f:
                f.writelines(n + "\n" for n in names)
        except OSError as e:  # only costs these packages' pytest plugins: say so, go on
            note(f"cannot record the requested packages in {t}: {e}")


def requested(venv: Path | None) -> list[str]:
    names: list[str] = []
    for t in [state_file()] + ([venv / "requested.txt"] if venv else []):
        try:
            names += t.read_text().split()
        except FileNotFoundError:
            pass  # nothing was requested (yet)
        except OSError as e:
            note(f"cannot read the requested packages from {t}: {e}")
    return names


# --- light venvs ----------------------------------------------------------------------

def venv_site(venv: Path) -> Path:
    return venv / "lib" / "site-packages"


def verify_nonce() -> str | None:
    """This verification's id (None outside verification)."""
    return os.environ.get("RIDGELINE_VERIFY") or None


def made_now(venv: Path) -> bool:
    """Outside verification every venv counts; during it, only those `uv venv` made in
    this verification (the agent's are its files, not the verifier's tools)."""
    nonce = verify_nonce()
    if nonce is None:
        return True
    try:
        return f"ridgeline-verify = {nonce}" in (venv / "pyvenv.cfg").read_text()
    except OSError:
        return False


def is_light_venv(venv: Path) -> bool:
    try:
        return "ridgeline-offline" in (venv / "pyvenv.cfg").read_text()
    except OSError:
        return False


def make_venv(path: Path) -> int:
    path = path.absolute()
    nonce = verify_nonce()
    if nonce is not None and (path.exists() or path.is_symlink()):
        # whatever the agent left at this path (a venv with its own python, pytest or
        # sitecustomize, a link) goes, modes it set included: chmod and rm walk trees
        # of any depth
        if not path.is_symlink():
            subprocess.run(["chmod", "-R", "u+rwx", "--", str(path)], check=False,
                           stderr=subprocess.DEVNULL)
        subprocess.run(["rm", "-rf", "--", str(path)], check=False)
        if path.exists() or path.is_symlink():
            print(f"error: cannot replace {path} with a new venv", file=sys.stderr)
            return 1  # not an offline refusal: nothing is missing on this machine
    bin_dir = path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    venv_site(path).mkdir(parents=True, exist_ok=True)
    ver = ".".join(map(str, sys.version_info[:2]))
    (path / "pyvenv.cfg").write_text(
        f"home = {Path(HOST_PYTHON).parent}\ninclude-system-site-packages = true\n"
        f"version = {sys.version.split()[0]}\nridgeline-offline = true\n"
        + (f"ridgeline-verify = {nonce}\n" if nonce else ""))
    py = (f'#!/bin/sh\nexport VIRTUAL_ENV="{path}"\n'
          f'export PYTHONPATH="{venv_site(path)}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
          f'exec "{HOST_PYTHON}" "$@"\n')
    for name in ("python", "python3", f"python{ver}"):
        _write_exec(bin_dir / name, py)
    tool = HERE / "offline_tools.py"
    _write_exec(bin_dir / "pytest", f'#!/bin/sh\nexec "{HOST_PYTHON}" -I -S "{tool}" '
                f'venv-pytest "{path}" "$@"\n')
    _write_exec(bin_dir / "pip", f'#!/bin/sh\nexec "{HOST_PYTHON}" -I -S "{tool}" '
                f'venv-pip "{path}" "$@"\n')
    (bin_dir / "activate").write_text(
        f'# light venv made by the offline uv\n'
        f'deactivate () {{\n  [ -n "${{_OLD_PATH:-}}" ] && PATH="$_OLD_PATH" && export PATH\n'
        f'  unset VIRTUAL_ENV _OLD_PATH\n  unset -f deactivate\n}}\n'
        f'_OLD_PATH="$PATH"\nVIRTUAL_ENV="{path}"\nexport VIRTUAL_ENV\n'
        f'PATH="$VIRTUAL_ENV/bin:$PATH"\nexport PATH\nhash -r 2>/dev/null || true\n')
    print(f"Using CPython {sys.version.split()[0]} (host)\nCreating virtual environment at: "
          f"{path}\nActivate with: source {path}/bin/activate", file=sys.stderr)
    return 0


def _write_exec(p: Path, text: str) -> None:
    p.write_text(text)
    p.chmod(0o755)


def find_venv(explicit: str | None = None, create: bool = False) -> Path | None:
    if explicit:
        return Path(explicit).absolute()
    if os.environ.get("VIRTUAL_ENV"):
        return Path(os.environ["VIRTUAL_ENV"])
    local = Path.cwd() / ".venv"
    if local.is_dir() or create:
        if not local.is_dir():
            make_venv(local)
        return local
    return None


# --- installing -----------------------------------------------------------------------

def read_requirements(path: str, out: list[str], links: list[str]) -> None:
    base = Path(path).parent
    for raw in Path(path).read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "--requirement")):
            read_requirements(str(base / line.split(None, 1)[1].strip()), out, links)
        elif line.startswith(("-f ", "--find-links")):
            links.append(line.split(None, 1)[1].strip().lstrip("="))
        elif line.startswith(("-e ", "--editable")):
            out.append(line.split(None, 1)[1].strip())
        elif line.startswith("-"):
            continue        # index options and the like: nothing to do offline
        else:
            out.append(line)


def install(args: list[str], venv: Path | None, system_ok: bool = False) -> int:
    """`pip install`-like: satisfy requirements from the host; install local paths and
    wheelhouse packages into the light venv with the host's pip."""
    reqs: list[str] = []
    links: list[str] = []
    target: str | None = None
    it = iter(args)
    for a in it:
        if a in ("-r", "--requirement", "--requirements"):
            read_requirements(next(it, ""), reqs, links)
        elif a.startswith("--requirement=") or a.startswith("-r") and len(a) > 2:
            read_requirements(a.split("=", 1)[-1] if "=" in a else a[2:], reqs, links)
        elif a in ("-f", "--find-links"):
            links.append(next(it, ""))
        elif a.startswith("--find-links="):
            links.append(a.split("=", 1)[1])
        elif a in ("-e", "--editable"):
            reqs.append(next(it, ""))
        elif a == "--target":
            target = next(it, None)
        elif a in ("-i", "--index-url", "--extra-index-url", "-c", "--constraint",
                   "--python", "-p", "--prefix", "--root", "--cache-dir", "--only-binary",
                   "--no-binary", "--platform", "--python-version", "--index-strategy"):
            next(it, None)
        elif a.startswith("-"):
            continue
        else:
            reqs.append(a)
    if not reqs:
        return refuse("nothing to install (no requirements given)", 2)
    # what the harness fetched for this task's test scripts before they ran
    wheels = os.environ.get("RIDGELINE_WHEELS")
    if wheels and os.path.isdir(wheels) and wheels not in links:
        links.append(wheels)
    site = [str(venv_site(venv))] if venv is not None else []
    have = installed(site)
    to_pip, missing, satisfied = [], [], []
    for spec in reqs:
        name = req_name(spec)
        if name is None:
            to_pip.append(spec)
        elif name in HARNESS_PROVIDES and name not in have:
            satisfied.append(name)
        elif name in have:
            satisfied.append(name)
            pin = pinned_version(spec)
            if pin and pin != dist_version(have[name]):
                note(f"{spec} satisfied by {name} {dist_version(have[name])} already on "
                     f"this machine (offline)")
        elif links:
            to_pip.append(spec)
        else:
            missing.append(spec)
    if missing:
        return refuse(f"cannot install {', '.join(missing)}: no network, and not on this "
                      f"machine", 1)
    record(satisfied, venv if venv is not None and is_light_venv(venv) else None)
    if not to_pip:
        print(f"Audited {len(satisfied)} package(s) (offline: using this machine's)",
              file=sys.stderr)
        return 0
    dest = target or (str(venv_site(venv)) if venv is not None and is_light_venv(venv)
                      else None)
    cmd = [HOST_PYTHON, "-m", "pip", "install", "--no-index", "--disable-pip-version-check",
           "-q"]
    for link in links:
        cmd += ["--find-links", link]
    if dest:
        cmd += ["--target", dest, "--upgrade"]
    elif venv is not None:
        cmd = cmd[:3] + ["--python", str(venv / "bin" / "python")] + cmd[3:]
    elif not system_ok:
        return refuse("no virtual environment to install into; run `uv venv` first", 2)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(cmd + to_pip, env=env)
    if r.returncode != 0:
        return refuse(f"installing {' '.join(to_pip)} from local files failed", r.returncode)
    record([n for s in to_pip if (n := req_name(s))],
           venv if venv is not None and is_light_venv(venv) else None)
    return 0


# --- running commands -----------------------------------------------------------------

def run_env(venv: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if venv is not None:
        env["VIRTUAL_ENV"] = str(venv)
        env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
        if is_light_venv(venv):
            env["PYTHONPATH"] = ":".join(p for p in (str(venv_site(venv)),
                                                     env.get("PYTHONPATH")) if p)
    return env


def pytest_argv(args: list[str], plugins_from: list[str], venv: Path | None,
                env: dict[str, str]) -> list[str]:
    # -P: like the pytest console script, do not put the working directory on sys.path
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    argv = [HOST_PYTHON, *safe, "-m", "pytest", "-p", "no:cacheprovider"]
    env.setdefault("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    if verify_nonce() is not None:
        # the verifier's reporter, from this (read-only) directory; no user site
        argv[1:1] = ["-s"]
        argv += ["-p", "ridgeline_report"]
        env["PYTHONNOUSERSITE"] = "1"
    site = [str(venv_site(venv))] if venv is not None else []
    for mod in dict.fromkeys(pytest_plugins(plugins_from, site)):
        argv += ["-p", mod]
    if any(a == "--ctrf" or a.startswith("--ctrf=") for a in args) and \
            "pytest-json-ctrf" not in installed(site):
        argv += ["-p", "ridgeline_ctrf"]
    if "-p" in argv[argv.index("no:cacheprovider") + 1:] and \
            str(HERE) not in env.get("PYTHONPATH", "").split(":"):
        env["PYTHONPATH"] = ":".join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    return argv + args


def exec_command(cmd: list[str], venv: Path | None, withs: list[str]) -> int:
    if not cmd:
        return refuse("no command to run", 2)
    name = os.path.basename(cmd[0])
    is_python = re.fullmatch(r"python(\d(\.\d+)?)?", name) is not None
    runs_pytest = name in ("pytest", "py.test") or (is_python and cmd[1:3] == ["-m", "pytest"])
    if runs_pytest and venv is not None and not made_now(venv):
        # the tests never run in a venv the agent left (its python, site-packages,
        # sitecustomize): the host's pytest runs them instead
        note(f"not running the tests in {venv}: this verification did not make it")
        venv = None
    env = run_env(venv)
    if name in ("pytest", "py.test"):
        argv = pytest_argv(cmd[1:], withs + requested(venv), venv, env)
    elif is_python:
        argv = [HOST_PYTHON, *cmd[1:]]
        if cmd[1:3] == ["-m", "pytest"]:
            argv = pytest_argv(cmd[3:], withs + requested(venv), venv, env)
    elif cmd[0].endswith(".py") and os.path.isfile(cmd[0]):
        argv = [HOST_PYTHON, *cmd]
    else:
        local = venv / "bin" / cmd[0] if venv is not None else None
        found = str(local) if local is not None and local.exists() else \
            shutil.which(cmd[0], path=env.get("PATH"))
        if found is None:
            return refuse(f"command not found: {cmd[0]}", 127)
        argv = [found, *cmd[1:]]
    os.execvpe(argv[0], argv, env)


def split_withs(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def uv_run(args: list[str], tool: bool) -> int:
    """`uv run` / `uv tool run` / `uvx`: options, then the command."""
    withs: list[str] = []
    frm: str | None = None
    module = False
    venv_arg = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            i += 1
            break
        if not a.startswith("-") or a == "-":
            break
        key, eq, val = a.partition("=")
        takes = key in ("--with", "-w", "--from", "--python", "-p", "--directory",
                        "--project", "--with-requirements", "--with-editable", "--env-file",
                        "--index-url", "--extra-index-url", "--package", "--group",
                        "--extra", "--cache-dir", "--python-preference")
        if takes and not eq:
            i += 1
            val = args[i] if i < len(args) else ""
        if key in ("--with", "-w", "--with-editable"):
            withs += split_withs(val)
        elif key == "--with-requirements":
            read_requirements(val, withs, [])
        elif key == "--from":
            frm = val
        elif key == "--directory":
            os.chdir(val)
        elif key == "--project":
            venv_arg = str(Path(val) / ".venv")
        elif key == "-m" or key == "--module":
            module = True
            i += 1
            break
        i += 1
    cmd = args[i:]
    if module:
        cmd = ["python", "-m", *cmd]
    venv = None if tool else find_venv(venv_arg)
    reqs = withs + ([frm] if frm else [])
    if tool and cmd and not frm:
        first = re.split(r"[@=<>!~\[]", cmd[0], maxsplit=1)[0]
        reqs.append(first)          # `uvx ruff` needs the package `ruff`
        cmd[0] = first
    if reqs:
        have = installed([str(venv_site(venv))] if venv else [])
        missing = [r for r in reqs if (n := req_name(r)) is not None and n not in have
                   and n not in HARNESS_PROVIDES]
        if missing:
            return refuse(f"cannot provide {', '.join(missing)}: no network, and not on "
                          f"this machine", 1)
        record([n for r in reqs if (n := req_name(r))], None)
    return exec_command(cmd, venv, [n for r in reqs if (n := req_name(r))])


def uv(args: list[str]) -> int:
    while args and args[0] in ("-q", "--quiet", "-v", "--verbose", "--no-cache", "--offline",
                               "--native-tls", "--no-progress", "--color=never"):
        args = args[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(__doc__)
        return 0
    cmd, rest = args[0], args[1:]
    if cmd in ("--version", "-V", "version", "self"):
        print(f"uv {UV_VERSION} (ridgeline offline)")
        return 0
    if cmd == "venv":
        flags_with_values = {"--python", "-p", "--prompt"}
        clean = []
        skip = False
        for a in rest:
            if skip:
                skip = False
                continue
            if a in flags_with_values:
                skip = True
                continue
            if not a.startswith("-"):
                clean.append(a)
        paths = clean or [".venv"]
        return make_venv(Path(paths[0]))
    if cmd == "pip":
        sub, rest = (rest[0], rest[1:]) if rest else ("", [])
        explicit = None
        for j, a in enumerate(rest):
            if a in ("--python", "-p") and j + 1 < len(rest):
                explicit = rest[j + 1]
                explicit = str(Path(explicit).parent.parent) if explicit.endswith(
                    ("/python", "/python3")) else None
        system = "--system" in rest
        venv = find_venv(explicit)
        if sub in ("install", "sync"):
            if venv is None and not system:
                return refuse("no virtual environment found; run `uv venv` first "
                              "(or pass --system)", 2)
            return install(rest, venv, system_ok=system)
        if sub in ("list", "freeze", "show", "check"):
            env = run_env(venv)
            env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
            return subprocess.run([HOST_PYTHON, "-m", "pip", sub, *rest,
                                   "--disable-pip-version-check"], env=env).returncode
        if sub == "uninstall":
            return 0
        return refuse(f"`uv pip {sub}` is not supported offline", 2)
    if cmd == "init":
        target = Path(next((a for a in rest if not a.startswith("-")), "."))
        target.mkdir(parents=True, exist_ok=True)
        pyproject = target / "pyproject.toml"
        if pyproject.exists():
            print(f"Project is already initialized in {target.absolute()}", file=sys.stderr)
            return 2
        name = normalize(target.absolute().name) or "project"
        pyproject.write_text(f'[project]\nname = "{name}"\nversion = "0.1.0"\n'
                             f'requires-python = ">=3.8"\ndependencies = []\n')
        print(f"Initialized project `{name}`", file=sys.stderr)
        return 0
    if cmd == "add":
        venv = find_venv(None, create=True)
        reqs = [a for a in rest if not a.startswith("-")]
        return install(reqs, venv)
    if cmd == "sync":
        venv = find_venv(None, create=True)
        deps = project_dependencies(Path.cwd() / "pyproject.toml")
        return install(deps, venv) if deps else 0
    if cmd == "run":
        return uv_run(rest, tool=False)
    if cmd == "tool":
        sub, rest = (rest[0], rest[1:]) if rest else ("", [])
        if sub == "run":
            return uv_run(rest, tool=True)
        if sub == "install":
            missing = [a for a in rest if not a.startswith("-") and req_name(a) not in
                       installed()]
            return refuse(f"cannot install {', '.join(missing)} offline") if missing else 0
        return refuse(f"`uv tool {sub}` is not supported offline", 2)
    if cmd == "python":
        sub = rest[0] if rest else ""
        if sub == "find":
            print(HOST_PYTHON)
            return 0
        if sub in ("install", "pin", "list"):
            print(f"offline: using this machine's Python {sys.version.split()[0]} "
                  f"({HOST_PYTHON})", file=sys.stderr)
            return 0
    return refuse(f"`uv {cmd}` is not supported offline", 2)


def project_dependencies(pyproject: Path) -> list[str]:
    import tomllib
    try:
        data = tomllib.loads(pyproject.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return []
    deps = list(data.get("project", {}).get("dependencies", []))
    for group in data.get("dependency-groups", {}).values():
        deps += [d for d in group if isinstance(d, str)]
    return deps


# --- curl / wget ----------------------------------------------------------------------

def uv_installer() -> str:
    """What `curl https://astral.sh/uv/install.sh` returns here: a script that "installs"
    the offline uv into $HOME/.local/bin and writes the env file the idiom sources."""
    return f"""#!/bin/sh
set -e
dest="${{UV_INSTALL_DIR:-${{XDG_BIN_HOME:-$HOME/.local/bin}}}}"
mkdir -p "$dest"
ln -sf "{BIN}/uv" "$dest/uv"
ln -sf "{BIN}/uvx" "$dest/uvx"
cat > "$dest/env" <<'EOF'
#!/bin/sh
case ":${{PATH}}:" in
    *:"$HOME/.local/bin":*) ;;
    *) export PATH="$HOME/.local/bin:$PATH" ;;
esac
EOF
echo "downloading uv {UV_VERSION} x86_64-unknown-linux-gnu (offline: provided by ridgeline)"
echo "installing to $dest"
echo "everything's installed!"
"""


def fetch(url: str) -> bytes | None:
    if re.match(r"^https?://(www\.)?astral\.sh/uv/(.+/)?install\.sh$", url):
        return uv_installer().encode()
    if url.startswith("file://"):
        return Path(url[len("file://"):]).read_bytes()
    return None


def curl(args: list[str], wget: bool = False) -> int:
    out: str | None = None
    remote_name = False
    urls = []
    it = iter(args)
    for a in it:
        if a in ("-o", "--output", "-O" if wget else "--output-document"):
            out = next(it, None)
        elif not wget and a in ("-O", "--remote-name"):
            remote_name = True
        elif wget and a.startswith("-qO") or wget and a == "-O-":
            out = a.split("O", 1)[1] or next(it, None)
        elif a.startswith("--output-document="):
            out = a.split("=", 1)[1]
        elif a in ("-H", "--header", "-d", "--data", "-X", "--request", "-u", "--user",
                   "--proto", "--retry", "-m", "--max-time", "-A", "--user-agent",
                   "--connect-timeout", "-e", "--referer"):
            next(it, None)
        elif not a.startswith("-"):
            urls.append(a)
    if not urls:
        return refuse("no URL given", 2)
    for url in urls:
        try:
            data = fetch(url)
        except OSError as e:
            print(f"curl: (37) Couldn't read file: {e}", file=sys.stderr)
            return 37
        if data is None:
            host = re.sub(r"^[a-z]+://", "", url).split("/", 1)[0]
            refuse(f"{url}: no network in the sandbox")
            if wget:
                print(f"wget: unable to resolve host address '{host}'", file=sys.stderr)
                return 4
            print(f"curl: (6) Could not resolve host: {host}", file=sys.stderr)
            return 6
        if remote_name:
            Path(url.rstrip("/").rsplit("/", 1)[-1]).write_bytes(data)
        elif out and out != "-":
            Path(out).write_bytes(data)
        else:
            sys.stdout.buffer.write(data)
    return 0


# --- package managers -----------------------------------------------------------------

def dpkg_installed(pkg: str) -> bool:
    try:
        r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True,
                           text=True)
    except OSError:
        return False
    return r.returncode == 0 and "install ok installed" in r.stdout


def apt(args: list[str], tool: str = "apt-get") -> int:
    words = [a for a in args if not a.startswith("-")]
    if not words:
        return 0
    sub, pkgs = words[0], words[1:]
    if tool == "apk":
        sub = {"add": "install", "del": "remove"}.get(sub, sub)
    if sub != "install":
        return 0        # update, upgrade, clean, autoremove...: nothing to do offline
    missing = []
    for p in pkgs:
        name = re.split(r"[=:]", p, maxsplit=1)[0]
        if name in PROVIDED or dpkg_installed(name) or shutil.which(name):
            continue
        missing.append(name)
    if missing:
        print(f"E: Unable to locate package {missing[0]}", file=sys.stderr)
        return refuse(f"{tool} install {' '.join(missing)}: no network, and not installed "
                      f"on this machine", 100)
    print(f"{len(pkgs)} package(s) already installed on this machine (offline)")
    return 0


def build_pip(args: list[str]) -> int:
    """`pip` during an image build: requirements must already be on the host, unless
    they go to a --target directory (then the host's pip installs local files)."""
    if not args or args[0] in ("--version", "-V"):
        return subprocess.run([HOST_PYTHON, "-m", "pip", *args]).returncode
    sub, rest = args[0], args[1:]
    if sub == "install":
        if "--target" in rest or "-t" in rest:
            return subprocess.run([HOST_PYTHON, "-m", "pip", "install", "--no-index",
                                   *[a for a in rest if a != "--no-cache-dir"]]).returncode
        return install(rest, None, system_ok=True)
    if sub in ("cache", "config"):
        return 0
    return subprocess.run([HOST_PYTHON, "-m", "pip", *args]).returncode


def build_rm(args: list[str]) -> int:
    keep = [a for a in args if a.startswith("-") or not any(
        a == d or a.startswith(d + "/") for d in CACHE_DIRS)]
    if not [a for a in keep if not a.startswith("-")]:
        return 0
    os.execv("/bin/rm", ["rm", *keep])


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    tool, args = argv[1], argv[2:]
    if tool == "uv":
        return uv(args)
    if tool == "uvx":
        return uv_run(args, tool=True)
    if tool in ("curl", "wget"):
        return curl(args, wget=tool == "wget")
    if tool in ("apt-get", "apt", "apk"):
        return apt(args, tool)
    if tool == "venv-pytest":
        venv = Path(args[0])
        return exec_command(["pytest", *args[1:]], venv, [])
    if tool == "venv-pip":
        venv = Path(args[0])
        if args[1:2] == ["install"]:
            return install(args[2:], venv)
        return subprocess.run([HOST_PYTHON, "-m", "pip", *args[1:]],
                              env=run_env(venv)).returncode
    if tool in ("pip", "pip3"):
        return build_pip(args)
    if tool == "python":
        if args[:2] == ["-m", "pip"]:
            return build_pip(args[2:])
        os.execv(HOST_PYTHON, [HOST_PYTHON, *args])
    if tool == "rm":
        return build_rm(args)
    return refuse(f"unknown tool {tool!r}", 2)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
