"""An MCP elicitation form: a server's requested schema read into fields, a person's answers read and
checked, the schema's defaults applied (SEP-1034).

The protocol allows only flat forms of primitives: text (with `format`, `minLength`, `maxLength`),
numbers and integers (`minimum`, `maximum`), yes/no, one choice of several (`enum`, or `oneOf` with
`const` and `title`, or the older `enumNames`) and several choices (`type: array` whose `items` hold
the choices). A front end asks field by field (`Field.prompt`), reads each line with `Field.read`,
and sends `content`: what was answered, each field left blank taking its default, so a server gets
the values it offered as defaults even when the person only pressed Enter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Value = str | int | float | bool | list[str] | None
YES = ("y", "yes", "true", "1", "on")
NO = ("n", "no", "false", "0", "off")


class AnswerError(ValueError):
    """An answer that does not fit its field; the message says what would."""


@dataclass(frozen=True)
class Field:
    """One field of a form: its name, what the person reads, its kind and its rules."""

    name: str
    title: str
    description: str
    kind: str  # string, number, integer, boolean, choice, choices
    required: bool
    default: Value = None
    choices: tuple[tuple[str, str], ...] = ()  # (value, title) for choice and choices
    minimum: float | None = None
    maximum: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    format: str = ""

    def prompt(self) -> str:
        """`age (User age; a whole number, 0 to 150) [30]: `: the line a person answers."""
        hints = [self.description] if self.description else []
        if self.kind == "integer":
            hints.append("a whole number" + self._range())
        elif self.kind == "number":
            hints.append("a number" + self._range())
        elif self.kind == "boolean":
            hints.append("yes or no")
        elif self.kind in ("choice", "choices"):
            listed = ", ".join(v if t == v else f"{v} ({t})" for v, t in self.choices)
            hints.append(("one of: " if self.kind == "choice" else "any of, comma-separated: ") + listed)
        elif self.format:
            hints.append(self.format)
        if self.required:
            hints.append("required")
        shown = self.title if self.title != self.name else self.name
        default = f" [{show(self.default)}]" if self.default is not None else ""
        return f"{shown}" + (f" ({'; '.join(hints)})" if hints else "") + f"{default}: "

    def _range(self) -> str:
        if self.minimum is not None and self.maximum is not None:
            return f", {show(self.minimum)} to {show(self.maximum)}"
        if self.minimum is not None:
            return f", at least {show(self.minimum)}"
        if self.maximum is not None:
            return f", at most {show(self.maximum)}"
        return ""

    def read(self, text: str) -> Value:
        """The value of an answer line: blank takes the default (None: left out); else checked."""
        text = text.strip()
        if not text:
            if self.default is None and self.required:
                raise AnswerError(f"{self.name} is required")
            return self.default
        if self.kind == "boolean":
            if text.lower() in YES:
                return True
            if text.lower() in NO:
                return False
            raise AnswerError("answer yes or no")
        if self.kind in ("integer", "number"):
            return self._number(text)
        if self.kind == "choice":
            return self._choice(text)
        if self.kind == "choices":
            return [self._choice(part) for part in text.split(",") if part.strip()]
        if self.min_length is not None and len(text) < self.min_length:
            raise AnswerError(f"at least {self.min_length} characters")
        if self.max_length is not None and len(text) > self.max_length:
            raise AnswerError(f"at most {self.max_length} characters")
        return text

    def _number(self, text: str) -> int | float:
        try:
            value: int | float = int(text) if self.kind == "integer" else float(text)
        except ValueError:
            raise AnswerError("a whole number" if self.kind == "integer" else "a number") from None
        if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
            raise AnswerError("out of range" + self._range())
        return value

    def _choice(self, text: str) -> str:
        wanted = text.strip().lower()
        for value, title in self.choices:
            if wanted in (value.lower(), title.lower()):
                return value
        raise AnswerError(f"one of {', '.join(v for v, _ in self.choices)}")


def show(value: Value | float) -> str:
    """A value as a person reads it: yes/no, a list with commas."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(value)
    return str(value)


def form_fields(schema: dict[str, Any]) -> list[Field]:
    """The fields of a requested schema, in its order; a property of a kind the protocol does not
    allow is read as text."""
    required = set(schema.get("required") or [])
    return [_field(str(name), prop or {}, name in required) for name, prop in (schema.get("properties") or {}).items()]


def _field(name: str, prop: dict[str, Any], required: bool) -> Field:
    kind = str(prop.get("type") or "string")
    choices: tuple[tuple[str, str], ...] = ()
    items = prop.get("items") or {}
    if kind == "array":
        kind, choices = "choices", _choices(items)
    elif prop.get("enum") or prop.get("oneOf"):
        kind, choices = "choice", _choices(prop)
    elif kind not in ("string", "number", "integer", "boolean"):
        kind = "string"
    return Field(
        name=name,
        title=str(prop.get("title") or name),
        description=str(prop.get("description") or ""),
        kind=kind,
        required=required,
        default=prop.get("default"),
        choices=choices,
        minimum=prop.get("minimum"),
        maximum=prop.get("maximum"),
        min_length=prop.get("minLength"),
        max_length=prop.get("maxLength"),
        format=str(prop.get("format") or ""),
    )


def _choices(prop: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """`oneOf`/`anyOf` of `{const, title}`, or `enum` with the older `enumNames` for titles."""
    listed = prop.get("oneOf") or prop.get("anyOf")
    if listed:
        return tuple((str(c.get("const")), str(c.get("title") or c.get("const"))) for c in listed)
    values = [str(v) for v in prop.get("enum") or []]
    names = [str(n) for n in prop.get("enumNames") or values]
    return tuple(zip(values, names + values[len(names) :]))


def defaults(schema: dict[str, Any]) -> dict[str, Value]:
    """Every field's default (SEP-1034): what a form sent with nothing typed holds."""
    return {f.name: f.default for f in form_fields(schema) if f.default is not None}


__all__ = ["AnswerError", "Field", "defaults", "form_fields", "show"]
