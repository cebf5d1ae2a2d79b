"""A chat request's schemas are checked once per distinct schema, in bounded memory, in process."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from mlx_subagents.errors import SubagentError
from mlx_subagents.serve.chat_turn import checked_schema


def test_a_checked_schema_is_remembered_by_a_digest_and_a_refused_one_names_its_place_each_time() -> None:
    """A client sends its tools with every request: a schema that passed is not checked again, and what is
    remembered of it is a digest, not its text (a remembered text of 1 MiB per schema, for a thousand
    schemas, held a gigabyte). A schema refused is refused again naming the field of each request."""
    checked_schema({"type": "object"}, "tools[0]")  # jsonschema's first use builds what it keeps
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(4):
            checked_schema({"type": "object", "description": str(i) * 2**20}, "tools[0]")
        gc.collect()  # what a check leaves in reference cycles is not kept
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert retained < 64 * 1024
    bad = {"type": "object", "properties": {"a": {"type": "nope"}}}
    for where in ("tools[0].function", "tools[3].function"):
        with pytest.raises(
            SubagentError, match=rf"^{where.replace('[', '.').replace(']', '.')}: not a valid JSON schema"
        ):
            checked_schema(bad, where)
