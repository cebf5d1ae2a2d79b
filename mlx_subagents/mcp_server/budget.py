"""The call budget: `run_agents` answers within it, whatever the agents still have to do.

Clients give a tool call a fixed time: Codex 60 s by default (`tool_timeout_sec`), the TypeScript SDK
that many clients are built on 60 s per request; a client that gives up gets nothing, and a local
model's scout can take longer. So a call answers within `--call-budget` seconds (default 50: under
those 60 s with room for the answer to travel): the tasks that finished are returned whole, the others
go on in the background on the server's board, and the answer gives their ids and says to read them
with `agent_output`, whose `wait` the same budget caps. `--call-budget off` is for clients that wait
(Claude Code with a raised `MCP_TOOL_TIMEOUT`).

A 2026-07-28 client that declares the Tasks extension gets the protocol's own way instead: the call
answers at once with a task handle, polled to its result without any budget (`call_tasks.py`). The
budget and `agent_output` are for every other client.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import RequestError
from ..results import RunResult, TaskStatus

DEFAULT_CALL_BUDGET = 50.0
OFF = "off"


def parse_call_budget(value: str) -> float | None:
    """`50` or `50s` -> 50.0; `off` -> None (no budget); else one line saying what is accepted."""
    text = value.strip().lower()
    if text == OFF:
        return None
    try:
        seconds = float(text.removesuffix("s"))
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise RequestError(
            f"--call-budget {value!r}: give the seconds a call may take (e.g. 50) or 'off' for clients that wait"
        )
    return seconds


def budget_text(done: Sequence[RunResult], running: Sequence[TaskStatus], budget: float, total: int) -> str:
    """What a call answers when its budget ends first: the finished tasks' answers (whole, within the
    answer cap), then the ids still running and how to read them."""
    from ..tools.subagent import fit_answers  # here: the CLI reads this module's default, and loads no tools

    head = (
        f"{len(done)} of {total} task(s) finished within this call's budget of {budget:g} s; "
        f"{len(running)} still run in the background."
    )
    heads = [f"### [{r.label}] {r.status if r.ok else f'{r.status} ({r.stop_reason}): {r.error}'}" for r in done]
    bodies = fit_answers([r.output or "(no answer)" for r in done], [r.transcript for r in done], head, heads, 600)
    sections = [f"{h}\n{b}" for h, b in zip(heads, bodies)]
    ids = ", ".join(f"{s.id} ({s.agent}, {s.status})" for s in running)
    first = running[0].id if running else ""
    read = (
        f"Still running: {ids}. Read each answer with agent_output "
        f'({{"id": "{first}", "wait": {budget:g}}} waits for it up to the budget); agent_status shows how they '
        "are doing, cancel_agent stops one."
    )
    return "\n\n".join([head, *sections, read])


__all__ = ["DEFAULT_CALL_BUDGET", "OFF", "budget_text", "parse_call_budget"]
