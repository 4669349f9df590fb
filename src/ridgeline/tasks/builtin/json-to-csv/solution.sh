#!/bin/bash
cd /app
python3 - <<'PY'
import csv, json
users = sorted(json.load(open("users.json")), key=lambda u: u["id"])
with open("users.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["id", "name", "email", "city"])
    for u in users:
        w.writerow([u["id"], u["name"], u["email"], u["address"]["city"]])
PY
