"""The preloaded process the tests' editor starts `subagent acp` from (tests/preloaded.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.acp import helpers
from tests.preloaded import preloaded


@pytest.fixture(scope="module")
def preloaded_agent() -> Iterator[list[str]]:
    """A process that imported what `subagent acp` needs, with the agent's environment, for a test file
    (`usefixtures`): each agent the editor starts is a fork of it (its stdin and stdout the editor's
    pipes, as before)."""
    with preloaded(helpers.PRELOAD, env=helpers.agent_env()) as python:
        helpers.AGENT_PYTHON = python
        try:
            yield python
        finally:
            helpers.AGENT_PYTHON = [sys.executable]
