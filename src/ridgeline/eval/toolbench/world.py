"""A small simulated business system that tool-calling agents act on: a portfolio ledger
(cash, positions, market prices, a transaction log) and a document store (documents with
folders and tags). Tasks are graded on the final state of this world, as in tau-bench.

Every tool is a plain Python method with a JSON schema; a tool that is misused raises
`ToolUseError`, whose message goes back to the model as the observation.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from ridgeline.llm.base import ToolSpec


class ToolUseError(Exception):
    """A recoverable tool misuse (unknown symbol, insufficient cash...): shown to the model."""


@dataclass
class Position:
    quantity: int
    avg_cost: float


@dataclass
class Document:
    id: str
    title: str
    body: str
    folder: str = "inbox"
    tags: list[str] = field(default_factory=list)


@dataclass
class World:
    cash: float = 0.0
    prices: dict[str, float] = field(default_factory=dict)
    positions: dict[str, Position] = field(default_factory=dict)
    transactions: list[dict[str, Any]] = field(default_factory=list)
    documents: dict[str, Document] = field(default_factory=dict)
    next_doc: int = 1

    def clone(self) -> "World":
        return copy.deepcopy(self)

    # -- portfolio -------------------------------------------------------------------
    def _price(self, symbol: str) -> float:
        sym = str(symbol).upper()
        if sym not in self.prices:
            raise ToolUseError(f"unknown symbol {symbol!r}; known: {', '.join(sorted(self.prices))}")
        return self.prices[sym]

    @staticmethod
    def _qty(quantity: Any) -> int:
        if isinstance(quantity, bool) or not isinstance(quantity, (int, float)) or int(quantity) != quantity:
            raise ToolUseError(f"quantity must be a whole number, got {quantity!r}")
        if quantity <= 0:
            raise ToolUseError(f"quantity must be positive, got {quantity!r}")
        return int(quantity)

    def get_cash(self) -> float:
        """Return the cash balance."""
        return round(self.cash, 2)

    def get_positions(self) -> dict[str, dict[str, float]]:
        """Return every held position: symbol -> {quantity, avg_cost}."""
        return {s: {"quantity": p.quantity, "avg_cost": round(p.avg_cost, 4)}
                for s, p in sorted(self.positions.items()) if p.quantity > 0}

    def get_price(self, symbol: str) -> float:
        """Return the current market price of one symbol."""
        return self._price(symbol)

    def list_symbols(self) -> list[str]:
        """Return every tradable symbol."""
        return sorted(self.prices)

    def portfolio_value(self) -> float:
        """Return cash plus the market value of all positions."""
        return round(self.cash + sum(p.quantity * self.prices[s] for s, p in self.positions.items()), 2)

    def buy(self, symbol: str, quantity: int) -> dict[str, Any]:
        """Buy `quantity` shares of `symbol` at the current price, paid from cash."""
        sym, qty = str(symbol).upper(), self._qty(quantity)
        price = self._price(sym)
        cost = price * qty
        if cost > self.cash + 1e-9:
            raise ToolUseError(f"insufficient cash: buying {qty} {sym} costs {cost:.2f}, cash is {self.cash:.2f}")
        pos = self.positions.get(sym, Position(0, 0.0))
        pos.avg_cost = (pos.avg_cost * pos.quantity + cost) / (pos.quantity + qty)
        pos.quantity += qty
        self.positions[sym] = pos
        self.cash -= cost
        self.transactions.append({"type": "buy", "symbol": sym, "quantity": qty, "price": price})
        return {"symbol": sym, "quantity": qty, "price": price, "cash": round(self.cash, 2)}

    def sell(self, symbol: str, quantity: int) -> dict[str, Any]:
        """Sell `quantity` shares of `symbol` at the current price."""
        sym, qty = str(symbol).upper(), self._qty(quantity)
        price = self._price(sym)
        held = self.positions.get(sym, Position(0, 0.0)).quantity
        if qty > held:
            raise ToolUseError(f"cannot sell {qty} {sym}: only {held} held")
        self.positions[sym].quantity -= qty
        if self.positions[sym].quantity == 0:
            del self.positions[sym]
        self.cash += price * qty
        self.transactions.append({"type": "sell", "symbol": sym, "quantity": qty, "price": price})
        return {"symbol": sym, "quantity": qty, "price": price, "cash": round(self.cash, 2)}

    def deposit(self, amount: float) -> float:
        """Add `amount` of cash; returns the new balance."""
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
            raise ToolUseError(f"amount must be a positive number, got {amount!r}")
        self.cash += float(amount)
        self.transactions.append({"type": "deposit", "amount": float(amount)})
        return round(self.cash, 2)

    def list_transactions(self) -> list[dict[str, Any]]:
        """Return the transaction log, oldest first."""
        return list(self.transactions)

    # -- documents -------------------------------------------------------------------
    def _doc(self, doc_id: str) -> Document:
        if doc_id not in self.documents:
            raise ToolUseError(f"no document with id {doc_id!r}; use search_documents to find ids")
        return self.documents[doc_id]

    def add_document(self, title: str, body: str, folder: str = "inbox",
                     tags: list[str] | None = None) -> Document:
        doc = Document(f"doc-{self.next_doc}", title, body, folder, list(tags or []))
        self.next_doc += 1
        self.documents[doc.id] = doc
        return doc

    def search_documents(self, query: str = "", folder: str | None = None,
                         tag: str | None = None) -> list[dict[str, Any]]:
        """Find documents whose title or body contains `query` (case-insensitive),
        optionally within one folder or with one tag."""
        q = str(query).lower()
        hits = []
        for d in self.documents.values():
            if q and q not in d.title.lower() and q not in d.body.lower():
                continue
            if folder is not None and d.folder != folder:
                continue
            if tag is not None and tag not in d.tags:
                continue
            hits.append({"id": d.id, "title": d.title, "folder": d.folder, "tags": list(d.tags)})
        return hits

    def read_document(self, doc_id: str) -> dict[str, Any]:
        """Return one document with its body."""
        d = self._doc(doc_id)
        return {"id": d.id, "title": d.title, "body": d.body, "folder": d.folder, "tags": list(d.tags)}

    def create_document(self, title: str, body: str, folder: str = "inbox") -> str:
        """Create a document; returns its id."""
        if not str(title).strip():
            raise ToolUseError("title must not be empty")
        return self.add_document(str(title), str(body), str(folder)).id

    def update_document(self, doc_id: str, body: str) -> str:
        """Replace the body of a document."""
        self._doc(doc_id).body = str(body)
        return doc_id

    def tag_document(self, doc_id: str, tag: str) -> list[str]:
        """Add a tag to a document (idempotent); returns its tags."""
        d = self._doc(doc_id)
        if tag not in d.tags:
            d.tags.append(str(tag))
        return list(d.tags)

    def move_document(self, doc_id: str, folder: str) -> str:
        """Move a document to another folder."""
        self._doc(doc_id).folder = str(folder)
        return folder

    def delete_document(self, doc_id: str) -> str:
        """Delete a document for good."""
        self._doc(doc_id)
        del self.documents[doc_id]
        return doc_id


#: The tools offered to the model, in this order.
TOOL_NAMES = [
    "get_cash", "get_positions", "get_price", "list_symbols", "portfolio_value", "buy", "sell",
    "deposit", "list_transactions", "search_documents", "read_document", "create_document",
    "update_document", "tag_document", "move_document", "delete_document",
]

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", dict: "object"}


def _schema_for(fn: Callable[..., Any]) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required = []
    for name, p in inspect.signature(fn).parameters.items():
        if name == "self":
            continue
        ann = p.annotation if isinstance(p.annotation, type) else None
        if ann is None:  # string annotations under `from __future__ import annotations`
            text = str(p.annotation)
            ann = next((t for t in _JSON_TYPES if text.startswith(t.__name__)), str)
        props[name] = {"type": _JSON_TYPES.get(ann, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(name)
    return {"type": "object", "properties": props, "required": required}


def tool_specs() -> list[ToolSpec]:
    """JSON-schema specs of every world tool, built from the methods' signatures."""
    specs = []
    for name in TOOL_NAMES:
        fn = getattr(World, name)
        specs.append(ToolSpec(name=name, description=" ".join((fn.__doc__ or name).split()),
                              parameters=_schema_for(fn)))
    return specs


def call_tool(world: World, name: str, arguments: dict[str, Any]) -> Any:
    """Run one tool call against the world; misuse raises `ToolUseError`."""
    if name not in TOOL_NAMES:
        raise ToolUseError(f"unknown tool {name!r}; available: {', '.join(TOOL_NAMES)}")
    fn = getattr(world, name)
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        raise ToolUseError(f"bad arguments for {name}: {e}") from None
    return fn(**arguments)
