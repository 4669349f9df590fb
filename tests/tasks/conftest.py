"""Fixture task directories are data, not tests of this project."""

collect_ignore_glob = ["fixtures/*"]
