"""tinyfmt 2.x: plain-text tables and money. `format_table` was removed in 2.0."""

__version__ = "2.0.0"


def table(rows, header=None, sep=" | "):
    """Rows as text; with `header`, a header line and a rule of dashes come first."""
    cells = [[str(c) for c in row] for row in rows]
    if header is not None:
        cells.insert(0, [str(h) for h in header])
    if not cells:
        return ""
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = [sep.join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    if header is not None:
        lines.insert(1, "-" * len(sep.join("-" * w for w in widths)))
    return "\n".join(lines)


def money(value):
    """1234.5 -> '1,234.50'."""
    return f"{value:,.2f}"
