"""What a user hands over - sizes, the state folder, schema, script, tasks and workflow files - and the one
line each bad one gets from the CLI (exit 2, nothing run, no traceback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import SubagentError
from mlx_subagents.host import parse_bytes
from mlx_subagents.host.mlx_host import total_memory

SIZE_FIX = "is not a size; use e.g. 4GB, 512MiB, 0 (unbounded) or 0.25 (of RAM)"


@pytest.mark.parametrize(
    ("text", "n_bytes"),
    [
        ("4GB", 4 * 10**9),
        ("4 gb", 4 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("512m", 512 * 2**20),  # a bare letter is binary, as in `docker -m 512m`
        ("2k", 2048),
        ("1e9", 10**9),
        ("0", 0),
        (None, None),
        (1234, 1234),
    ],
)
def test_sizes_in_the_documented_forms(text: str | int | None, n_bytes: int | None) -> None:
    assert parse_bytes(text) == n_bytes


def test_a_fraction_is_a_share_of_ram() -> None:
    assert parse_bytes("0.25") == int(0.25 * total_memory())


@pytest.mark.parametrize("text", ["abc", "4XB", "-1GB", "-5", "inf", "nan", ""])
def test_a_bad_size_is_one_line(text: str) -> None:
    with pytest.raises(SubagentError) as info:
        parse_bytes(text)
    assert str(info.value) == f"KV budget {text!r} {SIZE_FIX}"


def test_a_bad_kv_budget_through_the_cli(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(["done"])
    code, out, err = run_cli("run", "scout", "hi", "-m", model, "-C", str(tmp_path), "--kv-budget", "4XB")
    assert (code, out, err) == (2, "", f"error: KV budget '4XB' {SIZE_FIX}\n")
