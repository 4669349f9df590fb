#!/bin/bash
cd /app
python3 - <<'PY'
from pathlib import Path
p = Path("stats.py")
s = p.read_text()
s = s.replace('''    result = []
    for i in range(len(values) - window):''', '''    if window < 1:
        raise ValueError("window must be at least 1")
    result = []
    for i in range(len(values) - window + 1):''')
p.write_text(s)
PY
