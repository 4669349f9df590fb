"""python3 -m pipeline.main LOG OUT: writes the report of LOG to OUT."""

import sys

from pipeline.aggregate import aggregate
from pipeline.parse import parse_line
from pipeline.report import render


def main(log_path, out_path):
    records, malformed = [], 0
    with open(log_path) as f:
        for line in f:
            rec = parse_line(line.rstrip("\n"))
            if rec is None:
                malformed += 1 if line.strip() else 0
            else:
                records.append(rec)
    with open(out_path, "w") as out:
        out.write(render(aggregate(records)))
        out.write(f"malformed: {malformed}\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
