"""backup-archive: docs/ without *.tmp in a .tar.gz, and its checksum."""

import hashlib
import tarfile
from pathlib import Path

ARCHIVE = Path("/app/backup.tar.gz")
WANTED = {"docs/index.md", "docs/guide/intro.md", "docs/guide/setup.md",
          "docs/images/logo.txt"}


def members():
    with tarfile.open(ARCHIVE, "r:gz") as tar:
        return {m.name.removeprefix("./"): m for m in tar.getmembers()}


def test_archive_is_gzip_tar():
    assert ARCHIVE.is_file()
    assert ARCHIVE.read_bytes()[:2] == b"\x1f\x8b", "not gzip-compressed"
    assert tarfile.is_tarfile(ARCHIVE)


def test_files_present_with_docs_prefix():
    files = {n for n, m in members().items() if m.isfile()}
    assert files == WANTED


def test_contents_match():
    with tarfile.open(ARCHIVE, "r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile():
                name = m.name.removeprefix("./")
                assert tar.extractfile(m).read() == (Path("/app") / name).read_bytes()


def test_checksum_file():
    line = Path("/app/backup.sha256").read_text().strip()
    digest = hashlib.sha256(ARCHIVE.read_bytes()).hexdigest()
    assert line == f"{digest}  backup.tar.gz"
