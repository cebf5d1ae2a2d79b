"""The preloaded process the demo MCP servers and `subagent` commands of the tests here are forked from
(tests/preloaded.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.tools import test_mcp_tools


@pytest.fixture
def preloaded_demo(preloaded_python: list[str]) -> Iterator[None]:
    """For a test (`usefixtures`): the demo servers its definitions start and its `subagent` commands are forks
    of the worker's preloaded process (their streams the client's pipes, as before)."""
    test_mcp_tools.PYTHON = preloaded_python
    try:
        yield
    finally:
        test_mcp_tools.PYTHON = [sys.executable]
