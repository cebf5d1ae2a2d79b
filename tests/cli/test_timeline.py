"""`subagent show ID --timeline`: a saved run as a picture, one lane per task, one bar per turn."""

from __future__ import annotations

import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from mlx_subagents.cli.timeline import BOTTOM, COLOURS, LANE_HEIGHT, TOP
from mlx_subagents.runs.transcripts import load_run
from tests.conftest import chromium
from tests.helpers import call

SVG = "{http://www.w3.org/2000/svg}"
# A parent asks three scouts at once; with two slots the third waits. Every reply takes a little
# while (`delay`: the prefill, `stall`: the decode), so that each part of each bar has a width.
TEAM = {
    "agents": {
        "orchestrator": {
            "replies": [
                {
                    **call("subagent", tasks=[{"agent": "scout", "task": f"map {x}"} for x in "abc"]),
                    "delay": 0.2,
                    "stall": 0.2,
                },
                {"content": "All three mapped.", "delay": 0.2, "stall": 0.2},
            ]
        },
        "scout": {
            "replies": [
                {**call("ls", path="."), "delay": 0.2, "stall": 0.2},
                {"content": "Findings: x\n\nSummary: y", "delay": 0.2, "stall": 0.3},
            ]
        },
    }
}
LABELS = ["orchestrator", "orchestrator > scout#1", "orchestrator > scout#2", "orchestrator > scout#3"]


@pytest.fixture
def team_run(tmp_path: Path, write_script: Any, run_cli: Any) -> str:
    """The run id of the team's run, saved in this test's home."""
    code, out, err = run_cli(
        "run", "orchestrator", "map", "--model", write_script(TEAM), "-C", str(tmp_path), "-j", "2"
    )
    assert (code, out) == (0, "All three mapped.\n"), err
    return load_run("last").run_id


@pytest.mark.slow
def test_a_parent_and_three_children_are_four_lanes_of_one_bar_per_turn(
    team_run: str, tmp_path: Path, run_cli: Any
) -> None:
    code, _, err = run_cli("show", team_run, "--timeline", str(tmp_path / "run.svg"))
    assert code == 0 and err == f"wrote the timeline of run {team_run} (4 tasks) to {tmp_path / 'run.svg'}\n"
    svg = ElementTree.parse(tmp_path / "run.svg").getroot()
    lanes = svg.findall(f"{SVG}g[@class='lane']")
    assert [lane.get("data-label") for lane in lanes] == LABELS
    assert_as_tall_as_its_lanes(svg, len(LABELS))
    for lane in lanes:
        turns = lane.findall(f"{SVG}g[@class='turn']")
        assert [t.get("data-turn") for t in turns] == ["1", "2"]
        for turn in turns:  # each part, in order, and the hover text with its tokens
            parts = [rect.get("class") for rect in turn.findall(f"{SVG}rect")]
            assert parts == ["queued", "prefill", "decode"]
            title = turn.find(f"{SVG}title").text or ""
            assert " tokens (" in title and "decode " in title and "tok/s" in title
            assert " (0.0 tok/s)" not in title  # the scripted host says no rate: the bar's own
        tools = [t.get("data-name") for t in lane.findall(f"{SVG}g[@class='tool']")]
        assert tools == (["subagent"] if lane.get("data-label") == "orchestrator" else ["ls"])
    waits = {lane.get("data-label"): lane.findall(f"{SVG}rect[@class='wait']") for lane in lanes}
    # the parent waits for its children (its call's band), the third scout for a slot at first
    assert [label for label, found in waits.items() if found] == ["orchestrator", "orchestrator > scout#3"]
    assert (waits["orchestrator > scout#3"][0].find(f"{SVG}title").text or "").endswith(" s")
    [delegated] = waits["orchestrator"]
    assert (delegated.find(f"{SVG}title").text or "").startswith("orchestrator waited for its sub-agents for ")
    assert float(delegated.get("width") or 0) > float(waits["orchestrator > scout#3"][0].get("width") or 0)

    code, _, _ = run_cli("show", team_run, "--timeline", str(tmp_path / "run.html"))
    page = (tmp_path / "run.html").read_text(encoding="utf-8")
    assert code == 0 and page.startswith("<!doctype html>") and "<svg " in page
    assert "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")  # it loads nothing

    code, _, err = run_cli("show", team_run, "--timeline", str(tmp_path / "run.png"))
    assert (code, err) == (2, f"error: --timeline {tmp_path / 'run.png'}: the file must end in .html or .svg\n")


def assert_as_tall_as_its_lanes(svg: ElementTree.Element, lanes: int) -> None:
    """The picture's height (and its viewBox's) is its legend and axis, its lanes and a margin, nothing
    more: each lane's label lies in its own band, the last one's ending BOTTOM above the picture's end."""
    height = TOP + LANE_HEIGHT * lanes + BOTTOM
    assert svg.get("height") == str(height) and svg.get("viewBox") == f"0 0 {svg.get('width')} {height}"
    labels = [float(g.find(f"{SVG}text").get("y") or 0) for g in svg.findall(f"{SVG}g[@class='lane']")]
    assert len(labels) == lanes
    for row, y in enumerate(labels):
        assert TOP + row * LANE_HEIGHT < y < TOP + (row + 1) * LANE_HEIGHT <= height - BOTTOM


def test_a_run_of_one_task_is_a_picture_of_one_lane_and_no_more(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    """The page is as tall as its lanes: one task, one lane, and the page holds only the heading and
    the picture (no height of its own to fill a window)."""
    model = write_script({"agents": {"scout": {"replies": [{"content": "Findings: x\n\nSummary: y"}]}}})
    assert run_cli("run", "scout", "map", "--model", model, "-C", str(tmp_path))[0] == 0
    run_id = load_run("last").run_id
    assert run_cli("show", run_id, "--timeline", str(tmp_path / "run.html"))[0] == 0
    page = (tmp_path / "run.html").read_text(encoding="utf-8")
    assert "height" not in page.partition("<svg ")[0]  # no style sizes the page
    svg = ElementTree.fromstring(page[page.index("<svg ") : page.index("</svg>") + len("</svg>")])
    assert_as_tall_as_its_lanes(svg, 1)


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.needs("chromium")
def test_the_timeline_page_in_a_real_browser_shows_four_lanes_of_two_bars(
    team_run: str, tmp_path: Path, run_cli: Any
) -> None:
    """Headless Chromium draws the page: each lane is a band with two decode bars (one per turn)."""
    browser = chromium()
    assert browser is not None  # `needs` skipped the test otherwise
    page = tmp_path / "run.html"
    assert run_cli("show", team_run, "--timeline", str(page))[0] == 0
    shot = tmp_path / "run.png"
    height = 100 + TOP + LANE_HEIGHT * len(LABELS)
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={shot}",
         f"--window-size=1200,{height}", page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    width, rows = read_png(shot)
    decode = bytes.fromhex(COLOURS["decode"][1:])
    bands = _bands([y for y, row in enumerate(rows) if _runs(row, decode)])
    assert len(bands) == 1 + len(LABELS)  # the legend's swatch, then a band per lane
    for top, bottom in bands[1:]:
        assert len(_runs(rows[(top + bottom) // 2], decode)) == 2  # two turns: two decode bars
    assert width == 1200


def _bands(ys: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive rows."""
    bands: list[tuple[int, int]] = []
    for y in ys:
        if bands and y == bands[-1][1] + 1:
            bands[-1] = (bands[-1][0], y)
        else:
            bands.append((y, y))
    return bands


def _runs(row: list[bytes], colour: bytes, min_width: int = 3) -> list[tuple[int, int]]:
    """The runs of at least `min_width` pixels of exactly `colour` in a row."""
    runs, start = [], None
    for x, pixel in enumerate([*row, b""]):
        if pixel == colour and start is None:
            start = x
        elif pixel != colour and start is not None:
            if x - start >= min_width:
                runs.append((start, x))
            start = None
    return runs


def read_png(path: Path) -> tuple[int, list[list[bytes]]]:
    """A PNG's width and its rows of RGB pixels (8-bit RGB or RGBA, not interlaced: what Chromium writes)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and colour_type in (2, 6) and interlace == 0
    channels = 3 if colour_type == 2 else 4
    raw, stride, previous = zlib.decompress(idat), width * channels, bytearray(width * channels)
    rows = []
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 255
        rows.append([bytes(line[x * channels : x * channels + 3]) for x in range(width)])
        previous = line
    return width, rows
