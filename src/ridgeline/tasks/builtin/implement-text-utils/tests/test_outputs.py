"""implement-text-utils: slugify, is_palindrome, word_count."""

import importlib.util

import pytest


def load():
    spec = importlib.util.spec_from_file_location("textutils", "/app/textutils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("text,slug", [
    ("  Hello, World! 2024 ", "hello-world-2024"),
    ("Already-a-slug", "already-a-slug"),
    ("--Multiple   spaces__and__underscores--", "multiple-spaces-and-underscores"),
    ("Ünïcode café", "n-code-caf"),
    ("", ""),
])
def test_slugify(text, slug):
    assert load().slugify(text) == slug


@pytest.mark.parametrize("text,expected", [
    ("A man, a plan, a canal: Panama", True),
    ("racecar", True),
    ("", True),
    ("No 'x' in Nixon", True),
    ("palindrome", False),
    ("12321", True),
    ("123", False),
])
def test_is_palindrome(text, expected):
    assert load().is_palindrome(text) is expected


def test_word_count():
    assert load().word_count("The cat and the hat.") == {"the": 2, "cat": 1, "and": 1,
                                                        "hat": 1}
    assert load().word_count("It's 4 o'clock; IT is.") == {"it": 2, "s": 1, "o": 1,
                                                           "clock": 1, "is": 1}
    assert load().word_count("") == {}
