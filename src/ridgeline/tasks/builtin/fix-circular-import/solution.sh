#!/bin/bash
cd /app/library
python3 - <<'PY'
from pathlib import Path
p = Path("models.py")
s = p.read_text()
s = s.replace("from library.services import format_book\n\n\n", "")
s = s.replace("        return format_book(self)",
              "        from library.services import format_book  # deferred: services imports models\n\n"
              "        return format_book(self)")
p.write_text(s)
PY
