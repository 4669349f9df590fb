"""sh-tar-archive: /app/logs.tar.gz is a .tar.gz holding the files of /app/logs."""

import tarfile
from pathlib import Path

ARCHIVE = Path("/app/logs.tar.gz")
FILES = {"web.log": "GET /\n", "db.log": "connect\n"}


def test_is_gzip_tar():
    assert ARCHIVE.is_file(), "/app/logs.tar.gz does not exist"
    assert ARCHIVE.read_bytes()[:2] == b"\x1f\x8b", "not gzip-compressed"


def test_members():
    with tarfile.open(ARCHIVE, "r:gz") as tar:
        found = {m.name.rsplit("/", 1)[-1]: tar.extractfile(m).read().decode()
                 for m in tar.getmembers() if m.isfile()}
    assert found == FILES
