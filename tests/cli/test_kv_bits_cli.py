"""`--kv-bits` from the command line: `doctor` says what each setting costs and holds, `--json` usage
says which setting a run used, config.toml's `kv_bits` sets it below the flag, and a setting there is
not is one clear error."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.cli.config import config_path, defaults_for, load_config
from mlx_subagents.cli.flags import SHARED_FLAGS, KvBits, Shared
from mlx_subagents.errors import ConfigError, RequestError
from mlx_subagents.runs.options import RunOptions


@pytest.mark.slow
def test_doctor_prints_bytes_per_token_and_the_sessions_that_fit_at_each_setting(
    quantizable: Callable[[str], Path], run_cli: Any
) -> None:
    code, out, err = run_cli("doctor", "--model", str(quantizable("qwen3")), "--kv-bits", "8", "--kv-budget", "64MiB")

    assert code == 0, out + err
    kv = [line for line in out.splitlines() if line.startswith("kv ")]
    assert kv[0].startswith("kv cache  576 bytes/token (+0 fixed) per session at 8 bits; budget 0.1 GiB for 5 sessions")
    # One session of the whole window (4,096 tokens and a 256-token step of slack) at 2,048 / 576 / 320 bytes a token
    assert kv[1:] == [
        "kv bits   16: 2048 bytes/token (unquantized float32, the model's), 7 sessions of 4096 tokens fit the budget",
        "kv bits    8: 576 bytes/token, 26 sessions of 4096 tokens fit the budget (this host)",
        "kv bits    4: 320 bytes/token, 48 sessions of 4096 tokens fit the budget",
    ]


@pytest.mark.slow
def test_doctor_says_why_a_model_cannot_take_a_quantized_cache(
    tiny_qwen3_path: Path, run_cli: Any, caplog: Any
) -> None:
    code, out, err = run_cli("doctor", "--model", str(tiny_qwen3_path), "--kv-bits", "4", "--kv-budget", "0")

    assert code == 0, out + err
    assert [line for line in out.splitlines() if line.startswith("kv bits")] == [
        "kv bits   16: 512 bytes/token (unquantized float32, the model's), unbounded budget (this host)",
        "kv bits    8: unavailable: its attention heads are 16 wide and mlx quantizes in groups of 32 or 64",
        "kv bits    4: unavailable: its attention heads are 16 wide and mlx quantizes in groups of 32 or 64",
    ]
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"--kv-bits 4: {tiny_qwen3_path}: its attention heads are 16 wide and mlx quantizes in groups of 32 or 64; "
        "its KV cache stays at 16 bits"
    ]


@pytest.mark.slow
def test_the_json_usage_says_which_setting_the_run_used(
    quantizable: Callable[[str], Path], tiny_qwen3_path: Path, run_cli: Any, tmp_path: Path
) -> None:
    def usage(model: Path, *bits: str) -> dict[str, Any]:
        args = ("run", "scout", "where is the config?", "--model", str(model), "--cwd", str(tmp_path), "--json")
        code, out, err = run_cli(*args, *bits, "--max-turns", "1", "--max-tokens", "8")
        assert code in (0, 1), err  # a random model may end its one turn without an answer
        return json.loads(out)["usage"]

    assert usage(quantizable("qwen3"), "--kv-bits", "8")["kv_bits"] == 8
    assert usage(tiny_qwen3_path, "--kv-bits", "8")["kv_bits"] == 16  # heads it cannot quantize: it ran at 16
    config_path().parent.mkdir(parents=True, exist_ok=True)
    config_path().write_text("kv_bits = 4\n", encoding="utf-8")
    assert usage(quantizable("qwen3"))["kv_bits"] == 4  # config.toml's setting, with no flag


def test_config_toml_sets_kv_bits_below_the_flag() -> None:
    """`kv_bits = 8` in config.toml is the setting when no `--kv-bits` is given; the flag wins."""
    defaults = {name: default for name, (_alias, default) in SHARED_FLAGS.items()}
    config_path().parent.mkdir(parents=True, exist_ok=True)
    unset = Shared(**defaults_for(defaults, load_config())).options()
    assert (unset.kv_bits, unset.host_settings().kv_bits) == (None, 16)  # no file: the host's default, 16
    config_path().write_text('kv_bits = 8\nkv_budget = "1GB"\n', encoding="utf-8")
    assert Shared(**defaults_for(defaults, load_config())).options().kv_bits == 8
    given = {**defaults, "kv_bits": KvBits.b16}
    assert Shared(**defaults_for(given, load_config())).options().kv_bits == 16
    config_path().write_text('kv_bits = "4"\n', encoding="utf-8")
    assert Shared(**defaults_for(defaults, load_config())).options().kv_bits == 4
    config_path().write_text("kv_bits = 6\n", encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        load_config()
    assert str(refused.value) == f"{config_path()}:1: kv_bits: 6 is not a setting; write 16, 8 or 4"


def test_a_setting_there_is_not_is_one_clear_error(run_cli: Any) -> None:
    code, out, err = run_cli("run", "scout", "x", "--model", "scripted:none.json", "--kv-bits", "3")
    assert (code, out) == (2, "")
    assert err.splitlines()[-1] == "Error: Invalid value for '--kv-bits': '3' is not one of '16', '8', '4'."
    with pytest.raises(RequestError) as refused:
        RunOptions(kv_bits=5)
    assert str(refused.value) == "kv_bits must be 16, 8 or 4, got 5; 16 keeps the KV cache unquantized"
