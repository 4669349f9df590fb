from library.services import catalogue

for book in catalogue():
    print(book)
