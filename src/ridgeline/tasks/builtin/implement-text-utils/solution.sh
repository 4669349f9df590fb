#!/bin/bash
cat > /app/textutils.py <<'PY'
"""Text helpers."""

import re
from collections import Counter


def slugify(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def is_palindrome(text):
    chars = [c for c in text.lower() if c.isascii() and c.isalnum()]
    return chars == chars[::-1]


def word_count(text):
    return dict(Counter(re.findall(r"[a-z]+", text.lower())))
PY
