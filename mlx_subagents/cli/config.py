"""`$MLX_SUBAGENTS_HOME/config.toml`: defaults for the shared flags, below the flags and the
environment variables.

    model = "mlx-community/Qwen2.5-Coder-1.5B-Instruct-4bit"   # the default model, below $MLX_SUBAGENTS_MODEL
    kv_budget = "4GB"
    kv_bits = 8               # or "8", like --kv-bits 8
    sandbox = "on"            # or true / false, like --sandbox on|off
    grammar = "on"
    engine = "http://gpu-box:8000/v1"
    prefix_cache = "2GB"
    prefill_slice = "auto"    # or "off", or a number of tokens, like --prefill-slice
    draft = "auto"            # or "off", or "lookup", like --draft

Each key is the flag of the same name (`kv_budget` is `--kv-budget`), its value read by that flag's
own reader; a flag given on the command line wins. `model` is the default model: an agent's own
`model:` and `$MLX_SUBAGENTS_MODEL` win over it, as over the built-in default. A key this version
does not know, or a value its flag refuses, is one error line naming the file, the line and the fix,
and nothing runs. `subagent doctor` shows what the file sets. A new key is one line of `KEYS`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, SubagentError
from ..home import state_home
from ..runs.tasks import MODEL_ENV
from ..userfiles import parse_text, read_text

CONFIG_FILE = "config.toml"


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{value!r} is not text; write it in quotes")
    return value.strip()


def _on_off(value: Any) -> str:
    """`on`/`off` as `--sandbox` and `--grammar` take them; TOML's true/false too."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in ("on", "off"):
        return str(value)
    raise ValueError(f'{value!r} is neither on nor off; write "on" or "off" (or true / false)')


def read_kv_budget(text: str | None) -> int | None:
    """`--kv-budget` in bytes (the host's `parse_bytes`), None when not set. The host is imported for a
    value only: a command that sets no host size (one attached to `subagent serve`) never loads it."""
    if text is None:
        return None
    from ..host import parse_bytes

    return parse_bytes(text)


def read_prefix_cache(text: str | None) -> int | None:
    """`--prefix-cache` in bytes, 0 for off (the host's `parse_prefix_cache`), None when not set."""
    if text is None:
        return None
    from ..host.kv.prefix_files import parse_prefix_cache

    return parse_prefix_cache(text)


def read_prefill_slice(value: str | int | None) -> int | str | None:
    """`--prefill-slice`: `auto`, `off` or tokens per slice (the host's `parse_prefill_slice`), None when not set."""
    if value is None:
        return None
    from ..host import parse_prefill_slice

    return parse_prefill_slice(value)


def read_draft(value: str | None) -> str | None:
    """`--draft`: `auto`, `off` or `lookup` (the host's `parse_draft`), None when not set."""
    if value is None:
        return None
    from ..host import parse_draft

    return parse_draft(value)


def _draft(value: Any) -> str:
    """`auto`, `off` or `lookup`, as `--draft` takes them."""
    if isinstance(value, str):
        try:
            return str(read_draft(value))
        except SubagentError:
            pass
    raise ValueError(f'{value!r} is not auto, off or lookup; write "auto", "off" or "lookup"')


def _size(reader: Callable[[Any], Any]) -> Callable[[Any], str]:
    """A size as its flag reads it (`4GB`, `512MiB`, a number of bytes), checked by that reader."""

    def read(value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f'{value!r} is not a size; write one in quotes, like "4GB"')
        try:
            reader(str(value))
        except SubagentError as exc:  # its flag's words: "KV budget 'lots' is not a size; use e.g. 4GB, ..."
            raise ValueError(f"{str(value)!r} is not a size; {str(exc).partition('; ')[2]}") from None
        return str(value)

    return read


def _prefill_slice(value: Any) -> str:
    """`auto`, `off` or a number of tokens, as `--prefill-slice` takes them (a TOML number too)."""
    if not isinstance(value, bool) and isinstance(value, (str, int)):
        try:
            read_prefill_slice(value)
            return str(value)
        except SubagentError:
            pass
    raise ValueError(f'{value!r} is not auto, off or a number of tokens; write "auto", "off" or e.g. 64')


def _kv_bits(value: Any) -> str:
    """A `--kv-bits` setting, as a number or as text (`8`, `"8"`)."""
    if isinstance(value, bool) or str(value) not in ("16", "8", "4"):
        raise ValueError(f"{value!r} is not a setting; write 16, 8 or 4")
    return str(value)


# Each key: the reader of its flag's value (the value comes out as the flag's text). A new key is a line.
KEYS: dict[str, Callable[[Any], str]] = {
    "model": _text,
    "kv_budget": _size(read_kv_budget),
    "kv_bits": _kv_bits,
    "sandbox": _on_off,
    "grammar": _on_off,
    "engine": _text,
    "prefix_cache": _size(read_prefix_cache),
    "prefill_slice": _prefill_slice,
    "draft": _draft,
}


@dataclass(frozen=True)
class Config:
    """What config.toml sets, each value as its flag's text; `path` is None when there is no file."""

    path: Path | None
    values: dict[str, str]

    def lines(self) -> list[str]:
        """For `subagent doctor`: the file, then each key it sets."""
        if self.path is None:
            return [f"config    none ({config_path()} sets defaults for the flags)"]
        if not self.values:
            return [f"config    {self.path}: sets nothing"]
        return [f"config    {self.path}: " + ", ".join(f"{k} = {v}" for k, v in self.values.items())]


def config_path(home: Path | None = None) -> Path:
    return (home or state_home()) / CONFIG_FILE


def _line_of(text: str, key: str) -> int:
    """The line that sets `key` (the first), for the error line; 1 when it cannot be told."""
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=", line):
            return number
    return 1


def load_config(home: Path | None = None) -> Config:
    """Read config.toml (no file: nothing set); a bad key or value raises one `ConfigError` line."""
    path = config_path(home)
    if not path.exists():
        return Config(None, {})
    text = read_text(path, "config file", ConfigError)
    data = parse_text(text, "toml", str(path), ConfigError)
    values = {}
    for key, value in data.items():
        where = f"{path}:{_line_of(text, key)}"
        if key not in KEYS:
            raise ConfigError(f"{where}: unknown key '{key}'; the keys are {', '.join(KEYS)}")
        try:
            values[key] = KEYS[key](value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {key}: {exc}") from None
    return Config(path, values)


def apply_model_default(config: Config) -> None:
    """config.toml's `model` as the default model of this process: `$MLX_SUBAGENTS_MODEL`, when set,
    wins; an agent's own `model:` and `--model` win over both, as over the built-in default."""
    if "model" in config.values:
        os.environ.setdefault(MODEL_ENV, config.values["model"])


def defaults_for(given: dict[str, Any], config: Config) -> dict[str, Any]:
    """The shared flags' values with config.toml's below them: a flag not given (None) takes the file's
    value (`model` is the default model instead: `apply_model_default`)."""
    return {
        key: config.values.get(key, value) if value is None and key != "model" else value
        for key, value in given.items()
    }
