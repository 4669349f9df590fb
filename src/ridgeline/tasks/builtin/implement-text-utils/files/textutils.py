"""Text helpers. Implement the three functions below as documented."""


def slugify(text):
    """A URL slug: lower case; every run of characters other than a-z and 0-9 becomes a
    single '-'; no '-' at either end.  slugify("  Hello, World! 2024 ") == "hello-world-2024"
    """
    raise NotImplementedError


def is_palindrome(text):
    """True if the letters and digits of `text`, lower-cased, read the same backwards.
    is_palindrome("A man, a plan, a canal: Panama") is True; "" is a palindrome."""
    raise NotImplementedError


def word_count(text):
    """A dict from each lower-cased word (a maximal run of letters a-z) to its count.
    word_count("The cat and the hat.") == {"the": 2, "cat": 1, "and": 1, "hat": 1}"""
    raise NotImplementedError
