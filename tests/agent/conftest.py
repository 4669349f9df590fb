"""A real sandbox for agent tests (the `local` backend: fast, no isolation needed here)."""

from __future__ import annotations

import warnings
from typing import Iterator

import pytest

from ridgeline.sandbox import Sandbox, SandboxSpec, create_sandbox


def _local_sandbox() -> Sandbox:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "local provides no isolation"
        return create_sandbox(SandboxSpec(), backend="local")


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    sb = _local_sandbox()
    yield sb
    sb.close()


@pytest.fixture(scope="module")
def module_sandbox() -> Iterator[Sandbox]:
    """One sandbox for a module-scoped episode that several tests inspect."""
    sb = _local_sandbox()
    yield sb
    sb.close()
