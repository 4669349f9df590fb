"""Multi-step tool-call tasks over the simulated `World`, graded by its final state.

Each task has an initial world, an instruction, a state check, and an oracle that solves
it through the same tool interface the model uses (so every task is known solvable, and
the untouched world is known to fail: the test suite checks both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ridgeline.eval.toolbench.world import World, call_tool

Check = Callable[[World, World], "tuple[bool, str]"]  # (initial, final) -> (ok, reason)


@dataclass(frozen=True)
class ToolTask:
    id: str
    domain: str  # "portfolio", "documents" or "mixed"
    difficulty: str
    instruction: str
    setup: Callable[[], World]
    check: Check
    oracle: Callable[[World], None]
    # What the agent's `TaskLike` asks of every task: a world has no file system, and the
    # agent config's time limit applies.
    workdir: str | None = None
    agent_timeout_s: float | None = None


def _market(cash: float = 10_000.0) -> World:
    w = World(cash=cash, prices={"ACME": 12.5, "BOLT": 40.0, "CRUX": 7.25, "DYNE": 103.0,
                                 "EPIC": 55.5, "FLUX": 3.2})
    return w


def _held(w: World, sym: str) -> int:
    p = w.positions.get(sym)
    return p.quantity if p else 0


def _seed_positions(w: World, **held: tuple[int, float]) -> World:
    from ridgeline.eval.toolbench.world import Position

    for sym, (qty, cost) in held.items():
        w.positions[sym] = Position(qty, cost)
    return w


def _docs(w: World) -> World:
    w.add_document("Invoice 1042", "Invoice for consulting, 1,200 EUR, due 2026-12-01.", "inbox")
    w.add_document("Team offsite", "Agenda: planning, hiking, dinner.", "inbox", ["events"])
    w.add_document("Draft: blog post", "Paged attention explained. TODO: figures.", "tmp", ["draft"])
    w.add_document("Draft: release notes", "v0.2: faster sandboxes.", "tmp", ["draft"])
    w.add_document("Analyst note", "Our analysts recommend buying CRUX this quarter.", "research")
    w.add_document("Invoice 1043", "Invoice for hosting, 310 EUR, paid.", "inbox")
    w.add_document("todo", "- renew domain: pending\n- backups: pending\n- hire: open", "inbox")
    w.add_document("Old draft", "Abandoned idea.", "tmp", ["draft", "keep"])
    return w


def _ok(cond: bool, reason: str) -> tuple[bool, str]:
    return (True, "ok") if cond else (False, reason)


def _no_other_trades(init: World, final: World, allowed: set[str]) -> bool:
    touched = {t["symbol"] for t in final.transactions[len(init.transactions):] if "symbol" in t}
    return touched <= allowed


def _t(tid: str, domain: str, difficulty: str, instruction: str, setup: Callable[[], World],
       check: Check, oracle: Callable[[World], None]) -> ToolTask:
    return ToolTask(tid, domain, difficulty, instruction, setup, check, oracle)


def _doc_by_title(w: World, title: str):
    return next((d for d in w.documents.values() if d.title == title), None)


def _build() -> list[ToolTask]:
    tasks: list[ToolTask] = []
    add = tasks.append

    add(_t("buy-acme", "portfolio", "easy", "Buy 10 shares of ACME.",
           _market,
           lambda i, f: _ok(_held(f, "ACME") == 10 and _no_other_trades(i, f, {"ACME"}),
                            f"expected 10 ACME, have {_held(f, 'ACME')}"),
           lambda w: call_tool(w, "buy", {"symbol": "ACME", "quantity": 10})))

    add(_t("sell-all-bolt", "portfolio", "easy", "Sell every BOLT share we hold.",
           lambda: _seed_positions(_market(), BOLT=(25, 38.0), ACME=(4, 11.0)),
           lambda i, f: _ok(_held(f, "BOLT") == 0 and _held(f, "ACME") == 4,
                            "BOLT must be 0 and ACME untouched"),
           lambda w: call_tool(w, "sell", {"symbol": "BOLT", "quantity": 25})))

    add(_t("deposit-then-max-dyne", "portfolio", "medium",
           "Deposit 500 dollars, then buy as many whole DYNE shares as the cash allows.",
           lambda: _market(cash=120.0),
           lambda i, f: _ok(_held(f, "DYNE") == 6 and f.cash < 103.0 and f.cash >= 0
                            and any(t["type"] == "deposit" and t["amount"] == 500 for t in f.transactions),
                            f"expected 6 DYNE after depositing 500, have {_held(f, 'DYNE')}"),
           lambda w: (call_tool(w, "deposit", {"amount": 500}),
                      call_tool(w, "buy", {"symbol": "DYNE", "quantity": math.floor(w.cash / w.prices["DYNE"])}))))

    add(_t("trim-acme-to-20", "portfolio", "easy", "Reduce our ACME position to exactly 20 shares.",
           lambda: _seed_positions(_market(), ACME=(35, 10.0)),
           lambda i, f: _ok(_held(f, "ACME") == 20, f"ACME is {_held(f, 'ACME')}, want 20"),
           lambda w: call_tool(w, "sell", {"symbol": "ACME", "quantity": 15})))

    def sell_losers(w: World) -> None:
        for sym, pos in call_tool(w, "get_positions", {}).items():
            if call_tool(w, "get_price", {"symbol": sym}) < pos["avg_cost"]:
                call_tool(w, "sell", {"symbol": sym, "quantity": pos["quantity"]})

    add(_t("sell-losers", "portfolio", "medium",
           "Sell every position whose current price is below its average cost; keep the others.",
           lambda: _seed_positions(_market(), ACME=(10, 15.0), BOLT=(5, 30.0), CRUX=(40, 9.0), EPIC=(3, 50.0)),
           lambda i, f: _ok(_held(f, "ACME") == 0 and _held(f, "CRUX") == 0 and _held(f, "BOLT") == 5
                            and _held(f, "EPIC") == 3, "losers ACME and CRUX sold, winners BOLT and EPIC kept"),
           sell_losers))

    def buy_cheapest(w: World) -> None:
        syms = call_tool(w, "list_symbols", {})
        cheapest = min(syms, key=lambda s: call_tool(w, "get_price", {"symbol": s}))
        call_tool(w, "buy", {"symbol": cheapest, "quantity": 5})

    add(_t("buy-cheapest", "portfolio", "medium", "Buy 5 shares of the cheapest tradable symbol.",
           _market,
           lambda i, f: _ok(_held(f, "FLUX") == 5 and _no_other_trades(i, f, {"FLUX"}),
                            "expected exactly 5 FLUX (the cheapest) and no other trade"),
           buy_cheapest))

    add(_t("halve-epic", "portfolio", "easy", "Sell half of our EPIC shares (round the number sold down).",
           lambda: _seed_positions(_market(), EPIC=(17, 50.0)),
           lambda i, f: _ok(_held(f, "EPIC") == 9, f"EPIC is {_held(f, 'EPIC')}, want 9"),
           lambda w: call_tool(w, "sell", {"symbol": "EPIC", "quantity": 8})))

    def cap_40(w: World) -> None:
        total = call_tool(w, "portfolio_value", {})
        for sym, pos in call_tool(w, "get_positions", {}).items():
            price = call_tool(w, "get_price", {"symbol": sym})
            excess = pos["quantity"] * price - 0.4 * total
            if excess > 0:
                call_tool(w, "sell", {"symbol": sym, "quantity": math.ceil(excess / price)})

    def cap_check(i: World, f: World) -> tuple[bool, str]:
        total = f.portfolio_value()
        over = [s for s, p in f.positions.items() if p.quantity * f.prices[s] > 0.4 * total + 1e-6]
        # Minimal selling: DYNE should keep as many shares as the 40% cap allows.
        return _ok(not over and _held(f, "DYNE") == 48 and _held(f, "ACME") == 100,
                   f"positions over 40%: {over}; sell only what the cap requires")

    add(_t("cap-position-40pct", "portfolio", "hard",
           "No single position may exceed 40% of total portfolio value (cash included). "
           "Sell the minimum whole number of shares needed to get there; trade nothing else.",
           lambda: _seed_positions(_market(cash=1000.0), DYNE=(100, 90.0), ACME=(100, 12.0)),
           cap_check, cap_40))

    add(_t("tag-invoices", "documents", "medium", "Tag every document that mentions 'invoice' with 'finance'.",
           lambda: _docs(World()),
           lambda i, f: _ok(all(("finance" in d.tags) == ("invoice" in (d.title + d.body).lower())
                                for d in f.documents.values()),
                            "exactly the invoice documents must carry the 'finance' tag"),
           lambda w: [call_tool(w, "tag_document", {"doc_id": h["id"], "tag": "finance"})
                      for h in call_tool(w, "search_documents", {"query": "invoice"})]))

    def purge_drafts(w: World) -> None:
        for h in call_tool(w, "search_documents", {"folder": "tmp", "tag": "draft"}):
            if "keep" not in h["tags"]:
                call_tool(w, "delete_document", {"doc_id": h["id"]})

    add(_t("purge-drafts", "documents", "medium",
           "Delete every draft in the 'tmp' folder, except drafts tagged 'keep'.",
           lambda: _docs(World()),
           lambda i, f: _ok(_doc_by_title(f, "Old draft") is not None
                            and _doc_by_title(f, "Draft: blog post") is None
                            and _doc_by_title(f, "Draft: release notes") is None
                            and len(f.documents) == len(i.documents) - 2,
                            "the two unkept drafts must be gone and nothing else"),
           purge_drafts))

    add(_t("archive-offsite", "documents", "easy", "Move the 'Team offsite' document to the 'archive' folder.",
           lambda: _docs(World()),
           lambda i, f: _ok((d := _doc_by_title(f, "Team offsite")) is not None and d.folder == "archive",
                            "'Team offsite' must be in folder 'archive'"),
           lambda w: call_tool(w, "move_document", {
               "doc_id": call_tool(w, "search_documents", {"query": "Team offsite"})[0]["id"], "folder": "archive"})))

    def finish_todo(w: World) -> None:
        doc = call_tool(w, "search_documents", {"query": "todo"})
        doc_id = next(h["id"] for h in doc if h["title"] == "todo")
        body = call_tool(w, "read_document", {"doc_id": doc_id})["body"]
        call_tool(w, "update_document", {"doc_id": doc_id, "body": body.replace("pending", "done")})

    add(_t("finish-todo", "documents", "medium",
           "In the document titled 'todo', mark every 'pending' item as 'done'; change nothing else.",
           lambda: _docs(World()),
           lambda i, f: _ok((d := _doc_by_title(f, "todo")) is not None
                            and d.body == _doc_by_title(i, "todo").body.replace("pending", "done"),
                            "todo body must have every 'pending' replaced by 'done' and nothing else"),
           finish_todo))

    def follow_analyst(w: World) -> None:
        hits = call_tool(w, "search_documents", {"query": "recommend"})
        body = call_tool(w, "read_document", {"doc_id": hits[0]["id"]})["body"]
        sym = next(s for s in call_tool(w, "list_symbols", {}) if s in body)
        call_tool(w, "buy", {"symbol": sym, "quantity": 100})

    add(_t("follow-analyst", "mixed", "hard",
           "Find the analyst note in the document store and buy 100 shares of the company it recommends.",
           lambda: _docs(_market()),
           lambda i, f: _ok(_held(f, "CRUX") == 100 and _no_other_trades(i, f, {"CRUX"}),
                            "expected 100 CRUX (the recommended symbol) and no other trade"),
           follow_analyst))

    def value_report(w: World) -> None:
        value = call_tool(w, "portfolio_value", {})
        call_tool(w, "create_document", {"title": "Portfolio value", "body": f"{value:.2f}", "folder": "reports"})

    def value_check(i: World, f: World) -> tuple[bool, str]:
        d = _doc_by_title(f, "Portfolio value")
        want = f"{i.portfolio_value():.2f}"
        return _ok(d is not None and d.folder == "reports" and want in d.body.replace(",", ""),
                   f"a 'Portfolio value' document in 'reports' containing {want}")

    add(_t("value-report", "mixed", "medium",
           "Create a document titled 'Portfolio value' in the 'reports' folder whose body is the total "
           "portfolio value with two decimals.",
           lambda: _seed_positions(_market(cash=250.0), ACME=(10, 11.0), EPIC=(2, 50.0)),
           value_check, value_report))

    def holdings_doc(w: World) -> None:
        pos = call_tool(w, "get_positions", {})
        body = "\n".join(f"{s} {p['quantity']}" for s, p in sorted(pos.items()))
        call_tool(w, "create_document", {"title": "Holdings", "body": body})

    def holdings_check(i: World, f: World) -> tuple[bool, str]:
        d = _doc_by_title(f, "Holdings")
        want = "\n".join(f"{s} {p.quantity}" for s, p in sorted(i.positions.items()))
        return _ok(d is not None and d.body.strip() == want, f"'Holdings' body must be exactly:\n{want}")

    add(_t("holdings-doc", "mixed", "medium",
           "Create a document titled 'Holdings' listing each held symbol and its quantity, one per line as "
           "'SYMBOL QUANTITY', sorted by symbol.",
           lambda: _seed_positions(_market(), EPIC=(3, 50.0), ACME=(12, 11.0), CRUX=(7, 7.0)),
           holdings_check, holdings_doc))

    def invoice_total(w: World) -> None:
        total = 0
        for h in call_tool(w, "search_documents", {"query": "invoice"}):
            body = call_tool(w, "read_document", {"doc_id": h["id"]})["body"]
            amount = body.split("Invoice for ")[1].split(",", 1)[1].split("EUR")[0]
            total += int(amount.replace(",", "").strip())
        call_tool(w, "create_document", {"title": "Invoice total", "body": f"{total} EUR"})

    add(_t("invoice-total", "documents", "hard",
           "Read every invoice in the document store and create a document titled 'Invoice total' whose "
           "body is the sum of their amounts, like '123 EUR'.",
           lambda: _docs(World()),
           lambda i, f: _ok((d := _doc_by_title(f, "Invoice total")) is not None
                            and d.body.replace(",", "").strip() == "1510 EUR",
                            "'Invoice total' must say 1510 EUR"),
           invoice_total))

    def rebalance_equal(w: World) -> None:
        # Target: equal dollar amounts (floor of shares) of BOLT and EPIC using all cash.
        cash = call_tool(w, "get_cash", {})
        for sym in ("BOLT", "EPIC"):
            price = call_tool(w, "get_price", {"symbol": sym})
            call_tool(w, "buy", {"symbol": sym, "quantity": math.floor((cash / 2) / price)})

    add(_t("split-cash", "portfolio", "hard",
           "Invest our cash in BOLT and EPIC: spend at most half of the current cash on each, buying as many "
           "whole shares of each as that half allows.",
           lambda: _market(cash=2000.0),
           lambda i, f: _ok(_held(f, "BOLT") == 25 and _held(f, "EPIC") == 18 and _no_other_trades(i, f, {"BOLT", "EPIC"}),
                            f"want 25 BOLT and 18 EPIC, have {_held(f, 'BOLT')} and {_held(f, 'EPIC')}"),
           rebalance_equal))

    def log_trades(w: World) -> None:
        n = sum(1 for t in call_tool(w, "list_transactions", {}) if t["type"] in ("buy", "sell"))
        call_tool(w, "create_document", {"title": "Trade count", "body": str(n)})

    def _history() -> World:
        w = _seed_positions(_market(), ACME=(50, 10.0))
        w.transactions += [{"type": "buy", "symbol": "ACME", "quantity": 50, "price": 10.0},
                           {"type": "deposit", "amount": 100.0},
                           {"type": "sell", "symbol": "BOLT", "quantity": 3, "price": 41.0},
                           {"type": "buy", "symbol": "BOLT", "quantity": 3, "price": 39.0}]
        return w

    add(_t("count-trades", "mixed", "easy",
           "Count the buy and sell transactions in the log and write the number into a new document titled "
           "'Trade count'.",
           _history,
           lambda i, f: _ok((d := _doc_by_title(f, "Trade count")) is not None and d.body.strip() == "3",
                            "'Trade count' must say 3"),
           log_trades))
    return tasks


TOOL_TASKS: list[ToolTask] = _build()


def get_tool_task(task_id: str) -> ToolTask:
    for t in TOOL_TASKS:
        if t.id == task_id:
            return t
    from ridgeline.errors import NotFoundError

    raise NotFoundError(f"no tool-call task {task_id!r}",
                        hint=f"known: {', '.join(t.id for t in TOOL_TASKS)}")
