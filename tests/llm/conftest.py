"""Fixtures for the model-client tests."""

from __future__ import annotations

import socket
from typing import Iterator

import pytest

from tests.helpers.fake_openai_server import FakeOpenAIServer


@pytest.fixture
def openai_server() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer()
    yield server
    server.close()


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 with nothing listening (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
