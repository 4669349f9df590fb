#!/bin/bash
cat > /app/todo/cli.py <<'PY'
"""Commands of the to-do list."""

import argparse
import sys

from todo import storage


def cmd_add(args):
    data = storage.load()
    item = {"id": data["next_id"], "text": args.text, "done": False}
    data["next_id"] += 1
    data["items"].append(item)
    storage.save(data)
    print(f"added {item['id']}")
    return 0


def cmd_list(args):
    for item in storage.load()["items"]:
        if args.pending and item["done"]:
            continue
        mark = "x" if item["done"] else " "
        print(f"{item['id']}. [{mark}] {item['text']}")
    return 0


def _find(data, item_id):
    for item in data["items"]:
        if item["id"] == item_id:
            return item
    print(f"no item {item_id}", file=sys.stderr)
    return None


def cmd_done(args):
    data = storage.load()
    item = _find(data, args.id)
    if item is None:
        return 1
    item["done"] = True
    storage.save(data)
    print(f"done {args.id}")
    return 0


def cmd_remove(args):
    data = storage.load()
    item = _find(data, args.id)
    if item is None:
        return 1
    data["items"].remove(item)
    storage.save(data)
    print(f"removed {args.id}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="todo")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("add", help="add an item")
    p.add_argument("text")
    p.set_defaults(func=cmd_add)
    p = sub.add_parser("list", help="show the items")
    p.add_argument("--pending", action="store_true", help="only items not done")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("done", help="mark an item done")
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_done)
    p = sub.add_parser("remove", help="delete an item")
    p.add_argument("id", type=int)
    p.set_defaults(func=cmd_remove)
    args = parser.parse_args(argv)
    return args.func(args)
PY
