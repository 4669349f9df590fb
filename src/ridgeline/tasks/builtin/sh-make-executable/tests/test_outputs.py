"""sh-make-executable: /app/run.sh has its owner's execute bit."""

import stat
from pathlib import Path

RUN = Path("/app/run.sh")


def test_executable():
    assert stat.S_IMODE(RUN.stat().st_mode) & stat.S_IXUSR, "/app/run.sh is not executable"


def test_content_kept():
    assert RUN.read_text() == '#!/bin/bash\necho running\n'
