"""The catalogue's data types."""

from library.services import format_book


class Book:
    def __init__(self, title, author, year):
        self.title = title
        self.author = author
        self.year = year

    def __str__(self):
        return format_book(self)
