"""Weekly visitor report."""

import sys

sys.path.insert(0, "/app/vendor")   # dependencies are installed here

import reportkit  # noqa: E402

visits = [["mon", 120], ["tue", 98], ["wed", 143]]
print(reportkit.render("Visitors", visits, header=["day", "visits"]), end="")
