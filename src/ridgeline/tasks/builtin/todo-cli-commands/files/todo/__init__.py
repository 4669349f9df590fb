"""A command-line to-do list: python3 -m todo ..."""
