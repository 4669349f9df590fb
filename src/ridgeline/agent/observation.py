"""Keeping what the model and the logs are shown short: the head and the tail of a long
output, with a marker that says how much was cut (errors are usually at the end, context
at the start), and one-line digests."""

from __future__ import annotations

MARKER = "\n[... {cut} bytes ({lines} lines) elided; showing the first and last parts ...]\n"


def truncate_middle(text: str, max_bytes: int) -> tuple[str, bool]:
    """`text` if it fits in `max_bytes` UTF-8 bytes, else its head and tail around a
    marker, the whole within `max_bytes` (for `max_bytes` >= 128). Returns (text, cut?)."""
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return text, False
    budget = max(0, max_bytes - 96)  # room for the marker
    head_n = budget * 2 // 5
    tail_n = budget - head_n
    head = data[:head_n].decode("utf-8", errors="ignore")
    tail = data[len(data) - tail_n:].decode("utf-8", errors="ignore") if tail_n else ""
    cut = data[len(head.encode()):len(data) - len(tail.encode())]
    marker = MARKER.format(cut=len(cut), lines=cut.count(b"\n"))
    return head + marker + tail, True


def one_line(text: str, limit: int) -> str:
    """`text` on one line (whitespace runs become one space), cut to `limit` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."
