#!/bin/bash
cat > /app/flatten.py <<'PY'
"""Flattening nested data."""


def flatten(items):
    """Flatten nested lists and tuples (iteratively, so depth is unlimited)."""
    out = []
    stack = [iter(items)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, (list, tuple)):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out
PY
