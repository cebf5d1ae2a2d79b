"""`subagent show ID --timeline FILE.html|FILE.svg`: a saved run as a picture.

One lane per task, each sub-agent's under its parent's (its child runs are read too); each turn a
bar split into the time it waited for the model (queued), prefilled and decoded, from the times of
its transcript's `turn_start`, `prefill`, `decode` and `usage` records; each tool call a mark with
its name; the waits for a slot or the writer lease shaded (a `task_start` record says how long it
waited, `waited_s`). Every shape has a hover text with its tokens. The HTML page holds the SVG inline
and loads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from html import escape
from pathlib import Path
from typing import Any

from ..errors import RequestError
from ..runs.transcripts import RunRecord, child_runs, read_transcript

LABEL_WIDTH = 230
CHART_WIDTH = 900
LANE_HEIGHT = 34
BAR_HEIGHT = 14
TOP = 58  # the legend and the time axis
BOTTOM = 10  # under the last lane: the picture is as tall as its lanes, nothing more
COLOURS = {"queued": "#c8cdd3", "prefill": "#f0a35e", "decode": "#4c8bf5", "tool": "#3aa757", "wait": "#9aa0a6"}


@dataclass
class TurnBar:
    """One turn: when it started, prefilled, began to decode and ended (seconds from the run's start)."""

    turn: int
    start: float
    prefill: float | None = None
    decode: float | None = None
    end: float | None = None
    prefill_tokens: int = 0
    cached: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    tps: float = 0.0


@dataclass
class Lane:
    """One task: its bars, tool calls `(time, name, description)` and waits `(start, end, why)`."""

    label: str
    agent: str
    depth: int
    start: float | None = None
    end: float | None = None
    turns: list[TurnBar] = field(default_factory=list)
    tools: list[tuple[float, str, str]] = field(default_factory=list)
    waits: list[tuple[float, float, str]] = field(default_factory=list)


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def _events(record: RunRecord) -> list[tuple[str, list[dict[str, Any]]]]:
    """Each started task of the run: its label and its records."""
    out = []
    for entry in record.tasks:
        if entry.file is not None:
            out.append((entry.label, read_transcript(record.transcript_path(entry)).records))
    return out


def _all_tasks(record: RunRecord) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """`(label, agent, records)` of the run's tasks and, recursively, of its sub-agents' runs."""
    tasks = [(label, _agent(records, label), records) for label, records in _events(record)]
    for child in child_runs(record):
        tasks += _all_tasks(child)
    return tasks


def _waited(record: dict[str, Any]) -> float:
    """Seconds a `task_start` record says its task waited before it (0 for any other record)."""
    if record.get("type") != "event" or record.get("kind") != "task_start":
        return 0.0
    return float((record.get("data") or {}).get("waited_s") or 0.0)


def _agent(records: list[dict[str, Any]], label: str) -> str:
    return next((str(r.get("agent")) for r in records if r.get("type") == "task"), label)


def _lane(label: str, agent: str, records: list[dict[str, Any]], origin: float) -> Lane:
    lane = Lane(label, agent, label.count(" > "))
    turn: TurnBar | None = None
    seen = (0, 0)  # the usage so far: input and output tokens, for each turn's own
    delegating: float | None = None  # when its `subagent` call started: it waits for its children meanwhile
    for record in records:
        if "time" not in record:
            continue
        at = _seconds(record["time"]) - origin
        lane.start = at if lane.start is None else min(lane.start, at)
        lane.end = at if lane.end is None else max(lane.end, at)
        kind, data = record.get("kind"), record.get("data") or {}
        if record.get("type") != "event":
            continue
        if kind == "task_start" and (waited := _waited(record)):
            lane.waits.append((at - waited, at, f"waited for {data.get('waited_for', 'a slot')}"))
            lane.start = min(lane.start, at - waited)
        elif kind == "turn_start":
            turn = TurnBar(int(record.get("turn") or len(lane.turns) + 1), at)
            lane.turns.append(turn)
        elif turn is not None and kind == "prefill":
            turn.prefill, turn.prefill_tokens, turn.cached = at, int(data["tokens"]), int(data["cached"])
        elif turn is not None and kind == "decode" and turn.decode is None:
            turn.decode = at
        elif turn is not None and kind == "usage" and turn.end is None:
            turn.end, turn.tps = at, float(data.get("tps") or 0.0)
            turn.prompt_tokens, turn.generated = data["input_tokens"] - seen[0], data["output_tokens"] - seen[1]
            seen = (data["input_tokens"], data["output_tokens"])
        elif kind == "tool_call":
            lane.tools.append((at, str(data.get("name")), str(data.get("description") or "")))
            delegating = at if data.get("name") == "subagent" else delegating
        elif kind == "tool_result" and data.get("name") == "subagent" and delegating is not None:
            lane.waits.append((delegating, at, "waited for its sub-agents"))
            delegating = None
    return lane


def collect_lanes(record: RunRecord) -> list[Lane]:
    """The run's lanes, each sub-agent right under its parent, in the order they started."""
    tasks = _all_tasks(record)
    # the run starts at its first record, or at the start of a wait told by a later one
    stamps = [_seconds(r["time"]) - _waited(r) for _, _, records in tasks for r in records if "time" in r]
    if not stamps:
        return []
    origin = min(stamps)
    return _tree_order([_lane(label, agent, records, origin) for label, agent, records in tasks])


def _tree_order(lanes: list[Lane]) -> list[Lane]:
    children: dict[str, list[Lane]] = {}
    for lane in sorted(lanes, key=lambda lane: lane.start or 0.0):
        children.setdefault(lane.label.rpartition(" > ")[0], []).append(lane)
    labels = {lane.label for lane in lanes}
    ordered: list[Lane] = []

    def walk(parent: str) -> None:
        for lane in children.get(parent, []):
            ordered.append(lane)
            walk(lane.label)

    for root in [p for p in children if p not in labels]:  # top-level tasks (and orphans)
        walk(root)
    return ordered


def _axis_step(span: float) -> float:
    """A round tick interval giving about 8 ticks over `span` seconds."""
    raw = max(span / 8, 0.001)
    scale = 10 ** int(f"{raw:e}".split("e")[1])
    return next(m * scale for m in (1, 2, 5, 10) if m * scale >= raw)


def _turn_title(lane: Lane, t: TurnBar) -> str:
    parts = [f"{lane.label}, turn {t.turn}"]
    start = t.prefill if t.prefill is not None else t.decode
    if start is not None:
        parts.append(f"queued {start - t.start:.2f} s")
    if t.prefill is not None:
        until = t.decode if t.decode is not None else t.end
        took = f" in {until - t.prefill:.2f} s" if until is not None else ""
        parts.append(f"prefill {t.prefill_tokens:,} tokens ({t.cached:,} cached){took}")
    if t.decode is not None and t.end is not None:
        took = t.end - t.decode
        # The host's own rate, else the bar's (a scripted host says none: it showed "0.0 tok/s").
        tps = t.tps or (t.generated / took if t.generated and took > 0 else 0.0)
        rate = f" ({tps:.1f} tok/s)" if tps else ""
        parts.append(f"decode {t.generated:,} tokens in {took:.2f} s{rate}")
    if t.prompt_tokens:
        parts.append(f"prompt {t.prompt_tokens:,} tokens")
    return "; ".join(parts)


def render_svg(record: RunRecord, lanes: list[Lane]) -> str:
    """The run's timeline as one SVG document (shapes carry `class`, `data-*` and a `<title>`)."""
    end = max((lane.end or 0.0 for lane in lanes), default=0.0) or 1.0
    x = lambda t: LABEL_WIDTH + CHART_WIDTH * t / end  # noqa: E731
    height = TOP + LANE_HEIGHT * len(lanes) + BOTTOM
    width = LABEL_WIDTH + CHART_WIDTH + 20
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f"<title>run {escape(record.run_id)}</title>",
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    for i, (name, colour) in enumerate(COLOURS.items()):
        shade = ' fill-opacity="0.35"' if name == "wait" else ""
        out.append(f'<rect x="{10 + i * 110}" y="8" width="12" height="12" fill="{colour}"{shade}/>')
        out.append(f'<text x="{26 + i * 110}" y="18">{name}</text>')
    step = _axis_step(end)
    tick = 0.0
    while tick <= end + 1e-9:
        out.append(
            f'<line x1="{x(tick):.1f}" y1="{TOP - 14}" x2="{x(tick):.1f}" y2="{height - BOTTOM}" stroke="#eeeeee"/>'
        )
        out.append(f'<text x="{x(tick):.1f}" y="{TOP - 18}" text-anchor="middle" fill="#555555">{tick:g} s</text>')
        tick += step
    for row, lane in enumerate(lanes):
        out += _lane_svg(lane, TOP + row * LANE_HEIGHT, x)
    out.append("</svg>")
    return "\n".join(out)


def _lane_svg(lane: Lane, top: float, x: Any) -> list[str]:
    mid = top + LANE_HEIGHT / 2
    name = lane.label.rpartition(" > ")[2]
    out = [
        f'<g class="lane" data-label="{escape(lane.label)}" data-agent="{escape(lane.agent)}">',
        f'<text x="{8 + 14 * lane.depth}" y="{mid + 4:.1f}">{escape(name)} <tspan fill="#777777">'
        f"({escape(lane.agent)})</tspan></text>",
    ]
    for start, stop, why in lane.waits:
        width = max(1.0, x(stop) - x(start))
        out.append(
            f'<rect class="wait" x="{x(start):.1f}" y="{top + 3}" width="{width:.1f}" '
            f'height="{LANE_HEIGHT - 6}" fill="{COLOURS["wait"]}" fill-opacity="0.35">'
            f"<title>{escape(lane.label)} {why} for {stop - start:.2f} s</title></rect>"
        )
        if width > 7 * len(why):  # said in the shade where it fits
            out.append(f'<text x="{x(start) + 6:.1f}" y="{mid + 4:.1f}" font-size="11" fill="#555555">{why}</text>')
    for t in lane.turns:
        out.append(f'<g class="turn" data-turn="{t.turn}"><title>{escape(_turn_title(lane, t))}</title>')
        bar_end = t.end if t.end is not None else lane.end or t.start
        edges = [("queued", t.start), ("prefill", t.prefill), ("decode", t.decode), ("", bar_end)]
        present = [(kind, at) for kind, at in edges if at is not None]
        for (kind, at), (_next, until) in zip(present, present[1:]):
            out.append(
                f'<rect class="{kind}" x="{x(at):.1f}" y="{mid - BAR_HEIGHT / 2:.1f}" '
                f'width="{max(1.5, x(until) - x(at)):.1f}" height="{BAR_HEIGHT}" fill="{COLOURS[kind]}"/>'
            )
        out.append("</g>")
    for at, tool, description in lane.tools:
        out.append(
            f'<g class="tool" data-name="{escape(tool)}"><title>{escape(description or tool)}</title>'
            f'<path d="M{x(at):.1f},{mid + BAR_HEIGHT / 2 + 1:.1f} l4,6 l-8,0 z" fill="{COLOURS["tool"]}"/>'
            f'<text x="{x(at) + 5:.1f}" y="{mid - BAR_HEIGHT / 2 - 2:.1f}" font-size="9" fill="#2d7a3e">'
            f"{escape(tool)}</text></g>"
        )
    out.append("</g>")
    return out


def render_html(record: RunRecord, svg: str) -> str:
    """A page that holds the SVG inline and loads nothing."""
    score = f"{record.succeeded}/{record.total} succeeded" if record.succeeded is not None else "not finished"
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8">'
        f"<title>run {escape(record.run_id)}</title>"
        "<style>body{font-family:sans-serif;margin:16px;color:#222}h1{font-size:16px;margin:0 0 4px}"
        "p{margin:0 0 12px;color:#555;font-size:13px}</style></head><body>"
        f"<h1>run {escape(record.run_id)}</h1><p>{escape(record.mode)} · {escape(record.status)} · {score} · "
        f"{escape(record.cwd)}</p>\n{svg}\n</body></html>\n"
    )


def write_timeline(record: RunRecord, path: Path) -> int:
    """Write the run's timeline to `path` (.html or .svg); the number of lanes."""
    suffix = path.suffix.lower()
    if suffix not in (".html", ".htm", ".svg"):
        raise RequestError(f"--timeline {path}: the file must end in .html or .svg")
    lanes = collect_lanes(record)
    svg = render_svg(record, lanes)
    text = svg + "\n" if suffix == ".svg" else render_html(record, svg)
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise RequestError(f"--timeline {path}: cannot write it ({exc.strerror or exc}); pick another path") from None
    return len(lanes)
