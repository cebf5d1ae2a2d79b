"""A server's sampling request as the local model reads it (`agents/sampling.py`): its messages, what
is refused, and which resident model a hint names. The answer itself, on the tiny real model, is in
tests/tools/test_mcp_requests.py."""

from __future__ import annotations

from typing import Any

import mcp_types as types
import pytest

from mlx_subagents.agents.sampling import choose_host, sampling_messages
from mlx_subagents.errors import McpRequestError
from tests.helpers import scripted_host


def request(*content: types.SamplingMessageContentBlock, hints: list[str] | None = None) -> Any:
    prefs = types.ModelPreferences(hints=[types.ModelHint(name=h) for h in hints]) if hints is not None else None
    messages = [types.SamplingMessage(role="user", content=list(content) if len(content) > 1 else content[0])]
    return types.CreateMessageRequestParams(
        messages=messages, max_tokens=10, system_prompt="Be brief.", model_preferences=prefs
    )


def text(value: str) -> types.TextContent:
    return types.TextContent(type="text", text=value)


def test_the_request_becomes_chat_messages_and_what_is_not_text_is_refused() -> None:
    assert sampling_messages(request(text("one"), text("two"))) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "one\ntwo"},
    ]
    image = types.ImageContent(type="image", data="AAAA", mime_type="image/png")
    with pytest.raises(McpRequestError) as info:
        sampling_messages(request(text("look"), image))
    assert str(info.value) == "sampling refused: the request holds image content; the model reads text"


def test_a_hint_picks_a_resident_model_by_a_part_of_its_name_else_the_agents_own() -> None:
    own, coder = scripted_host(["x"]), scripted_host(["y"])
    own.model_id, coder.model_id = "mlx-community/Qwen3-4B-Instruct-2507-4bit", "mlx-community/Qwen2.5-Coder-7B-4bit"
    assert choose_host(request(text("hi"), hints=["coder"]), own, [own, coder]) is coder
    assert choose_host(request(text("hi"), hints=["claude-3-sonnet", "QWEN3"]), own, [coder]) is own
    assert choose_host(request(text("hi"), hints=["gpt-4o"]), own, [coder]) is own  # nothing resident by that name
    assert choose_host(request(text("hi")), own, [coder]) is own
