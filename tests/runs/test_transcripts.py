"""Transcripts: what every run saves, listing and showing runs, and resuming a task's conversation."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import RunNotFoundError
from mlx_subagents.runs.runner import Runner
from mlx_subagents.runs.task_session import close_open_tool_calls
from mlx_subagents.runs.tasks import TaskSpec
from mlx_subagents.runs.transcripts import list_runs, load_run, read_transcript, runs_dir
from tests.helpers import call, go, make_runner, scripted_host


def test_a_run_saves_its_record_and_every_task(tmp_path: Path, isolated_home: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    host = scripted_host(
        {"agents": {"scout": {"replies": [call("read", path="notes.txt"), "it says hello"]}}, "replies": ["planned"]}
    )
    outcome = go(make_runner(tmp_path, host), "parallel", [TaskSpec("scout", "read it"), TaskSpec("planner", "plan")])

    folder = isolated_home / ".mlx-subagents" / "runs" / outcome.run_id
    assert sorted(p.name for p in folder.iterdir()) == ["01-scout.jsonl", "02-planner.jsonl", "run.json"]
    record = json.loads((folder / "run.json").read_text())
    assert {k: record[k] for k in ("run_id", "mode", "cwd", "status", "succeeded", "total")} == {
        "run_id": outcome.run_id,
        "mode": "parallel",
        "cwd": str(tmp_path.resolve()),
        "status": "finished",
        "succeeded": 2,
        "total": 2,
    }
    assert [(t["label"], t["agent"], t["file"], t["status"]) for t in record["tasks"]] == [
        ("scout", "scout", "01-scout.jsonl", "completed"),
        ("planner", "planner", "02-planner.jsonl", "completed"),
    ]
    log = read_transcript(folder / "01-scout.jsonl")
    assert {k: log.meta[k] for k in ("agent", "model", "cwd", "task", "label", "generation")} == {
        "agent": "scout",
        "model": host.model_id,
        "cwd": str(tmp_path.resolve()),
        "task": "read it",
        "label": "scout",
        "generation": 1,
    }
    kinds = [r.get("kind", r["type"]) for r in log.records]
    assert kinds == [
        "task",
        "task_start",
        "turn_start",
        "prefill",
        "decode",
        "usage",
        "tool_call",
        "tool_result",
        "turn_start",
        "prefill",
        "decode",
        "usage",
        "message",
        "task_end",
        "messages",
        "result",
    ]
    assert log.messages[-2:] == [
        {"role": "tool", "tool_call_id": "call_1", "name": "read", "content": "     1\thello"},
        {"role": "assistant", "content": "it says hello"},
    ]
    assert log.results[0].output == "it says hello" and log.results[0].usage.turns == 2
    assert outcome.results[0].transcript == str(folder / "01-scout.jsonl")


def test_resume_continues_the_conversation_and_extends_the_transcript(tmp_path: Path, write_script: Any) -> None:
    # On files: the last resume, without a model, replays the file the task's transcript names.
    first = write_script({"agents": {"scout": {"replies": [call("ls", path="."), "first answer"]}}})
    result = go(make_runner(tmp_path, first), "run", TaskSpec("scout", "look around"))

    second = write_script(["second answer"], name="second.json")
    resumed = go(make_runner(tmp_path, second), "resume", result.run_id[:12], "and then?")

    assert (resumed.status, resumed.output, resumed.task, resumed.run_id) == (
        "completed",
        "second answer",
        "and then?",
        result.run_id,
    )
    assert resumed.usage.turns == 1 and resumed.model == second
    log = read_transcript(Path(result.transcript))
    assert log.generations == 2
    assert [m["role"] for m in log.messages] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    assert log.messages[-2:] == [
        {"role": "user", "content": "and then?"},
        {"role": "assistant", "content": "second answer"},
    ]
    assert [r.output for r in log.results] == ["first answer", "second answer"]
    assert [r["message"] for r in log.records if r["type"] == "follow_up"] == ["and then?"]

    # Without --model the task's own model is used again (the script starts over).
    again = go(Runner(cwd=tmp_path), "resume", "last", "once more")
    assert (again.model, again.output, again.usage.turns) == (first, "first answer", 2)
    assert read_transcript(Path(result.transcript)).generations == 3


def test_resume_picks_a_task_and_explains_what_is_missing(scripted_runner: Any) -> None:
    outcome = go(scripted_runner(["one"]), "parallel", [TaskSpec("scout", "a"), TaskSpec("planner", "b")])
    runner = scripted_runner(["two"])

    with pytest.raises(RunNotFoundError, match=r"has 2 tasks \(scout, planner\); pick one with --task LABEL"):
        go(runner, "resume", outcome.run_id, "more")
    with pytest.raises(RunNotFoundError, match="has no task 'worker'; its tasks are: scout, planner"):
        go(runner, "resume", outcome.run_id, "more", task="worker")
    with pytest.raises(RunNotFoundError, match="no saved run 'nope' in .*runs; `subagent runs` lists the saved runs"):
        go(runner, "resume", "nope", "more")
    assert go(runner, "resume", outcome.run_id, "more", task="2").output == "two"
    assert go(runner, "resume", outcome.run_id, "more", task="planner").label == "planner"


def test_list_and_load_runs(scripted_runner: Any) -> None:
    assert list_runs() == []
    ids = [go(scripted_runner(["x"]), "run", TaskSpec("scout", str(i))).run_id for i in range(3)]

    assert [r.run_id for r in list_runs()] == ids[::-1]
    assert [r.run_id for r in list_runs(limit=2)] == ids[:0:-1]
    assert load_run("last").run_id == ids[-1]
    assert load_run(ids[0]).tasks[0].label == "scout"
    with pytest.raises(RunNotFoundError, match="is ambiguous"):
        load_run(ids[0][:4])
    (runs_dir() / "junk").mkdir()
    assert len(list_runs()) == 3


def test_save_transcripts_off_writes_nothing(scripted_runner: Any) -> None:
    result = go(scripted_runner(["x"], save_transcripts=False), "run", TaskSpec("scout", "a"))
    assert (result.output, result.run_id, result.transcript) == ("x", None, None)
    assert not runs_dir().exists()


def test_open_tool_calls_get_an_error_result_before_a_follow_up() -> None:
    call_part = {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": {"command": "sleep 9"}}}
    other = {"id": "c2", "type": "function", "function": {"name": "ls", "arguments": {}}}
    messages = [
        {"role": "user", "content": "Task: x"},
        {"role": "assistant", "content": "", "tool_calls": [other, call_part]},
        {"role": "tool", "tool_call_id": "c2", "name": "ls", "content": "a.py"},
    ]
    assert close_open_tool_calls(messages)[3:] == [
        {
            "role": "tool",
            "tool_call_id": "c1",
            "name": "bash",
            "content": "Error: this tool call was interrupted before it finished.",
        }
    ]
    done = [*messages[:1], {"role": "assistant", "content": "done"}]
    assert close_open_tool_calls(done) == done


# -- the CLI ------------------------------------------------------------------------------------------


def test_cli_runs_show_and_resume(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script({"agents": {"scout": {"replies": [call("ls", path="."), "found [it]"]}}})
    code, out, err = run_cli("run", "scout", "where?", "-m", model, "-C", str(tmp_path))
    assert (code, out) == (0, "found [it]\n")
    run_id = load_run("last").run_id
    assert f'saved as run {run_id}; continue with: subagent resume {run_id} "..."' in err

    code, out, _ = run_cli("runs")
    assert code == 0 and out.startswith(f"{run_id}  single   finished      1/1  scout  ")

    code, out, _ = run_cli("show", run_id)
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"run {run_id}  single  finished  1/1 succeeded"
    assert lines[4:11] == [
        "system: (" + lines[4].split("(", 1)[1],
        "user: Task: where?",
        "",
        f"Workspace: {tmp_path.resolve()}",
        '-> ls {"path": "."}',
        "<- ls: script.json",
        "assistant: found [it]",
    ]

    code, out, _ = run_cli("show", "last", "--json")
    data = json.loads(out)
    assert code == 0 and data["run_id"] == run_id and data["transcripts"][0]["messages"][-1]["content"] == "found [it]"

    second = write_script(["more [details]"], name="second.json")
    code, out, _ = run_cli("resume", run_id, "details?", "-m", second, "--json")
    data = json.loads(out)
    assert code == 0 and (data["output"], data["run_id"], data["task"]) == ("more [details]", run_id, "details?")
    assert read_transcript(Path(data["transcript"])).generations == 2

    code, out, err = run_cli("resume", "nope", "x")
    assert (code, out) == (2, "")
    assert err.startswith("error: no saved run 'nope' in ") and len(err.splitlines()) == 1


# -- any text reads back; a damaged file loses only its damaged records ---------------------------------

ODD_TEXT = "a\u2028b\u2029c\x85d"  # line breaks to str.splitlines, not to JSON


def test_any_text_round_trips_through_a_transcript(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    (tmp_path / "a.js").write_text(f"var s = '{ODD_TEXT}';\n", encoding="utf-8")
    script = [call("read", path="a.js"), call("grep", pattern="lone \ud800 surrogate"), f"seen {ODD_TEXT} \udfff"]
    code, _, _ = run_cli("run", "scout", "look", "-m", write_script(script), "-C", str(tmp_path))
    assert code == 0
    record = load_run("last")
    path = record.transcript_path(record.tasks[0])
    assert b"\\u2028" in path.read_bytes() and b"\\ud800" in path.read_bytes()

    log = read_transcript(path)
    assert log.skipped == []
    assert log.messages[3]["content"] == f"     1\tvar s = '{ODD_TEXT}';"
    assert log.messages[4]["tool_calls"][0]["function"]["arguments"] == {"pattern": "lone \ud800 surrogate"}
    assert log.messages[-1]["content"] == log.results[0].output == f"seen {ODD_TEXT} \udfff"

    code, out, _ = run_cli("show", record.run_id, "--json")
    assert code == 0 and json.loads(out)["transcripts"][0]["messages"] == log.messages
    assert run_cli("resume", "last", "more \ud800", "-m", write_script(["two"], "2.json"))[:2] == (0, "two\n")
    assert run_cli("chat", "--resume", "last", "--once", "x", "-m", write_script(["three"], "3.json"))[:2] == (
        0,
        "three\n",
    )
    log = read_transcript(path)
    assert (log.generations, log.skipped) == (3, [])
    assert [m["content"] for m in log.messages if m["role"] == "user"][1:] == ["more \ud800", "x"]


def test_a_damaged_transcript_loses_only_the_damaged_records(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    assert run_cli("run", "scout", "look", "-m", write_script(["one"]), "-C", str(tmp_path))[0] == 0
    record = load_run("last")
    path = record.transcript_path(record.tasks[0])
    lines = path.read_bytes().split(b"\n")
    bad = [
        b"[]",
        b'{"type": "messages", "generation": 1, "messages": "not a list"}',
        b'{"type": "messages", "generation": 1, "messages": [1, 2]}',
        b'{"type": "result", "generation": 1, "result": {"status": "?"}}',
        b'{"type": "event", "generation": "2"}',
    ]
    # Damaged records after the good ones, then a crash cutting the last record (the result) in half.
    path.write_bytes(b"\n".join([*lines[:-2], *bad, lines[-2][:40]]))

    log = read_transcript(path)
    assert log.messages[-1]["content"] == "one" and log.results == []
    n = len(lines) - 1  # the first damaged line
    assert log.skipped == [
        f"line {n}: a JSON list, not a record object",
        f"line {n + 1}: messages record: 'messages': Input should be a valid list",
        f"line {n + 2}: messages record: 'messages.0': Input should be a JSON object",
        log.skipped[3],
        f"line {n + 4}: event record: 'generation' is not a positive whole number",
        f"line {n + 5}: not valid JSON (cut short?)",
    ]
    assert log.skipped[3].startswith(f"line {n + 3}: result record: 'result.")

    code, out, _ = run_cli("show", "last")
    assert code == 0 and f"skipped 6 damaged line(s) of the transcript: line {n}: a JSON list" in out
    assert "assistant: one" in out
    assert run_cli("resume", "last", "again", "-m", write_script(["two"], "2.json"))[:2] == (0, "two\n")
    assert run_cli("chat", "--resume", "last", "--once", "x", "-m", write_script(["three"], "3.json"))[:2] == (
        0,
        "three\n",
    )
    log = read_transcript(path)
    assert len(log.skipped) == 6  # the record appended after the cut line starts on a line of its own
    assert [m["content"] for m in log.messages if m["role"] == "assistant"] == ["one", "two", "three"]
    assert [r.output for r in log.results] == ["two", "three"]


def test_a_transcript_with_no_readable_task_record_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'[]\n{"type": "task", "generation": 1}\n\xff\xfe\n')
    with pytest.raises(RunNotFoundError, match=r"t.jsonl: not a task transcript \(no readable 'task' record\)$"):
        read_transcript(path)


def test_names_with_bytes_that_are_not_utf8_read_back(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    # Python reads such bytes in argv and paths as lone surrogates (surrogateescape).
    folder = tmp_path / "caf\udce9"
    folder.mkdir()
    code, out, _ = run_cli("run", "scout", "look at caf\udce9", "-m", write_script(["seen"]), "-C", str(folder))
    assert (code, out) == (0, "seen\n")
    record = load_run("last")
    assert record.cwd == str(folder.resolve())
    assert read_transcript(record.transcript_path(record.tasks[0])).meta["task"] == "look at caf\udce9"
    assert [r.run_id for r in list_runs()] == [record.run_id]
    assert run_cli("show", "last")[0] == 0
    assert run_cli("resume", "last", "more", "-m", write_script(["two"], "2.json"))[:2] == (0, "two\n")
    assert read_transcript(record.transcript_path(record.tasks[0])).generations == 2


def test_a_fifo_or_damaged_file_in_a_runs_place_is_one_line_and_never_blocks(
    scripted_runner: Any, run_cli: Any
) -> None:
    ids = [go(scripted_runner(["x"]), "run", TaskSpec("scout", str(i))).run_id for i in range(2)]
    fifo_run, damaged_run = (load_run(i) for i in ids)
    transcript = fifo_run.transcript_path(fifo_run.tasks[0])
    transcript.unlink()
    os.mkfifo(transcript)  # a plain read would wait for a writer forever
    (damaged_run.folder / "run.json").write_bytes(b"\xff\xfe not a record")

    with pytest.raises(RunNotFoundError) as fifo:
        read_transcript(transcript)
    with pytest.raises(RunNotFoundError) as damaged:
        load_run(damaged_run.run_id)
    code, _, err = run_cli("show", fifo_run.run_id)

    assert (
        str(fifo.value)
        == f"{transcript}: not a regular file (a FIFO, device or socket); a transcript must be a regular file"
    )
    assert str(damaged.value) == (
        f"{damaged_run.folder / 'run.json'}: cannot read the run record: it is not UTF-8 text; save it as UTF-8"
    )
    assert [r.run_id for r in list_runs()] == [fifo_run.run_id]  # the damaged one skipped
    assert (code, err) == (2, f"error: {fifo.value}\n")
