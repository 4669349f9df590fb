"""A small library catalogue."""
