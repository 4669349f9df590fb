"""organize-by-extension: every inbox file moved to sorted/<ext>/."""

from pathlib import Path

EXPECTED = {
    "report.pdf": "pdf", "photo.JPG": "jpg", "notes.txt": "txt", "data.csv": "csv",
    "archive.tar.gz": "gz", "README": "other", "todo.txt": "txt", "image.jpg": "jpg",
    "Makefile": "other", "summary.Csv": "csv",
}


def test_inbox_empty():
    assert Path("/app/inbox").is_dir()
    assert list(Path("/app/inbox").iterdir()) == []


def test_files_sorted():
    for name, ext in EXPECTED.items():
        p = Path("/app/sorted") / ext / name
        assert p.is_file(), f"missing {p}"
        assert p.read_text() == f"content of {name}\n"


def test_no_extra_files():
    found = sorted(str(p.relative_to("/app/sorted")) for p in Path("/app/sorted").rglob("*")
                   if p.is_file())
    assert found == sorted(f"{ext}/{name}" for name, ext in EXPECTED.items())
