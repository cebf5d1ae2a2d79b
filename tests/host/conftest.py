"""Fixtures of the host tests: tiny models whose KV caches quantize."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_subagents.testing import make_tiny_model


@pytest.fixture(scope="session")
def quantizable(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`quantizable(arch)`: a tiny model of `arch` with attention heads 64 wide, so that its KV cache
    quantizes in mlx-lm's groups of 64 (the default tiny models' heads, 16 wide, do not); built once."""
    built: dict[str, Path] = {}

    def path(arch: str) -> Path:
        if arch not in built:
            # seed 2: greedy outputs that vary between prompts, so a wrong cache shows
            built[arch] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}-h64"), arch, head_dim=64, seed=2)  # type: ignore[arg-type]
        return built[arch]

    return path
