"""The built-in families, one module per skill; importing this registers them all."""

from ridgeline.tasks.families.catalog import (  # noqa: F401
    archives,
    building_blocks,
    data,
    files,
    git,
    permissions,
    python_code,
    sorting,
    text,
    text_more,
)
