"""Commands of the to-do list."""

import argparse

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
        mark = "x" if item["done"] else " "
        print(f"{item['id']}. [{mark}] {item['text']}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="todo")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("add", help="add an item")
    p.add_argument("text")
    p.set_defaults(func=cmd_add)
    p = sub.add_parser("list", help="show the items")
    p.set_defaults(func=cmd_list)
    args = parser.parse_args(argv)
    return args.func(args)
