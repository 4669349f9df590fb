"""Prints the warehouse inventory (written for tinyfmt 1.x)."""

import sys

sys.path.insert(0, "/app/vendor")   # dependencies are installed here

import tinyfmt  # noqa: E402

rows = [["bolts", 1500], ["nuts", 1320], ["washers", 98]]
print(tinyfmt.format_table(rows))
