"""Size caps on what goes into a run and what comes out of it.

Inputs are checked before anything starts, so a request that cannot run is refused whole with the
numbers that broke it. Answers are capped in what is printed and returned; the transcript keeps the
full text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .errors import InputTooLargeError, RequestError

MAX_TASKS = 8
MAX_CONCURRENCY = 4
# An inference engine batches on its own hardware: every task of a run may go at once.
MAX_ENGINE_CONCURRENCY = 8
DEFAULT_CONCURRENCY = 4
# Agent-file warnings a running command (and the `subagent` tool's description) shows; the rest are counted.
MAX_WARNINGS = 5
MAX_TASK_CHARS = 20_000
MAX_REQUEST_CHARS = 60_000
MAX_ANSWER_BYTES = 50 * 1024
# A conversation with a child is bounded: messages waiting for it, and generations of it.
MAX_QUEUED_MESSAGES = 64
MAX_GENERATIONS = 64
# A child's messages to its parent (`parent_send`): each this long at most, and this many unread at once.
MAX_CHILD_MESSAGE_CHARS = 2_000
MAX_CHILD_MESSAGES = 8


class CappedAgent(Protocol):
    """What the caps read of an agent (an `AgentSpec`); a protocol, so that the tools, which import
    these limits, and the agents, which import the tools, make no import cycle through here."""

    @property
    def name(self) -> str: ...
    @property
    def system_prompt(self) -> str: ...
    @property
    def path(self) -> Path: ...


@dataclass(frozen=True)
class CapItem:
    """One task as the caps see it: its label, the text it receives and its agent."""

    label: str
    text: str
    spec: CappedAgent


def check_task_count(n_tasks: int) -> None:
    if n_tasks == 0:
        raise RequestError("no tasks given: add at least one task")
    if n_tasks > MAX_TASKS:
        raise RequestError(
            f"{n_tasks} tasks is more than the limit of {MAX_TASKS} per run; split the work into several runs"
        )


def check_concurrency(concurrency: int, *, engine: bool = False) -> None:
    if not 1 <= concurrency <= (MAX_ENGINE_CONCURRENCY if engine else MAX_CONCURRENCY):
        raise RequestError(
            f"concurrency must be from 1 to {MAX_CONCURRENCY} (up to {MAX_ENGINE_CONCURRENCY} with --engine), "
            f"got {concurrency}"
        )


def check_request(items: Sequence[CapItem], shared_input: str = "") -> None:
    """Refuse a request over a cap, naming the task or agent and the numbers. (An agent file's own
    system prompt is checked against the model's context window, once the model is loaded.)

    Args:
        shared_input: text every task receives besides its own (a workflow's `--input`); it counts
            in each task's size and once in the whole request.
    """
    check_task_count(len(items))
    for item in items:
        n_chars = len(item.text) + len(shared_input)
        if n_chars > MAX_TASK_CHARS:
            raise InputTooLargeError(
                f"task '{item.label}' is {n_chars:,} characters, over the limit of {MAX_TASK_CHARS:,}; "
                "shorten it, or put the details in a file the agent can read"
            )
    # Each distinct agent's system prompt counts once: tasks of one agent share it.
    prompts = {item.spec.name: len(item.spec.system_prompt) for item in items}
    total = len(shared_input) + sum(len(item.text) for item in items) + sum(prompts.values())
    if total > MAX_REQUEST_CHARS:
        raise InputTooLargeError(
            f"the whole request is {total:,} characters (tasks, input and system prompts), over the limit of "
            f"{MAX_REQUEST_CHARS:,}; split it into several runs or shorten the tasks"
        )


def cap_answer(
    text: str,
    transcript: str | None,
    max_bytes: int = MAX_ANSWER_BYTES,
    *,
    read_more: str | None = None,
    offset: int = 0,
) -> str:
    """The answer cut so that it and a note saying where the full text is fit `max_bytes` of UTF-8.

    Args:
        transcript: the file holding the whole answer; None when transcripts are off.
        read_more: instead of the transcript's path (which a parent agent's tools cannot open), how to
            read the rest, with `{offset}` for where the shown part ends, in characters (e.g.
            `task_output` with an offset).
        offset: where `text` starts in the whole answer (a piece read from the middle).
    """
    data = text.encode("utf-8", "surrogatepass")  # a lone surrogate counts, never raises
    if len(data) <= max_bytes:
        return text
    where = (
        f"the full text is in the transcript {transcript}"
        if transcript
        else "the full text is not saved (transcripts are off)"
    )

    def note(n_shown: int, n_chars: int) -> str:
        how = read_more.replace("{offset}", str(offset + n_chars)) if read_more else where
        return f"\n\n[answer truncated: {len(data):,} bytes, showing the first {n_shown:,}; {how}]"

    # The note's length depends on the numbers it shows: make room for the longest they can be.
    head = utf8_head(text, max_bytes - len(note(len(data), len(text)).encode("utf-8", "surrogatepass")))
    return head + note(len(head.encode("utf-8", "surrogatepass")), len(head))


def utf8_head(text: str, max_bytes: int) -> str:
    """The longest start of `text` whose UTF-8 fits in `max_bytes`, cut between two characters.

    One encode of at most `max_bytes` characters (none is under a byte), whatever the text's length.
    A lone surrogate counts as the three bytes `surrogatepass` writes, and never raises.
    """
    max_bytes = max(0, max_bytes)
    head = text[:max_bytes]
    data = head.encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return head
    end = max_bytes
    while data[end] & 0xC0 == 0x80:  # a continuation byte: the character it ends began before the cut
        end -= 1
    return data[:end].decode("utf-8", "surrogatepass")
