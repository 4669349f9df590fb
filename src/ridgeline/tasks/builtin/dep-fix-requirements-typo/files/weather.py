"""Converts a few city temperatures and distances."""

import sys

sys.path.insert(0, "/app/vendor")   # dependencies are installed here

import tinyfmt  # noqa: E402
import unitconv  # noqa: E402

cities = [["Oslo", -3.0, 12.0], ["Lisbon", 18.5, 40.2], ["Cairo", 31.0, 7.5]]
rows = [[name, f"{unitconv.c_to_f(c):.1f}F", f"{unitconv.km_to_miles(km):.2f}mi"]
        for name, c, km in cities]
print(tinyfmt.table(rows, header=["city", "temp", "commute"]))
