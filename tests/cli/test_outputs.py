"""What the commands print and where, as the docs say: the shape of each `--json`, stdout with
`--events`, a remote model name refused. Each of these once differed from the docs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.main import get_command

from mlx_subagents.cli import app
from tests.helpers import REPO, call

DOCS = REPO / "docs"


def _json_help(command: list[str]) -> str:
    group: Any = get_command(app)
    for name in command:
        group = group.commands[name] if hasattr(group, "commands") else group
    return next(p.help for p in group.params if p.opts == ["--json"])


def test_each_json_prints_what_its_help_says_a_list_or_an_object(tmp_path: Path, run_cli: Any) -> None:
    """`agents --json` and `skills --json` print a list, though their help said "one object"."""
    for command in (["agents"], ["skills"], ["runs"], ["workflows"], ["models"], ["worktrees"], ["cache"], ["watch"]):
        code, out, err = run_cli(
            *command, "--json", *(["-C", str(tmp_path)] if command[0] in ("agents", "skills", "workflows") else [])
        )
        assert code == 0, (command, err)
        data = json.loads(out)
        said = _json_help(command)
        expected = (
            "Print one JSON list instead of text."
            if isinstance(data, list)
            else "Print one JSON object instead of text."
        )
        assert (command, said) == (command, expected)


def test_with_events_stdout_holds_only_json_and_the_answer_goes_to_stderr(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    script = write_script([call("ls", path="."), "Findings: none\n\nSummary: empty."])
    code, out, err = run_cli("run", "scout", "look", "--model", script, "-C", str(tmp_path), "--events")
    assert code == 0
    kinds = [json.loads(line)["kind"] for line in out.splitlines()]
    assert kinds[0] == "task_start" and kinds[-1] == "task_end"
    assert "Findings: none\n\nSummary: empty.\n" in err  # and every line of stdout was an event
    page = (DOCS / "runs.md").read_text(encoding="utf-8")
    assert "With `--events`, stdout holds only JSON lines" in " ".join(page.split())


def test_a_remote_model_on_the_command_line_is_refused_as_in_an_agent_file(tmp_path: Path, run_cli: Any) -> None:
    """`--model openai/gpt-4o` was looked up as a Hugging Face repo (and downloaded, when online)."""
    code, out, err = run_cli("run", "scout", "look", "--model", "openai/gpt-4o", "-C", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == (
        "error: --model: 'openai/gpt-4o' is a remote 'openai' model; only local MLX models run here; use a local "
        "folder, an MLX hub id, an imported name, mlx/openai/gpt-4o if it is a Hugging Face repo, or --engine URL "
        "for a model an OpenAI-compatible server runs\n"
    )


def test_the_help_gives_each_command_its_summary_on_one_line_and_no_type_after_a_flag(
    run_cli: Any, monkeypatch: Any
) -> None:
    """The command list broke a summary where its docstring's line ended ("what each" / "does ..."), and
    every flag showed `<bool>` though it takes no value."""
    import inspect

    monkeypatch.setenv("COLUMNS", "400")
    code, out, _ = run_cli("--help")
    assert code == 0 and "<bool>" not in out
    summaries = {}
    for line in out.splitlines():
        if line.startswith("│ ") and "  " in line[2:].strip():
            name, _, text = line[2:].strip(" │").partition(" ")
            summaries[name] = text.strip()
    for name in ("watch", "doctor", "mcp", "models"):
        assert name in summaries
    from mlx_subagents.cli.commands.runs import watch

    assert summaries["watch"] == " ".join(inspect.cleandoc(watch.__doc__ or "").split("\n\n")[0].split())
    code, out, _ = run_cli("run", "--help")
    assert code == 0 and "<bool>" not in out and "--json  " in out
