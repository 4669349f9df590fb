"""Built-in task families (generators of verifiable terminal tasks): see base.py."""

from ridgeline.tasks.families.base import (
    FAMILIES,
    SKILLS,
    SPLITS,
    Generated,
    Instance,
    TaskFamily,
    families,
    family,
    generate,
    get_family,
    materialize,
)

__all__ = ["FAMILIES", "SKILLS", "SPLITS", "Generated", "Instance", "TaskFamily", "families",
           "family", "generate", "get_family", "materialize"]
