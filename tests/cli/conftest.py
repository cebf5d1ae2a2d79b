"""The preloaded process the tests' `cli` forks each `subagent` command from (tests/preloaded.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.cli import test_cli_run
from tests.preloaded import preloaded


@pytest.fixture(scope="session")
def cli_python() -> Iterator[list[str]]:
    """A process that imported what `subagent run` imports, with `cli`'s environment, for the worker."""
    with preloaded(test_cli_run.CLI_PRELOAD, env=test_cli_run.cli_env()) as python:
        yield python


@pytest.fixture
def preloaded_cli(cli_python: list[str]) -> Iterator[None]:
    """For a test (`usefixtures`): each command `cli` runs is a fork of `cli_python` (its streams the pipes
    `cli` reads, its environment and folder `cli`'s, its exit code the command's)."""
    test_cli_run.CLI_PYTHON = cli_python
    try:
        yield
    finally:
        test_cli_run.CLI_PYTHON = [sys.executable]
