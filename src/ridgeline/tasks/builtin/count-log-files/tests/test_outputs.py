"""count-log-files: the number of *.log files under /app/logs (6)."""

from pathlib import Path


def test_count_file_exists():
    assert Path("/app/count.txt").is_file()


def test_count_is_correct():
    assert Path("/app/count.txt").read_text().strip() == "6"


def test_logs_untouched():
    logs = sorted(str(p.relative_to("/app/logs")) for p in Path("/app/logs").rglob("*")
                  if p.is_file())
    assert len(logs) == 9
