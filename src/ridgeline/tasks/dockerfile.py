"""Reading a task's Dockerfile without a Docker engine, and deciding what of it we honour.

The host (seen read-only inside the sandbox) stands in for the base image. Honoured:
`COPY`/`ADD` of local files (ADD also unpacks local tar archives), `WORKDIR`, `ENV`,
`ARG` defaults, `SHELL`, and `RUN` (executed later inside the sandbox, where package
installs are checked against what the host already has). Ignored because they do not
change the files or the environment an agent sees: `CMD`, `ENTRYPOINT`, `EXPOSE`,
`LABEL`, `MAINTAINER`, `VOLUME`, `HEALTHCHECK`, `STOPSIGNAL`, `USER`, `ONBUILD`.
Reported as unsupported: multi-stage builds, `COPY --from`, `ADD` of URLs, base images
whose software the host lacks, and files copied into directories the host owns.

A task directory is untrusted input, so `COPY`/`ADD` sources are confined to the build
context: a source that is absolute (Docker would read it from the context root; we
refuse it as ambiguous), climbs out with `..`, or resolves (through a symlink of its
own or of a directory on its way, glob matches included) to a host path outside the
context is a `TaskError` naming the Dockerfile, the line and the source, raised when
the task is loaded and again whenever the plan is walked. A source that is a symlink
resolving inside the context stays in the plan as the link's own path and is listed in
`CopyStep.links`. Symlinks *inside* a directory source may point anywhere: like Docker,
they are copied as links and never followed, so they only mean something inside the
sandbox; an executor must copy them as links and must not follow them for `--chmod`.
`--chmod` keeps only the permission bits (setuid/setgid/sticky are dropped, noted).
"""

from __future__ import annotations

import glob
import json
import os
import posixpath
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ridgeline.errors import TaskError

IGNORED = {"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "VOLUME", "HEALTHCHECK",
           "STOPSIGNAL", "USER", "ONBUILD"}
KNOWN = IGNORED | {"FROM", "RUN", "COPY", "ADD", "WORKDIR", "ENV", "ARG", "SHELL"}

# Base images the host can stand in for: a Debian-like userland with Python.
HOST_LIKE_IMAGES = ("ubuntu", "debian", "python", "buildpack-deps", "alpine", "minideb",
                    "bookworm", "bullseye", "jammy", "noble")
# Images that are essentially one toolchain: fine when the host has its main binary.
TOOLCHAIN_IMAGES = {"node": "node", "golang": "go", "rust": "cargo", "openjdk": "java",
                    "eclipse-temurin": "java", "amazoncorretto": "java", "gcc": "gcc",
                    "ruby": "ruby", "perl": "perl", "php": "php", "r-base": "R",
                    "r-ver": "R", "julia": "julia", "swift": "swift"}

IMAGE_DEFAULT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                     "HOME": "/root"}

#: `<<EOF`, `<<-EOF`, `<<'EOF'`, `<< "EOF"` (BuildKit accepts the shell's spacing).
HEREDOC = re.compile(r"<<(-?)[ \t]*([\"']?)([A-Za-z_][A-Za-z0-9_]*)\2")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str                          # the text after the keyword, continuations joined
    line: int                          # 1-based line of the keyword
    flags: dict[str, str] = field(default_factory=dict)   # --chown=..., --from=...
    exec_form: tuple[str, ...] | None = None               # JSON array form
    heredocs: tuple[str, ...] = ()     # bodies of `<<EOF` documents, in order


@dataclass(frozen=True)
class CopyStep:
    line: int
    dest: str                          # absolute path inside the sandbox
    sources: tuple[Path, ...] = ()     # host paths (globbed), all inside the context
    content: str | None = None         # heredoc form: the file's text
    dest_is_dir: bool = False
    chmod: str | None = None           # octal permission bits only (no setuid/sticky)
    unpack: bool = False               # ADD of a local tar archive
    # sources that are symlinks (each resolving inside the context), kept as the link's
    # path: read through them, never chmod/chown their host target
    links: tuple[Path, ...] = ()


@dataclass(frozen=True)
class RunStep:
    line: int
    argv: tuple[str, ...]              # full argv, shell already applied
    env: dict[str, str]                # ENV and ARG values in effect
    workdir: str


@dataclass(frozen=True)
class MkdirStep:
    line: int
    path: str


Step = CopyStep | RunStep | MkdirStep


@dataclass(frozen=True)
class BuildPlan:
    """A parsed Dockerfile (or nothing) plus what we concluded about running it here."""

    source: Path | None                # the Dockerfile; None when the task has none
    context: Path                      # the build context directory
    instructions: tuple[Instruction, ...] = ()
    base_image: str | None = None
    workdir: str = "/app"              # final WORKDIR: where commands start
    workspace: str = "/app"            # the writable tree mounted from the host
    extra_dirs: tuple[str, ...] = ()   # other writable trees (COPY/WORKDIR outside it)
    problems: tuple[str, ...] = ()     # reasons the environment cannot be reproduced
    notes: tuple[str, ...] = ()        # what was ignored or approximated
    #: the subset of `problems` that only the host-root mode has (a real image build
    #: does not: COPY into /etc, several FROM ...)
    host_problems: tuple[str, ...] = ()

    def steps(self, base_env: dict[str, str]) -> tuple[list[Step], dict[str, str]]:
        """Walk the instructions: the steps to execute in order, and the final runtime ENV
        (expanded over `base_env`, which must contain PATH)."""
        steps, env, _ = _walk(self.instructions, self.context, base_env, self.source)
        return steps, env


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Split a Dockerfile into instructions: comments, `\\` continuations, the escape
    directive and BuildKit heredocs handled; an unknown keyword is a `TaskError`."""
    try:
        raw_lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise TaskError(f"{path}: not UTF-8 text ({e.reason})") from None
    escape = "\\"
    i = 0
    # Parser directives are comments at the very top, e.g. `# escape=``.
    while i < len(raw_lines):
        m = re.match(r"^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$", raw_lines[i])
        if not m:
            break
        if m.group(1).lower() == "escape":
            escape = m.group(2)
        i += 1
    out: list[Instruction] = []
    while i < len(raw_lines):
        line = raw_lines[i]
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        start = i + 1
        text = stripped
        while text.endswith(escape) and i + 1 < len(raw_lines):
            i += 1
            nxt = raw_lines[i].strip()
            if nxt.startswith("#") or not nxt:  # comments inside a continuation vanish
                continue
            text = text[: -len(escape)] + " " + nxt
        if text.endswith(escape):
            text = text[: -len(escape)]
        i += 1
        keyword, _, args = text.partition(" ")
        keyword = keyword.upper()
        if keyword not in KNOWN:
            raise TaskError(f"{path}: line {start}: unknown Dockerfile instruction "
                            f"{keyword!r}", hint="fix the Dockerfile")
        args = args.strip()
        heredocs: list[str] = []
        if keyword in ("RUN", "COPY", "ADD"):
            for m in HEREDOC.finditer(args):
                strip_tabs, delim = m.group(1) == "-", m.group(3)
                body: list[str] = []
                while i < len(raw_lines):
                    cur = raw_lines[i]
                    i += 1
                    if (cur.lstrip("\t") if strip_tabs else cur) == delim:
                        break
                    body.append(cur.lstrip("\t") if strip_tabs else cur)
                else:
                    raise TaskError(f"{path}: line {start}: heredoc {delim!r} is never "
                                    f"closed", hint=f"end it with a line `{delim}`")
                heredocs.append("\n".join(body) + "\n")
        flags: dict[str, str] = {}
        while args.startswith("--"):
            flag, _, rest = args.partition(" ")
            name, _, value = flag[2:].partition("=")
            flags[name] = value
            args = rest.strip()
        exec_form = None
        if args.startswith("[") and keyword in ("RUN", "CMD", "ENTRYPOINT", "SHELL",
                                                "COPY", "ADD", "VOLUME"):
            try:
                parsed = json.loads(args)
                if isinstance(parsed, list) and all(isinstance(a, str) for a in parsed):
                    exec_form = tuple(parsed)
            except json.JSONDecodeError:
                pass
        out.append(Instruction(keyword, args, start, flags, exec_form, tuple(heredocs)))
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """Docker's variable substitution: $VAR, ${VAR}, ${VAR:-default}, ${VAR:+alt}."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(4)
        value = env.get(name, "")
        op, word = m.group(2), m.group(3)
        if op in (":-", "-"):
            return value if value else expand(word or "", env)
        if op in (":+", "+"):
            return expand(word or "", env) if value else ""
        return value
    return _VAR.sub(sub, text)


def _split_words(text: str) -> list[str]:
    """Whitespace split that honours double and single quotes (ENV, COPY arguments)."""
    import shlex
    try:
        return shlex.split(text, posix=True)
    except ValueError:
        return text.split()


def _parse_env_args(args: str) -> list[tuple[str, str]]:
    if "=" not in args.split(None, 1)[0]:      # legacy `ENV KEY value with spaces`
        key, _, value = args.partition(" ")
        return [(key, value.strip())]
    pairs = []
    for word in _split_words(args):
        key, sep, value = word.partition("=")
        if sep:
            pairs.append((key, value))
    return pairs


def _absolute(path: str, workdir: str) -> str:
    p = PurePosixPath(path)
    joined = p if p.is_absolute() else PurePosixPath(workdir) / p
    # normpath without touching the host file system
    parts: list[str] = []
    for part in joined.parts[1:]:
        if part == "..":
            if parts:
                parts.pop()
        elif part not in (".", ""):
            parts.append(part)
    return "/" + "/".join(parts)


def _walk(instructions: tuple[Instruction, ...] | list[Instruction], context: Path,
          base_env: dict[str, str], dockerfile: Path | None = None
          ) -> tuple[list[Step], dict[str, str], str]:
    env = dict(base_env)        # ENV values (runtime)
    args: dict[str, str] = {}   # ARG values (build time only)
    workdir = "/"
    shell: tuple[str, ...] = ("/bin/sh", "-c")
    steps: list[Step] = []
    for ins in instructions:
        scope = {**args, **env}
        if ins.keyword == "ARG":
            for word in _split_words(ins.args):
                name, sep, default = word.partition("=")
                if name not in args:
                    args[name] = expand(default, scope) if sep else ""
        elif ins.keyword == "ENV":
            for key, value in _parse_env_args(ins.args):
                env[key] = expand(value, scope)
                scope[key] = env[key]
        elif ins.keyword == "WORKDIR":
            workdir = _absolute(expand(ins.args.strip().strip('"'), scope), workdir)
            steps.append(MkdirStep(ins.line, workdir))
        elif ins.keyword == "SHELL" and ins.exec_form:
            shell = ins.exec_form
        elif ins.keyword == "RUN":
            if ins.exec_form is not None:
                argv = ins.exec_form
            else:
                script = ins.args
                if ins.heredocs:
                    script = (ins.heredocs[0] if script.startswith("<<")
                              else script + "\n" + "".join(ins.heredocs))
                argv = (*shell, script)
            steps.append(RunStep(ins.line, tuple(argv), {**args, **env}, workdir))
        elif ins.keyword in ("COPY", "ADD"):
            words = list(ins.exec_form) if ins.exec_form else _split_words(ins.args)
            words = [expand(w, scope) for w in words]
            if len(words) < 2 and not ins.heredocs:
                raise TaskError(f"{_where(dockerfile)}line {ins.line}: {ins.keyword} needs "
                                f"a source and a destination", hint="fix the Dockerfile")
            dest_raw = words[-1]
            dest = _absolute(dest_raw, workdir)
            chmod = _chmod_bits(ins.flags.get("chmod"))
            if ins.heredocs:
                steps.append(CopyStep(ins.line, dest, content=ins.heredocs[0], chmod=chmod))
                continue
            sources: list[Path] = []
            if "from" not in ins.flags:     # --from names another stage's files: reported
                for src in words[:-1]:
                    sources.extend(_sources(src, context, ins, dockerfile))
            dest_is_dir = dest_raw.endswith("/") or len(sources) > 1
            unpack = ins.keyword == "ADD" and len(sources) == 1 and _is_archive(sources[0])
            links = tuple(p for p in sources if p.is_symlink())
            steps.append(CopyStep(ins.line, dest, tuple(sources), None, dest_is_dir,
                                  chmod, unpack, links))
    return steps, env, workdir


def _where(dockerfile: Path | None) -> str:
    return f"{dockerfile}: " if dockerfile is not None else ""


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether `path`, every symlink on the way resolved, is `root` or below it."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([real, top]) == top


def _is_url(src: str) -> bool:
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", src) is not None or \
        src.startswith("git@")


def _sources(src: str, context: Path, ins: Instruction, dockerfile: Path | None
             ) -> list[Path]:
    """The host paths a COPY/ADD source names (globbed), each checked to stay inside the
    build context; a source leading outside is a `TaskError`. Dangling links copy
    nothing, like a missing file."""
    if _is_url(src):
        return []           # ADD of a URL: reported as a problem by plan_build

    def escape(why: str) -> TaskError:
        return TaskError(f"{_where(dockerfile)}line {ins.line}: {ins.keyword} source "
                         f"{src!r} {why}", hint="COPY and ADD can only read files inside "
                         "the build context: put the file itself (not a link to it) in "
                         "the task directory")

    # BuildKit reads an absolute source from the context's root (`COPY /data.txt .`)
    src = src.lstrip("/") or "."
    norm = posixpath.normpath(src)
    if norm == ".." or norm.startswith("../"):
        raise escape(f"leads outside the build context {context}")
    out = []
    # root_dir: the context's own path is never read as a glob pattern
    for match in sorted(glob.glob(src, root_dir=context)):
        path = context / match
        if not inside(path, context):
            via = "" if posixpath.normpath(match) == norm else f"matches {match!r}, which "
            raise escape(f"{via}resolves to {os.path.realpath(path)}, outside the build "
                         f"context {context}")
        if path.exists():
            out.append(path)
    return out


def _chmod_bits(value: str | None) -> str | None:
    """`--chmod` as octal permission bits. setuid/setgid/sticky are dropped: the copy is a
    host file owned by the harness's user, not a file inside an image."""
    if not value or not re.fullmatch(r"[0-7]{1,4}", value):
        return value or None            # a symbolic mode: plan_build reports it
    return format(int(value, 8) & 0o777, "o")


def _is_archive(p: Path) -> bool:
    return p.is_file() and p.name.endswith((".tar", ".tar.gz", ".tgz", ".tar.bz2",
                                           ".tbz2", ".tar.xz", ".txz"))


def image_problem(image: str) -> str | None:
    """None when the host can stand in for `image`, otherwise why it cannot."""
    ref = image.split("@", 1)[0]
    parts = ref.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]               # drop the registry
    name = parts[-1].split(":", 1)[0].lower()
    if name == "scratch":
        return "base image 'scratch' is empty; the host cannot stand in for it"
    if any(name == f or name.startswith(f + "-") for f in HOST_LIKE_IMAGES):
        return None
    family = name.split("-", 1)[0] if name not in TOOLCHAIN_IMAGES else name
    binary = TOOLCHAIN_IMAGES.get(name) or TOOLCHAIN_IMAGES.get(family)
    if binary is not None:
        if shutil.which(binary):
            return None
        return f"base image {image!r} needs {binary!r}, which this machine does not have"
    return (f"base image {image!r} is not available without Docker (only Debian/Ubuntu/"
            f"Python-like images and toolchains installed on the host can be stood in for)")


def _host_exists(path: str) -> bool:
    return Path(path).exists()


def _own_root(path: str) -> str | None:
    """The shallowest ancestor of `path` (inclusive) that the host does not have: a
    directory we may mount without hiding host files. None if the host has them all."""
    cur = "/"
    for part in PurePosixPath(path).parts[1:]:
        cur = str(PurePosixPath(cur) / part)
        if not _host_exists(cur):
            return cur
    return None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def plan_build(dockerfile: Path | None, context: Path, default_workdir: str = "/app",
               base_image: str | None = None) -> BuildPlan:
    """Parse `dockerfile` (if any) and decide the workspace, extra mounts and problems."""
    if dockerfile is None:
        problems = (image_problem(base_image),) if base_image else ()
        return BuildPlan(None, context, base_image=base_image, workdir=default_workdir,
                         workspace=default_workdir, problems=tuple(p for p in problems if p))
    try:
        instructions = tuple(parse_dockerfile(dockerfile))
    except TaskError as e:
        if str(dockerfile) in e.message:
            raise
        raise TaskError(f"{dockerfile}: {e.message}", hint=e.hint) from None
    problems: list[str] = []
    notes: list[str] = []
    froms = [ins for ins in instructions if ins.keyword == "FROM"]
    arg_defaults: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            arg_defaults[name.strip()] = default.strip().strip('"')
    if not froms:
        raise TaskError(f"{dockerfile}: no FROM instruction", hint="a Dockerfile starts "
                        "with FROM <image>")
    if len(froms) > 1:
        problems.append("multi-stage Dockerfile (several FROM) is not supported")
    image = expand(froms[0].args.split()[0], arg_defaults) if froms[0].args else ""
    if (p := image_problem(image)) is not None:
        problems.append(p)
    for ins in instructions:
        if ins.keyword in ("COPY", "ADD") and "from" in ins.flags:
            problems.append(f"line {ins.line}: COPY --from (multi-stage) is not supported")
        if ins.keyword == "ADD" and re.search(r"\bhttps?://|\bgit@", ins.args):
            problems.append(f"line {ins.line}: ADD of a URL needs the internet")
        if ins.keyword == "RUN" and any(name == "mount" and ("type=secret" in v or
                                                             "type=ssh" in v)
                                        for name, v in ins.flags.items()):
            problems.append(f"line {ins.line}: RUN --mount with secrets/ssh is not supported")
        if ins.keyword in IGNORED:
            notes.append(f"line {ins.line}: {ins.keyword} ignored")
        if ins.keyword in ("COPY", "ADD") and (mode := ins.flags.get("chmod")):
            if not re.fullmatch(r"[0-7]{1,4}", mode):
                problems.append(f"line {ins.line}: --chmod={mode} is not supported "
                                f"(only octal modes)")
            elif int(mode, 8) & ~0o777:
                notes.append(f"line {ins.line}: setuid/setgid/sticky bits of "
                             f"--chmod={mode} dropped")
    steps, _, workdir = _walk(instructions, context, IMAGE_DEFAULT_ENV, dockerfile)
    if workdir == "/":
        if any(isinstance(s, MkdirStep) for s in steps):
            problems.append("WORKDIR / cannot be the writable workspace")
        workdir = default_workdir
    workspace = _own_root(workdir) or workdir
    extra: list[str] = []
    for step in steps:
        path = None
        if isinstance(step, MkdirStep):
            path = step.path
        elif isinstance(step, CopyStep):
            # the directory that receives the copy must be ours
            into_dir = step.dest_is_dir or any(s.is_dir() for s in step.sources) or \
                step.unpack
            path = step.dest if into_dir else str(PurePosixPath(step.dest).parent)
        if path is None or _under(path, workspace) or any(_under(path, d) for d in extra):
            continue
        if path == "/":
            problems.append(f"line {step.line}: cannot write to / without Docker")
            continue
        root = _own_root(path)
        if root is None:
            if isinstance(step, MkdirStep):
                continue        # an existing host directory as WORKDIR: nothing to create
            problems.append(f"line {step.line}: copying into {path} (a directory the host "
                            f"owns) cannot be honoured without Docker")
        elif not _under(workspace, root):
            extra.append(root)
        else:
            problems.append(f"line {step.line}: {path} contains the workspace {workspace}")
    for step in steps:
        if isinstance(step, CopyStep) and step.content is None and not step.sources:
            problems.append(f"line {step.line}: COPY source not found in the build context "
                            f"{context}")
    return BuildPlan(dockerfile, context, instructions, image, workdir, workspace,
                     tuple(extra), tuple(problems), tuple(notes),
                     host_problems=tuple(problems))
