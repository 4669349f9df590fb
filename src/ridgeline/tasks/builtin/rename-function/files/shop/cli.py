"""Demo: python3 -m shop.cli"""

from shop import pricing
from shop.cart import Cart
from shop.checkout import checkout


def main():
    cart = Cart()
    cart.add("book", 12.5, 2)
    cart.add("pen", 1.25, 4)
    print(checkout(cart))
    print(checkout(cart, tax_free=True))
    print("quote:", pricing.calc_total([(100, 1)]))


if __name__ == "__main__":
    main()
