"""A task's archives stream into its sandbox with a cap: an `ADD` of a small gzip that
unpacks to 1 GiB used to be re-packed in a BytesIO (the harness grew by 1 GiB); now it
fails the build with a TaskError naming the Dockerfile line while the harness's memory
stays flat. And a failed `prepare_environment` leaves no staging directory behind.

The bombs are real gzip files (members of 1 MiB of zeros, concatenated: ~1 KiB each);
positive controls show they declare and unpack to what they claim, and that the memory
measurement sees a buffer of that kind."""

from __future__ import annotations

import gzip
import io
import shutil
import tarfile
import tempfile
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from ridgeline.errors import TaskError
from ridgeline.tasks import load_task, prepare_environment

FIXTURES = Path(__file__).parent / "fixtures"
MiB = 1 << 20
GiB = 1 << 30
ZEROS = gzip.compress(b"\0" * MiB, 9)  # one gzip member: 1 MiB of zeros in ~1 KiB


def _header(name: str, size: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    ti = tarfile.TarInfo(name)
    ti.size, ti.type, ti.mode = size, kind, 0o644
    return ti.tobuf(format=tarfile.USTAR_FORMAT)


def bomb_one_file(path: Path) -> Path:
    """One member of 1 GiB of zeros."""
    with open(path, "wb") as f:
        f.write(gzip.compress(_header("big.bin", GiB)))
        for _ in range(GiB // MiB):
            f.write(ZEROS)
        f.write(gzip.compress(b"\0" * 1024))
    return path


def bomb_many_files(path: Path) -> Path:
    """1024 members of 1 MiB each: no single member is over any cap."""
    with open(path, "wb") as f:
        for i in range(GiB // MiB):
            f.write(gzip.compress(_header(f"f{i:04d}", MiB)))
            f.write(ZEROS)
        f.write(gzip.compress(b"\0" * 1024))
    return path


def bomb_pax_header(path: Path) -> Path:
    """A PAX extended header that claims 1 GiB (tarfile reads a header whole)."""
    with open(path, "wb") as f:
        f.write(gzip.compress(_header("././@PaxHeader", GiB, tarfile.XHDTYPE)))
        for _ in range(GiB // MiB):
            f.write(ZEROS)
        f.write(gzip.compress(_header("x", 0) + b"\0" * 1024))
    return path


BOMBS = {"one 1 GiB file": bomb_one_file, "1024 files of 1 MiB": bomb_many_files,
         "a 1 GiB PAX header": bomb_pax_header}


def _task(tmp_path: Path, dockerfile: str, storage_mb: int = 64) -> Path:
    d = tmp_path / "task"
    shutil.copytree(FIXTURES / "harbor-hello", d)
    (d / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    toml = d / "task.toml"
    toml.write_text(toml.read_text().replace("storage_mb = 10240",
                                             f"storage_mb = {storage_mb}"))
    return d


def _peak_during(fn) -> tuple[int, BaseException | None]:
    tracemalloc.start()
    try:
        try:
            fn()
            error = None
        except BaseException as e:  # noqa: BLE001 - returned to the test
            error = e
        return tracemalloc.get_traced_memory()[1], error
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", sorted(BOMBS))
def test_add_of_a_gzip_bomb_fails_the_build_with_flat_memory(tmp_path, kind):
    d = _task(tmp_path, "FROM ubuntu:24.04\nWORKDIR /app\nADD bomb.tar.gz /app/\n",
              storage_mb=16)
    bomb = BOMBS[kind](d / "environment" / "bomb.tar.gz")
    # Positive controls: a small file that unpacks to over 1 GiB (1024 gzip members of
    # 1 MiB of zeros, and a tar header that claims 1 GiB or a member per MiB; gunzipping
    # it all would take seconds), and a memory measurement that sees a buffer of the
    # kind the old code built.
    data = bomb.read_bytes()
    assert len(data) < 2 * MiB
    assert len(gzip.decompress(ZEROS)) == MiB and data.count(ZEROS) == GiB // MiB
    with gzip.open(bomb) as f:
        head = f.read(MiB)
    first = tarfile.TarInfo.frombuf(head[:512], "utf-8", "surrogateescape")
    assert first.size == GiB or (first.size == MiB and kind.startswith("1024"))
    peak, _ = _peak_during(lambda: io.BytesIO(b"\1" * (48 * MiB)))
    assert peak >= 48 * MiB
    task = load_task(d)
    peak, error = _peak_during(lambda: prepare_environment(task).close())
    assert isinstance(error, TaskError), error
    assert "Dockerfile line 3" in str(error)
    # Half the cap: the archive was never buffered, not even up to the cap.
    assert peak < 8 * MiB, f"the harness held {peak} bytes at once"


def test_add_of_an_archive_within_the_cap_still_unpacks(tmp_path):
    """Positive control for the cap: a normal archive unpacks, modes kept, setuid
    dropped, no member outside the destination."""
    d = _task(tmp_path, "FROM ubuntu:24.04\nWORKDIR /app\nADD data.tgz /app/\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body, mode in [("dir/a.txt", b"A" * 5000, 0o640),
                                 ("run.sh", b"#!/bin/sh\necho hi\n", 0o4755)]:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode = len(body), mode
            tar.addfile(ti, io.BytesIO(body))
    (d / "environment" / "data.tgz").write_bytes(buf.getvalue())
    with prepare_environment(load_task(d)) as sb:
        r = sb.run("stat -c '%a %s %n' /app/dir/a.txt /app/run.sh; /app/run.sh; "
                   "ls -A /tests")
        assert r.ok, r.stderr
        assert r.stdout.splitlines() == ["640 5000 /app/dir/a.txt", "755 18 /app/run.sh",
                                         "hi"]  # /tests: no archive left in it


def test_copy_of_a_directory_over_the_cap_fails_the_build(tmp_path):
    d = _task(tmp_path, "FROM ubuntu:24.04\nWORKDIR /app\nCOPY data /app/data\n",
              storage_mb=1)
    (d / "environment" / "data").mkdir()
    for i in range(3):
        (d / "environment" / "data" / f"f{i}").write_bytes(b"x" * (400 * 1024))
    with pytest.raises(TaskError, match="Dockerfile line 3"):
        prepare_environment(load_task(d))
    # Positive control: the same directory fits a larger storage.
    d2 = _task(tmp_path / "ok", "FROM ubuntu:24.04\nWORKDIR /app\nCOPY data /app/data\n",
               storage_mb=8)
    shutil.copytree(d / "environment" / "data", d2 / "environment" / "data")
    with prepare_environment(load_task(d2)) as sb:
        r = sb.run("cd /app/data && wc -c f0 f1 f2")
        assert r.ok and r.stdout.split()[-2:] == [str(3 * 400 * 1024), "total"], r.stdout


# -- staging directories --------------------------------------------------------------------
def _staging_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("ridgeline-task-"))


def test_failed_prepare_environment_leaves_no_staging_directory(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # count only this test's
    task = load_task(FIXTURES / "harbor-hello")
    # Positive control: a prepared environment has its staging directory there.
    with prepare_environment(task):
        assert len(_staging_dirs(tmp)) == 1
    assert _staging_dirs(tmp) == []
    # An invalid SandboxSpec (an environment variable named "A=B") fails after the
    # staging directory was made ...
    with pytest.raises(Exception, match="invalid environment variable"):
        prepare_environment(task, env={"A=B": "1"})
    assert _staging_dirs(tmp) == []
    # ... and so does a build that fails.
    bad = load_task(_task(tmp_path, "FROM ubuntu:24.04\nWORKDIR /app\nRUN exit 3\n"))
    with pytest.raises(Exception, match="RUN"):
        prepare_environment(bad)
    assert _staging_dirs(tmp) == []
