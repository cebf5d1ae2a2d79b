"""A reply's tool calls, run for one session: in order (a run of calls to a tool that may run
alongside itself, `subagent`, at once), each between its hooks; a denied or unknown tool, a call
repeated too often and a malformed call each become an error result the model reads.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..events import EventData, EventKind, ToolCallData, ToolResultData
from ..host.protocol import MalformedToolCall, Message, Reply, ToolCall
from ..tools import Tool, ToolResult
from ..tools.editor import CallRef, current_call
from ..tools.mcp_config import matches
from .hooks import HookEvent, HookOutcome
from .limits import LimitReached

# Consecutive replies whose tool calls could not be parsed before the run fails.
MAX_FORMAT_ERRORS = 3
# A tool result's output in its event (the model reads all of it; a view shows a line).
MAX_EVENT_OUTPUT = 2000
# The same call with the same arguments, in a row: from the third it is not run (the model is told
# it repeats itself and what it got); the fifth ends the task.
REPEAT_WARN_AT = 3
REPEAT_STOP_AT = 5


@dataclass
class ToolCalls:
    """Runs the tool calls of one session's replies and keeps what spans replies: malformed replies
    in a row, the call repeated and how often.

    Args:
        denied: tools its file grants but its parent may not pass on: name -> the error result a call gets.
        emit: reports an event of the session.
        fire_hook: fires the session's hooks (`AgentSession.fire_hook`).
        call_ref: the call a tool runs for, by its id, for an editor's question about it (`tools/editor.py`).
    """

    tools: dict[str, Tool]
    denied: dict[str, str]
    emit: Callable[[EventKind, EventData], None]
    fire_hook: Callable[[HookEvent, str, dict[str, Any]], Awaitable[HookOutcome]]
    call_ref: Callable[[str], CallRef]
    held: bool = False  # the last reply's calls were held by the grammar (said in their events)
    format_errors: int = 0
    repeat: tuple[str, int, str] = ("", 0, "")  # (call key, times in a row, its first output)

    async def act(self, reply: Reply, messages: list[Message]) -> None:
        """Run each tool call (in order) and feed its result back; malformed calls get an error."""
        for bad in reply.malformed_tool_calls:
            messages.append(self._malformed_result(bad))
        if reply.malformed_tool_calls and not reply.tool_calls:
            self.format_errors += 1
            if self.format_errors >= MAX_FORMAT_ERRORS:
                raise LimitReached("format_errors", f"{MAX_FORMAT_ERRORS} malformed tool calls in a row")
            return
        self.format_errors = 0
        calls = reply.tool_calls
        results: list[ToolResult] = []
        while len(results) < len(calls):
            # A run of calls to a tool that may run alongside itself (`subagent`) runs at once.
            start = end = len(results)
            while end < len(calls) and getattr(self.tools.get(calls[end].name), "concurrent", False):
                end += 1
            if end > start:
                results += await asyncio.gather(*(self._call_tool(call) for call in calls[start:end]))
            else:
                results.append(await self._call_tool(calls[start]))
        for call, result in zip(calls, results):
            messages.append({"role": "tool", "tool_call_id": call.id, "name": call.name, "content": result.output})

    async def _call_tool(self, call: ToolCall) -> ToolResult:
        repeated = self._repeated(call)
        if repeated is not None:
            return repeated
        result = await self._run_tool(call)
        key, times, _ = self.repeat
        if times == 1:
            self.repeat = (key, times, result.output)
        return result

    def _repeated(self, call: ToolCall) -> ToolResult | None:
        """Count the call against the one before; from the third identical one in a row, an error instead."""
        key = json.dumps([call.name, call.arguments], sort_keys=True, default=str)
        last, times, output = self.repeat
        times = times + 1 if key == last else 1
        self.repeat = (key, times, output if key == last else "")
        if times >= REPEAT_STOP_AT:
            raise LimitReached(
                "repetition", f"the model called {call.name} with the same arguments {times} times in a row"
            )
        if times < REPEAT_WARN_AT:
            return None
        result = ToolResult(
            f"Error: you are repeating yourself: this is call number {times} in a row of {call.name} with these same "
            f"arguments, and it was not run again. Do something else, or give your final answer. "
            f"What the call returned the first time:\n{output}",
            is_error=True,
        )
        repeat = ToolCallData(
            name=call.name, arguments=call.arguments, description=f"{call.name} (repeated)", id=call.id
        )
        self.emit("tool_call", repeat)
        self._report_result(call, result)
        return result

    async def _run_tool(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        label = tool.describe(call.arguments) if tool else f"{call.name} (unknown tool)"
        payload = ToolCallData(name=call.name, arguments=call.arguments, description=label, id=call.id)
        if self.held:
            payload["constrained"] = True
        self.emit("tool_call", payload)
        # A withheld `mcp__demo__*` covers each of that server's tools.
        denial = self.denied.get(call.name) or next((v for k, v in self.denied.items() if matches(call.name, k)), None)
        if tool is None and denial is not None:
            result = ToolResult(denial, is_error=True)
        elif tool is None:
            available = ", ".join(self.tools) or "none"
            result = ToolResult(f"Error: unknown tool '{call.name}'; available tools: {available}", is_error=True)
        else:
            # The call the tool runs for, for an editor's question about it (`tools/editor.py`).
            current_call.set(self.call_ref(call.id))
            result = await self._hooked_call(tool, call)
        self._report_result(call, result)
        return result

    def _report_result(self, call: ToolCall, result: ToolResult) -> None:
        output = result.output[:MAX_EVENT_OUTPUT]
        self.emit("tool_result", ToolResultData(name=call.name, is_error=result.is_error, output=output, id=call.id))

    async def _hooked_call(self, tool: Tool, call: ToolCall) -> ToolResult:
        """The call between its PreToolUse hooks (which may block it: their reason is its error result)
        and its PostToolUse hooks (which see its result; a block there adds their reason to it)."""
        facts = {"tool_name": call.name, "tool_input": call.arguments}
        pre = await self.fire_hook("PreToolUse", call.name, facts)
        if pre.blocked:
            return ToolResult(f"Error: a PreToolUse hook blocked this call: {pre.reason}", is_error=True)
        result = await tool.call(call.arguments)
        response = {"output": result.output, "is_error": result.is_error}
        post = await self.fire_hook("PostToolUse", call.name, {**facts, "tool_response": response})
        if post.blocked:
            return ToolResult(f"{result.output}\n\n[a PostToolUse hook says: {post.reason}]", is_error=result.is_error)
        return result

    def _malformed_result(self, bad: MalformedToolCall) -> Message:
        self.emit("tool_result", ToolResultData(name="?", is_error=True, output=bad.error))
        return {"role": "tool", "content": bad.error}  # the host's words, with the fix in the model's own format
