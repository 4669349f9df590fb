"""The built-in families, one module per skill; importing this registers them all."""

from ridgeline.tasks.families.catalog import text  # noqa: F401
