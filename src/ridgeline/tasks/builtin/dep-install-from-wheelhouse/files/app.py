"""Prints the fruit stock as a table."""

import sys

sys.path.insert(0, "/app/vendor")   # third-party packages are installed here

import tinyfmt  # noqa: E402

rows = [["apples", 3], ["pears", 12], ["plums", 7]]
print(tinyfmt.table(rows, header=["fruit", "qty"]))
