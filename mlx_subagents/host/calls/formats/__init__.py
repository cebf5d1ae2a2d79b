"""Call formats, one module each, found by name: how a model writes a tool call, and its grammar.

Each module here (`hermes.py`, `qwen3_coder.py`, `mistral.py`) holds one `FORMAT`: its markers, the
module of mlx-lm's `tool_parsers` that reads it, how one call is written in it, and the Lark rules that
hold a call to it (`grammar.py` compiles them). A new format is one new module with a `FORMAT`: it is
found here by its module, as mlx-lm finds its parsers; nothing else lists the formats.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from ...protocol import ToolSchema
from ..toolcalls import EXAMPLE_CALL, CallFormat, Parser


@dataclass(frozen=True)
class Markers:
    """A call format's markers as lark terms in one vocabulary (a special token by its id, other text quoted).

    Args:
        term: any other marker text as a lark term (Mistral's `[ARGS]`).
    """

    start: str
    end: str  # "" where a call runs to the end of the reply (Mistral)
    term: Callable[[str], str]


BodyRules = Callable[[Markers, list[ToolSchema], frozenset[str]], str]


@dataclass(frozen=True)
class CallSyntax:
    """One call format: its name, its markers, mlx-lm's parser of it, how a call is written, its grammar.

    Args:
        name: what the grammar and `subagent doctor` call it (`json`, `xml`, `mistral`).
        parser: the module of mlx-lm's `tool_parsers` that reads it; a model whose tokenizer has that
            parser writes this format (`kind_of`).
        start, end: the markers around a call, as mlx-lm's module has them (`end` is empty where a
            call runs to the end of the reply).
        write: one call written in this format, `write(name, arguments)`.
        body_rules: the Lark rules for `body`, what follows the start marker up to and with the end
            marker, for these tools (any object as arguments for the tools named in `loose`).
    """

    name: str
    parser: str
    start: str
    end: str
    write: Callable[[str, Mapping[str, Any]], str]
    body_rules: BodyRules

    @property
    def example(self) -> str:
        """`EXAMPLE_CALL` written in this format, for the fix in an error."""
        return self.write(EXAMPLE_CALL["name"], EXAMPLE_CALL["arguments"])  # type: ignore[arg-type]

    def parse_tool_call(self) -> Parser:
        """mlx-lm's parser of this format (imported when first asked for: importing the host stays quick)."""
        return importlib.import_module(f"mlx_lm.tool_parsers.{self.parser}").parse_tool_call

    def call_format(self) -> CallFormat:
        """This format as the host reads replies in it: its markers, mlx-lm's parser, its example."""
        return CallFormat(self.start, self.end, self.parse_tool_call(), self.example)


@cache
def call_syntaxes() -> dict[str, CallSyntax]:
    """Every call format with a module in this package, by name (each module's `FORMAT`)."""
    found = (importlib.import_module(f"{__name__}.{module.name}").FORMAT for module in pkgutil.iter_modules(__path__))
    return {syntax.name: syntax for syntax in found}


def call_syntax(name: str) -> CallSyntax:
    """The call format of this name; an unknown name raises, listing the formats there are."""
    syntaxes = call_syntaxes()
    if name not in syntaxes:
        raise ValueError(f"unknown call format {name!r}; the formats: {', '.join(sorted(syntaxes))}")
    return syntaxes[name]


def kind_of(parser: Any) -> str | None:
    """The name of the call format an mlx-lm tool parser reads (by the parser's module), or None for a
    format without a module here, whose calls and answers stay free."""
    module = getattr(parser, "__module__", "").rsplit(".", 1)[-1]
    return next((syntax.name for syntax in call_syntaxes().values() if syntax.parser == module), None)
