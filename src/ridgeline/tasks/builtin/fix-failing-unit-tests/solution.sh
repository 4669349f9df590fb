#!/bin/bash
cd /app
python3 - <<'PY'
from pathlib import Path
p = Path("inventory.py")
s = p.read_text()
s = s.replace("if qty > have + 1:", "if qty > have:")
s = s.replace("        self._stock[item] = have - qty\n",
              "        if have == qty:\n            del self._stock[item]\n"
              "        else:\n            self._stock[item] = have - qty\n")
p.write_text(s)
PY
