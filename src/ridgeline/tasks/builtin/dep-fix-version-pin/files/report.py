"""Monthly spending report."""

import sys

sys.path.insert(0, "/app/vendor")   # dependencies are installed here

import tinyfmt  # noqa: E402

spending = [["rent", 1200.0], ["food", 432.5], ["transport", 89.99]]
rows = [[name, tinyfmt.money(amount)] for name, amount in spending]
print(tinyfmt.table(rows, header=["item", "amount"]))
print("total:", tinyfmt.money(sum(a for _, a in spending)))
