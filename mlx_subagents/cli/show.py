"""`subagent show`: a saved run, rendered for a person or as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.rule import Rule

from ..host.protocol import Message
from ..runs.transcripts import NOTE_KINDS, RunRecord, TaskEntry, TaskLog, child_runs, read_transcript
from ..runs.worktrees import Worktree, list_worktrees
from ..text import first_line

PREVIEW_LINES = 12
CUT_NOTE = "(the reply was cut short here: a timeout, Ctrl-C or a signal stopped it)"


def _entries(record: RunRecord, task: str | None) -> list[TaskEntry]:
    return [record.task(task)] if task is not None else record.tasks


def run_json(record: RunRecord, task: str | None = None) -> dict[str, Any]:
    """The run record with each task's meta, latest conversation and results per generation."""
    data = record.model_dump(mode="json", exclude={"folder"})
    data["transcripts"] = []
    for entry in _entries(record, task):
        item: dict[str, Any] = {"label": entry.label, "file": None, "meta": None, "messages": None, "results": []}
        item["skipped"] = []
        item["notes"] = []
        if entry.file is not None:
            log = read_transcript(record.transcript_path(entry))
            item.update(
                file=str(log.path),
                meta=log.meta,
                messages=log.messages,
                results=[r.model_dump(mode="json") for r in log.results],
                skipped=log.skipped,
                notes=[r for r in log.records if r.get("type") in NOTE_KINDS],
            )
        data["transcripts"].append(item)
    data["worktrees"] = [worktree_json(w) for w in _worktrees(record, task)]
    if children := child_runs(record):
        data["children"] = [
            {"run_id": c.run_id, "status": c.status, "tasks": [t.label for t in c.tasks]} for c in children
        ]
    return data


def show_run(console: Console, record: RunRecord, task: str | None = None, *, full: bool = False) -> None:
    score = f"{record.succeeded}/{record.total} succeeded" if record.succeeded is not None else "not finished"
    console.print(f"[bold]run {record.run_id}[/]  {record.mode}  {record.status}  {score}")
    console.print(f"[dim]{record.created}  {escape(record.cwd)}[/]")
    if record.error:
        console.print(f"[red]{escape(record.error)}[/]")
    for entry in _entries(record, task):
        console.print(Rule(f"{escape(entry.label)} ({entry.agent}) · {entry.status or '?'}", align="left", style="dim"))
        if entry.file is None:
            console.print("[dim](never started)[/]")
            continue
        _show_task(console, read_transcript(record.transcript_path(entry)), full)
    for worktree in _worktrees(record, task):
        console.print(Rule(f"worktree of {escape(worktree.label)}", align="left", style="dim"))
        console.print(escape(worktree_line(worktree)))
        console.print(f"[dim]apply with: subagent apply {escape(worktree.name)}[/]")
    if task is None and (children := child_runs(record)):
        console.print(Rule("sub-agent runs (subagent show ID, subagent resume ID ...)", align="left", style="dim"))
        for child in children:
            score = f"{child.succeeded}/{child.total}" if child.succeeded is not None else f"?/{child.total}"
            labels = ", ".join(t.label for t in child.tasks)
            console.print(f"{child.run_id}  {child.mode:<8} {child.status:<11} {score:>5}  {escape(labels)}")


def _show_task(console: Console, log: TaskLog, full: bool) -> None:
    """One task of a run: its model and generations, a fork's start, its conversation (or, when none was
    saved, its tool calls), its notes and each generation's result."""
    console.print(f"[dim]model {escape(str(log.meta.get('model')))} · {log.generations} generation(s) · {log.path}[/]")
    if fork := log.meta.get("fork_of"):
        run = f" (run {fork['run']})" if fork.get("run") else ""
        line = f"fork of {fork.get('parent')}{run}: its first {fork.get('messages')} messages are its parent's"
        console.print(f"[dim]{escape(line)}[/]")
    if log.skipped:
        damaged = f"skipped {len(log.skipped)} damaged line(s) of the transcript: {'; '.join(log.skipped)}"
        console.print(f"[yellow]{escape(damaged)}[/]")
    if log.messages is None:
        console.print("[yellow]no saved conversation (the process ended before the task did); tool calls:[/]")
        for r in log.records:
            if r.get("type") == "event" and r.get("kind") == "tool_call":
                console.print(f"  [cyan]{escape(str(r['data'].get('description', '')))}[/]")
        return
    for message in log.messages:
        _print_message(console, message, full)
    for note in log.records:
        if note.get("type") in NOTE_KINDS:
            console.print(f"[yellow]{escape(note_line(note))}[/]")
    for i, result in enumerate(log.results, 1):
        u = result.usage
        line = (
            f"generation {i}: {result.status} ({result.stop_reason}) in {result.duration_s:.1f}s, "
            f"{u.turns} turns, {u.input_tokens} in ({u.cached_tokens} cached), {u.output_tokens} out"
        )
        console.print(f"[dim]{escape(line)}[/]")
        if result.error:
            console.print(f"  [red]{escape(result.error)}[/]")


def worktree_line(worktree: Worktree) -> str:
    """`NAME  STATUS  BRANCH  DIFFSTAT  LABEL (AGENT)  REPO`: one kept worktree, for `worktrees` and `show`."""
    stat = worktree.diffstat or ("not finished: apply commits what it left" if worktree.status == "running" else "")
    return f"{worktree.name}  {worktree.status:<9} {worktree.branch}  {stat}  {worktree.label} ({worktree.agent})  {worktree.repo}"


def worktree_json(worktree: Worktree) -> dict[str, Any]:
    """A worktree's manifest as `--json` prints it."""
    return {**asdict(worktree), "files": list(worktree.files)}


def _worktrees(record: RunRecord, task: str | None) -> list[Worktree]:
    """The kept worktrees of a run's tasks (one that changed nothing was removed; one applied and pruned is gone)."""
    labels = {e.label for e in _entries(record, task)}
    return [w for w in list_worktrees() if w.run_id == record.run_id and w.label in labels]


def note_line(record: dict[str, Any]) -> str:
    """One line for a `task_send`, `task_notice`, `child_message` or `task_cancel` record."""
    data = record.get("data") or {}
    where = f"generation {record.get('generation', 1)}, turn {record.get('turn', 0)}"
    if record["type"] == "task_send":
        return f"message sent ({where}): {data.get('message', '')}"
    if record["type"] == "task_notice":  # its first line: the whole notice is the user message it became
        return f"notice ({where}): {first_line(str(data.get('text', '')), 200)}"
    if record["type"] == "child_message":
        return f"message from {data.get('id', '?')} ({where}): {data.get('message', '')}"
    return f"cancelled ({where}): {data.get('reason', '')}"


def _print_message(console: Console, message: Message, full: bool) -> None:
    role = message.get("role", "?")
    content = str(message.get("content") or "")
    if role == "system":
        text = content if full else f"({len(content):,} characters; --full shows it)"
        console.print(f"[magenta]system:[/] {escape(text)}")
    elif role == "user":
        console.print(f"[bold]user:[/] {escape(content)}")
    elif role == "assistant":
        if reasoning := str(message.get("reasoning_content") or ""):  # kept apart, and shown dimmed
            console.print(f"[dim]thinking: {escape(_preview(reasoning, full))}[/]")
        if content:
            console.print(f"[green]assistant:[/] {escape(content)}")
        if message.get("cut"):
            console.print(f"[yellow]{CUT_NOTE}[/]")
        for call in message.get("tool_calls") or []:
            fn = call.get("function", {})
            args = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
            console.print(f"[cyan]-> {escape(str(fn.get('name')))} {escape(args)}[/]")
    elif role == "tool":
        console.print(f"[dim]<- {escape(str(message.get('name', 'tool')))}:[/] {escape(_preview(content, full))}")


def _preview(text: str, full: bool) -> str:
    lines = text.splitlines()
    if full or len(lines) <= PREVIEW_LINES:
        return text
    return "\n".join(lines[:PREVIEW_LINES]) + f"\n[... {len(lines) - PREVIEW_LINES} more lines; --full shows them]"
