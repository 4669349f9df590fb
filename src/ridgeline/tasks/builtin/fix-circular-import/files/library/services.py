"""Operations on the catalogue."""

from library.models import Book

CATALOGUE = [
    ("Dune", "Frank Herbert", 1965),
    ("Neuromancer", "William Gibson", 1984),
    ("Foundation", "Isaac Asimov", 1951),
    ("Hyperion", "Dan Simmons", 1989),
]


def format_book(book):
    return f"{book.title} by {book.author} ({book.year})"


def catalogue():
    """All books, oldest first."""
    return [Book(*row) for row in sorted(CATALOGUE, key=lambda row: row[2])]
