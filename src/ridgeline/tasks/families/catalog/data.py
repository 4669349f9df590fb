"""CSV and JSON data: totals, grouped sums, conversions with filters, counts."""

from __future__ import annotations

import json
import random

from ridgeline.tasks.families.base import Instance, family
from ridgeline.tasks.families.catalog.checks import untouched_test
from ridgeline.tasks.families.catalog.words import NAMES, NOUNS, SERVICES

REGIONS = ("north", "south", "east", "west", "central")
CITIES = ("lisbon", "oslo", "quito", "lagos", "kyoto", "perth", "denver", "tunis")
STATUSES = ("pending", "shipped", "delivered", "cancelled", "returned")


def _sales(rng: random.Random, n: int) -> tuple[list[str], list[list[str]]]:
    products = rng.sample(NOUNS, rng.randint(3, 6))
    header = ["date", "region", "product", "units", "amount"]
    rows = [[f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}", rng.choice(REGIONS),
             rng.choice(products), str(rng.randint(1, 60)),
             f"{rng.randint(100, 99999) / 100:.2f}"] for _ in range(n)]
    return header, rows


def _csv(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(",".join(r) for r in [header, *rows]) + "\n"


@family("csv-column-total", skill="data", split="train")
def csv_column_total(rng: random.Random) -> Instance:
    """The sum or average of one CSV column, over all rows or those of one region."""
    header, rows = _sales(rng, rng.randint(10, 40))
    col = rng.choice(("units", "amount"))
    k = header.index(col)
    op = rng.choice(("sum", "average"))
    region = rng.choice([r[1] for r in rows]) if rng.random() < 0.5 else None
    picked = [r for r in rows if region is None or r[1] == region]
    vals = [float(r[k]) for r in picked]
    exact = sum(vals) if op == "sum" else sum(vals) / len(vals)
    cents = op == "average" or col == "amount"
    src = rng.choice(("sales.csv", "orders.csv", "transactions.csv", "q3_sales.csv"))
    out = rng.choice(("total.txt", "result.txt", f"{op}_{col}.txt", "answer.txt"))
    where = f" of the rows whose region is {region}" if region else ""
    where2 = f", counting only rows with region `{region}`" if region else ""
    fmt = " rounded to 2 decimal places" if cents else ""
    what = "total" if op == "sum" else "average (mean)"
    instruction = rng.choice((
        f"What is the {what} of the `{col}` column{where} in /app/{src}? Write the "
        f"number{fmt} to /app/{out}, and nothing else.",
        f"Compute the {what} `{col}`{where2} in the CSV file /app/{src} (it has a header "
        f"line) and save it{fmt} in /app/{out}.",
        f"/app/{out} should contain a single number: the {what} of the `{col}` values"
        f"{where} in /app/{src}{',' + fmt if fmt else ''}.",
    ))
    if cents:
        check = f"assert abs(got - {exact!r}) <= 0.005 + 1e-9"
    else:
        check = f"assert got == {int(exact)}"
    tests = f'''"""csv-column-total: {op} of {col}{" for " + region if region else ""} in {src}."""
import hashlib
from pathlib import Path


def test_value():
    got = float(Path("/app/{out}").read_text().strip())
    {check}
''' + untouched_test(src, _csv(header, rows))
    cond = f' && $2 == "{region}"' if region else ""
    if op == "sum":
        end = 'printf "%.2f\\n", s' if cents else "print s"
    else:
        end = 'printf "%.2f\\n", s / n'
    solution = f"awk -F, 'NR > 1{cond} {{ s += ${k + 1}; n++ }} END {{ {end} }}' {src} > {out}\n"
    return Instance(instruction, {src: _csv(header, rows)}, solution, tests,
                    difficulty="medium" if region else "easy", tags=("csv", "awk"))


@family("csv-group-sum", skill="data", split="train")
def csv_group_sum(rng: random.Random) -> Instance:
    """Per-group totals of a CSV column written as a new CSV, one row per group."""
    header, rows = _sales(rng, rng.randint(12, 40))
    group = rng.choice(("region", "product"))
    g = header.index(group)
    k = header.index("units")
    totals: dict[str, int] = {}
    for r in rows:
        totals[r[g]] = totals.get(r[g], 0) + int(r[k])
    expected = [[group, "total_units"]] + [[key, str(totals[key])] for key in sorted(totals)]
    src = rng.choice(("sales.csv", "orders.csv", "shipments.csv"))
    out = rng.choice((f"units_by_{group}.csv", "summary.csv", "totals.csv"))
    instruction = rng.choice((
        f"From /app/{src}, compute the total number of units for each {group}. Write "
        f"/app/{out} as CSV with the header `{group},total_units` and one row per {group}, "
        f"ordered alphabetically by {group}.",
        f"Summarise /app/{src}: for every distinct value of its `{group}` column, add up "
        f"the `units`. Save the result to /app/{out} (header line `{group},total_units`, "
        f"then `<{group}>,<total>` rows in alphabetical order of {group}).",
        f"I need units per {group} from the sales data in /app/{src}. Create the CSV file "
        f"/app/{out} with columns {group} and total_units (that header first), one line "
        f"per {group}, {group}s in alphabetical order.",
    ))
    tests = f'''"""csv-group-sum: units by {group} in {src}."""
import csv
import hashlib
from pathlib import Path

EXPECTED = {expected!r}


def test_totals():
    with open("/app/{out}", newline="") as f:
        rows = [[c.strip() for c in r] for r in csv.reader(f) if r]
    assert rows == EXPECTED
''' + untouched_test(src, _csv(header, rows))
    solution = (f"{{ echo '{group},total_units'; tail -n +2 {src} | awk -F, "
                f"'{{ t[${g + 1}] += ${k + 1} }} END {{ for (x in t) print x \",\" t[x] }}' "
                f"| sort; }} > {out}\n")
    return Instance(instruction, {src: _csv(header, rows)}, solution, tests,
                    difficulty="medium", tags=("csv", "group-by"))


def _people(rng: random.Random, n: int) -> list[dict]:
    ids = rng.sample(range(100, 999), n)
    names = rng.sample(NAMES, n)
    return [{"id": ids[i], "name": names[i].capitalize(), "city": rng.choice(CITIES),
             "age": rng.randint(19, 70), "score": rng.randint(0, 100)} for i in range(n)]


@family("convert-records-filtered", skill="data", split="heldout")
def convert_records_filtered(rng: random.Random) -> Instance:
    """Records converted JSON to CSV (or CSV to JSON), keeping only those matching a filter."""
    while True:
        people = _people(rng, rng.randint(8, 18))
        kind = rng.choice(("city", "age", "score"))
        if kind == "city":
            city = rng.choice([p["city"] for p in people])
            keep = [p for p in people if p["city"] == city]
            cond = f"whose city is \"{city}\""
        else:
            limit = rng.choice([p[kind] for p in people])
            keep = [p for p in people if p[kind] >= limit]
            cond = f"whose {kind} is at least {limit}"
        if 1 < len(keep) < len(people):
            break
    fields = ["id", "name", *rng.sample(["city", "age", "score"], rng.randint(1, 2))]
    to_csv = rng.random() < 0.5
    base = rng.choice(("people", "members", "users", "contacts"))
    src = f"{base}.json" if to_csv else f"{base}.csv"
    out = rng.choice(("selected", "filtered", "subset", "export")) + (".csv" if to_csv else ".json")
    cols = ", ".join(fields)
    if to_csv:
        content = json.dumps(people, indent=2) + "\n"
        spec = (f"a CSV file with the header line `{','.join(fields)}` and one row per "
                f"record")
    else:
        content = _csv(list(people[0]), [[str(v) for v in p.values()] for p in people])
        spec = ("a JSON array of objects with exactly those keys (numbers as JSON numbers, "
                "text as strings)")
    instruction = rng.choice((
        f"Convert the records {cond} in /app/{src} to /app/{out}: {spec}, keeping only the "
        f"fields {cols}, in the order the records appear in the input.",
        f"Write to /app/{out} the people of /app/{src} {cond}. Output format: {spec}; "
        f"fields {cols}; same order as in /app/{src}.",
        f"Export a filtered copy of /app/{src} as /app/{out}. Include only records {cond}, "
        f"only the fields {cols}, and keep their original order. The output is {spec}.",
    ))
    expected = [{f: p[f] for f in fields} for p in keep]
    if to_csv:
        rows = [fields] + [[str(p[f]) for f in fields] for p in keep]
        check = f'''import csv
    with open("/app/{out}", newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    assert rows == {rows!r}'''
        solution_out = (f"with open({out!r}, 'w', newline='') as fh:\n"
                        f"    w = csv.writer(fh)\n    w.writerow(FIELDS)\n"
                        f"    w.writerows([r[f] for f in FIELDS] for r in keep)\n")
        load = f"records = json.load(open({src!r}))\n"
    else:
        check = f'''import json
    assert json.loads(Path("/app/{out}").read_text()) == {expected!r}'''
        solution_out = (f"with open({out!r}, 'w') as fh:\n"
                        f"    json.dump([{{f: r[f] for f in FIELDS}} for r in keep], fh, "
                        f"indent=1)\n")
        load = (f"records = [{{k: (int(v) if k in ('id', 'age', 'score') else v) "
                f"for k, v in r.items()}} for r in csv.DictReader(open({src!r}))]\n")
    test_cond = (f"r['city'] == {city!r}" if kind == "city" else f"r[{kind!r}] >= {limit}")
    tests = f'''"""convert-records-filtered: {src} -> {out}, records {cond}."""
import hashlib
from pathlib import Path


def test_output():
    {check}
''' + untouched_test(src, content)
    solution = (f"python3 - <<'PY'\nimport csv, json\nFIELDS = {fields!r}\n{load}"
                f"keep = [r for r in records if {test_cond}]\n{solution_out}PY\n")
    return Instance(instruction, {src: content}, solution, tests, difficulty="medium",
                    tags=("json", "csv", "filter"))


@family("count-json-matching", skill="data", split="heldout")
def count_json_matching(rng: random.Random) -> Instance:
    """How many records of a JSON file satisfy a condition (a count written to a file)."""
    n = rng.randint(15, 50)
    customers = rng.sample(NAMES, 8)
    orders = [{"id": 1000 + i, "customer": rng.choice(customers),
               "status": rng.choice(STATUSES), "total": round(rng.uniform(5, 500), 2),
               "items": rng.randint(1, 9)} for i in range(n)]
    kind = rng.choice(("status", "total", "both"))
    status = rng.choice(STATUSES)
    limit = float(rng.choice((50, 100, 150, 200, 250)))
    # A record exactly on the limit: "more than" must exclude it.
    orders[rng.randrange(n)]["total"] = limit
    orders[rng.randrange(n)].update(status=status, total=limit)
    if kind == "status":
        match = [o for o in orders if o["status"] == status]
        cond = f"have status \"{status}\""
        expr = f"o['status'] == {status!r}"
    elif kind == "total":
        match = [o for o in orders if o["total"] > limit]
        cond = f"have a total strictly greater than {limit:g}"
        expr = f"o['total'] > {limit!r}"
    else:
        match = [o for o in orders if o["status"] == status and o["total"] > limit]
        cond = f"have status \"{status}\" and a total strictly greater than {limit:g}"
        expr = f"o['status'] == {status!r} and o['total'] > {limit!r}"
    src = rng.choice(("orders.json", "data/orders.json", "export.json"))
    out = rng.choice(("count.txt", "answer.txt", "matches.txt"))
    instruction = rng.choice((
        f"/app/{src} holds a JSON array of orders. How many of them {cond}? Write just "
        f"the number to /app/{out}.",
        f"Count the orders in /app/{src} that {cond}, and save the count (only the number) "
        f"in /app/{out}.",
        f"Find out how many records of the JSON file /app/{src} {cond}; /app/{out} should "
        f"contain that number and nothing else.",
    ))
    content = json.dumps(orders, indent=1) + "\n"
    tests = f'''"""count-json-matching: {len(match)} orders {cond}."""
import hashlib
from pathlib import Path


def test_count():
    assert Path("/app/{out}").read_text().strip() == "{len(match)}"
''' + untouched_test(src, content)
    solution = (f"python3 - <<'PY' > {out}\nimport json\norders = json.load(open({src!r}))\n"
                f"print(sum(1 for o in orders if {expr}))\nPY\n")
    return Instance(instruction, {src: content}, solution, tests,
                    difficulty="medium" if kind == "both" else "easy", tags=("json", "count"))


@family("count-distinct-values", skill="counting", split="heldout")
def count_distinct_values(rng: random.Random) -> Instance:
    """How many different values one column of a CSV file takes."""
    users = rng.sample([f"{n}{rng.randint(1, 99)}" for n in NAMES], rng.randint(4, 15))
    pages = [f"/{p}" for p in rng.sample(NOUNS, rng.randint(3, 12))]
    services = rng.sample(SERVICES, rng.randint(2, 7))
    n = rng.randint(20, 60)
    header = ["time", "user", "page", "service", "status"]
    rows = [[f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}", rng.choice(users),
             rng.choice(pages), rng.choice(services), rng.choice(("200", "200", "404", "500"))]
            for _ in range(n)]
    col = rng.choice(("user", "page", "service"))
    k = header.index(col)
    distinct = len({r[k] for r in rows})
    src = rng.choice(("visits.csv", "access.csv", "requests.csv"))
    out = rng.choice(("distinct.txt", f"{col}s.txt", "answer.txt"))
    plural = {"user": "users", "page": "pages", "service": "services"}[col]
    instruction = rng.choice((
        f"How many different {plural} appear in the `{col}` column of /app/{src}? Write "
        f"just the number to /app/{out}.",
        f"Count the distinct values of the `{col}` column in the CSV file /app/{src} "
        f"(not counting its header) and save the count in /app/{out}.",
        f"/app/{out} should contain the number of unique {plural} (column `{col}`) in "
        f"/app/{src}, and nothing else.",
    ))
    tests = f'''"""count-distinct-values: {distinct} distinct {col} in {src}."""
import hashlib
from pathlib import Path


def test_count():
    assert Path("/app/{out}").read_text().strip() == "{distinct}"
''' + untouched_test(src, _csv(header, rows))
    solution = f"tail -n +2 {src} | cut -d, -f{k + 1} | sort -u | wc -l > {out}\n"
    return Instance(instruction, {src: _csv(header, rows)}, solution, tests,
                    tags=("csv", "uniq", "count"))
