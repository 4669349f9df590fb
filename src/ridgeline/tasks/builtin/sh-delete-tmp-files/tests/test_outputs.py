"""sh-delete-tmp-files: no *.tmp file is left in /app; the others are kept."""

from pathlib import Path


def test_tmp_files_gone():
    assert sorted(p.name for p in Path("/app").glob("*.tmp")) == []


def test_other_files_kept():
    assert Path("/app/keep.txt").read_text() == "keep me\n"
    assert Path("/app/data.csv").read_text() == "a,b\n1,2\n"
