"""An elicitation form's fields (`tools/elicitation.py`): what each asks, how an answer is read and
checked, and the defaults a form sent untouched holds (SEP-1034)."""

from __future__ import annotations

import pytest

from mlx_subagents.tools.elicitation import AnswerError, defaults, form_fields

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "User name", "default": "John Doe", "maxLength": 20},
        "age": {"type": "integer", "default": 30, "minimum": 0, "maximum": 150},
        "score": {"type": "number", "default": 95.5},
        "status": {"type": "string", "enum": ["active", "inactive"], "enumNames": ["Active", "Gone"]},
        "tier": {"type": "string", "oneOf": [{"const": "s", "title": "Small"}, {"const": "l", "title": "Large"}]},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "verified": {"type": "boolean", "default": True},
        "email": {"type": "string", "format": "email"},
    },
    "required": ["email"],
}


def test_each_field_says_what_it_takes_and_its_default() -> None:
    assert [f.prompt() for f in form_fields(SCHEMA)] == [
        "name (User name) [John Doe]: ",
        "age (a whole number, 0 to 150) [30]: ",
        "score (a number) [95.5]: ",
        "status (one of: active (Active), inactive (Gone)): ",
        "tier (one of: s (Small), l (Large)): ",
        "tags (any of, comma-separated: a, b, c): ",
        "verified (yes or no) [yes]: ",
        "email (email; required): ",
    ]
    assert defaults(SCHEMA) == {"name": "John Doe", "age": 30, "score": 95.5, "verified": True}


def test_answers_are_read_and_checked_and_blank_keeps_the_default() -> None:
    name, age, score, status, tier, tags, verified, email = form_fields(SCHEMA)
    assert (name.read(""), name.read(" Ada "), age.read("41"), score.read("1e2")) == ("John Doe", "Ada", 41, 100.0)
    assert (status.read("Gone"), tier.read("large"), tags.read("a, c"), verified.read("no")) == (
        "inactive",
        "l",
        ["a", "c"],
        False,
    )
    assert status.read("") is None  # no default, not required: left out
    for field, answer, problem in [
        (age, "200", "out of range, 0 to 150"),
        (age, "4.5", "a whole number"),
        (score, "lots", "a number"),
        (status, "maybe", "one of active, inactive"),
        (verified, "perhaps", "answer yes or no"),
        (name, "x" * 21, "at most 20 characters"),
        (email, "", "email is required"),
    ]:
        with pytest.raises(AnswerError) as info:
            field.read(answer)
        assert str(info.value) == problem
