"""Fixtures for the sandbox tests: real bubblewrap sandboxes, no mocks."""

from __future__ import annotations

import pytest

from ridgeline.sandbox import SandboxSpec, create_sandbox


@pytest.fixture
def sandbox():
    with create_sandbox(SandboxSpec()) as sb:
        yield sb


@pytest.fixture
def make_sandbox():
    made = []

    def make(**spec):
        sb = create_sandbox(SandboxSpec(**spec))
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()
