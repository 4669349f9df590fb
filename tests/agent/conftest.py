"""A real sandbox for agent tests (the `local` backend: fast, no isolation needed here)."""

from __future__ import annotations

import warnings
from typing import Iterator

import pytest

from ridgeline.sandbox import Sandbox, SandboxSpec, create_sandbox


@pytest.fixture
def sandbox() -> Iterator[Sandbox]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "local provides no isolation"
        sb = create_sandbox(SandboxSpec(), backend="local")
    yield sb
    sb.close()
