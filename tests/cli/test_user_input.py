"""What a user hands over - sizes, the state folder, schema, script, tasks and workflow files - and the one
line each bad one gets from the CLI (exit 2, nothing run, no traceback)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from mlx_subagents.agents.discovery import discover_agents
from mlx_subagents.agents.schema_output import AnswerMismatch, parse_answer
from mlx_subagents.errors import SubagentError
from mlx_subagents.host import parse_bytes
from mlx_subagents.host.kv.budget import total_memory
from mlx_subagents.runs.transcripts import runs_dir
from mlx_subagents.userfiles import MAX_NESTING, MAX_VALUES, measure

SIZE_FIX = "is not a size; use e.g. 4GB, 512MiB, 0 (unbounded) or 0.25 (of RAM)"


@pytest.mark.parametrize(
    ("text", "n_bytes"),
    [
        ("4GB", 4 * 10**9),
        ("4 gb", 4 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("512m", 512 * 2**20),  # a bare letter is binary, as in `docker -m 512m`
        ("2k", 2048),
        ("1e9", 10**9),
        ("0", 0),
        (None, None),
        (1234, 1234),
    ],
)
def test_sizes_in_the_documented_forms(text: str | int | None, n_bytes: int | None) -> None:
    assert parse_bytes(text) == n_bytes


def test_a_fraction_is_a_share_of_ram() -> None:
    assert parse_bytes("0.25") == int(0.25 * total_memory())


@pytest.mark.parametrize("text", ["abc", "4XB", "-1GB", "-5", "inf", "nan", ""])
def test_a_bad_size_is_one_line(text: str) -> None:
    with pytest.raises(SubagentError) as info:
        parse_bytes(text)
    assert str(info.value) == f"KV budget {text!r} {SIZE_FIX}"


def test_a_bad_kv_budget_through_the_cli(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    model = write_script(["done"])
    code, out, err = run_cli("run", "scout", "hi", "-m", model, "-C", str(tmp_path), "--kv-budget", "4XB")
    assert (code, out, err) == (2, "", f"error: KV budget '4XB' {SIZE_FIX}\n")


# --- the state folder --------------------------------------------------------------------------------


def test_a_state_folder_that_is_a_file_is_one_line(
    tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    home.write_text("not a folder")
    monkeypatch.setenv("MLX_SUBAGENTS_HOME", str(home))
    code, out, err = run_cli("run", "scout", "hi", "-m", write_script(["done"]), "-C", str(tmp_path))
    assert (code, out) == (2, "")
    assert err == (
        f"error: cannot save in the state folder {home}: Not a directory; set MLX_SUBAGENTS_HOME to a writable folder\n"
    )
    assert home.read_text() == "not a folder"


def test_a_state_folder_that_cannot_be_written_is_one_line(
    tmp_path: Path, write_script: Any, run_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /sys refuses new folders even to root (tests and CI run as root, so a chmod would not do).
    home = Path("/sys/mlx-subagents-home")
    try:
        (home / "runs").mkdir(parents=True)
    except OSError as exc:
        reason = exc.strerror
    monkeypatch.setenv("MLX_SUBAGENTS_HOME", str(home))
    code, out, err = run_cli("parallel", "-t", "scout", "a", "-t", "planner", "b", "-m", write_script(["done"]))
    assert (code, out) == (2, "")
    assert (
        err == f"error: cannot save in the state folder {home}: {reason}; set MLX_SUBAGENTS_HOME to a writable folder\n"
    )
    assert not home.exists()


# --- schemas whose $ref goes nowhere -------------------------------------------------------------------


REF_FIX = "point it at a part of this schema, e.g. '#/$defs/NAME' (other files and URLs are not fetched)"


@pytest.mark.parametrize("ref", ["#/$defs/missing", "other.json", "https://example.com/schema.json"])
def test_a_schema_ref_that_cannot_be_resolved_is_refused_up_front(
    tmp_path: Path, write_script: Any, run_cli: Any, ref: str
) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps({"type": "object", "$defs": {"file": {"type": "string"}}, "properties": {"a": {"$ref": ref}}})
    )
    code, out, err = run_cli(
        "run", "scout", "hi", "-m", write_script(["{}"]), "-C", str(tmp_path), "--schema", str(schema)
    )
    assert (code, out, err) == (2, "", f"error: {schema}: $ref '{ref}' cannot be resolved; {REF_FIX}\n")
    assert not runs_dir().exists()


def test_schema_refs_that_resolve_are_accepted(tmp_path: Path, write_script: Any, run_cli: Any) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "$defs": {"file": {"type": "string"}, "list": {"type": "array", "items": {"$ref": "#/$defs/file"}}},
                "properties": {"files": {"$ref": "#/$defs/list"}},
            }
        )
    )
    model = write_script(['{"files": ["a.py"]}'])
    code, out, err = run_cli("run", "scout", "hi", "-m", model, "-C", str(tmp_path), "--schema", str(schema), "--json")
    assert code == 0, err
    assert json.loads(out)["parsed"] == {"files": ["a.py"]}


# --- data nested too deeply ------------------------------------------------------------------------------

TOO_DEEP = f"the data is nested more than {MAX_NESTING} levels deep; flatten it"
# Deep enough to overflow every parser's recursion, and deep enough to pass the parsers but not the cap.
OVERFLOW = 100_000
PAST_CAP = MAX_NESTING + 1


def nested_json(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.slow
@pytest.mark.parametrize("depth", [OVERFLOW, PAST_CAP])
@pytest.mark.parametrize("kind", ["script.json", "script.yaml", "schema", "tasks", "workflow"])
def test_deeply_nested_files_are_one_line(
    tmp_path: Path, write_script: Any, run_cli: Any, kind: str, depth: int
) -> None:
    data = nested_json(depth)
    model = write_script(["done"])
    if kind.startswith("script"):
        path = tmp_path / kind
        path.write_text('[{"tool_calls": [{"name": "ls", "arguments": {"path": ' + data + "}}]}]")
        args = ["run", "scout", "hi", "-m", f"scripted:{path}"]
    elif kind == "schema":
        path = tmp_path / "schema.json"
        path.write_text('{"type": "object", "properties": {"a": {"enum": ' + data + "}}}")
        args = ["run", "scout", "hi", "-m", model, "--schema", str(path)]
    elif kind == "tasks":
        path = tmp_path / "tasks.yaml"
        path.write_text(f"- agent: scout\n  task: {data}\n")
        args = ["parallel", "-f", str(path), "-m", model]
    else:
        path = tmp_path / "flow.toml"
        path.write_text(f'[[steps]]\nid = "a"\nagent = "scout"\nprompt = "p"\nneeds = {data}\n')
        args = ["workflow", str(path), "-m", model]
    code, out, err = run_cli(*args, "-C", str(tmp_path))
    assert (code, out, err) == (2, "", f"error: {path}: {TOO_DEEP}\n")
    assert not runs_dir().exists()


# A "billion laughs" file: ten levels of ten aliases of the level below, 10^10 values once expanded.
LAUGHS = "".join(
    f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10) if i else ', '.join(['ha'] * 10)}]\n" for i in range(10)
)
TOO_MANY = f"the data expands to more than {MAX_VALUES:,} values (YAML aliases repeat parts); write it without aliases"


def test_measure_counts_shared_parts_each_time_without_expanding_them() -> None:
    assert measure(None) == (0, 1)
    assert measure({"a": [1, [2]], "b": "x"}) == (3, 6)
    sizes = [11]  # l0: a list of ten values; each next level: a list of ten of the level below
    for _ in range(9):
        sizes.append(1 + 10 * sizes[-1])
    assert measure(yaml.safe_load(LAUGHS)) == (11, 1 + sum(sizes))
    assert measure(yaml.safe_load("a: &a [1, *a]"))[0] == math.inf


@pytest.mark.parametrize(
    ("kind", "text", "problem"),
    [
        ("tasks.yaml", f"tasks:\n  - agent: scout\n    task: hi\nextra:\n{textwrap.indent(LAUGHS, '  ')}", TOO_MANY),
        ("script.yaml", "replies: &r\n  - content: done\n  - *r\n", TOO_DEEP),
    ],
)
def test_yaml_aliases_cannot_blow_up_a_file(
    tmp_path: Path, write_script: Any, run_cli: Any, kind: str, text: str, problem: str
) -> None:
    path = tmp_path / kind
    path.write_text(text)
    if kind == "tasks.yaml":
        args = ["parallel", "-f", str(path), "-m", write_script(["done"])]
    else:
        args = ["run", "scout", "hi", "-m", f"scripted:{path}"]
    code, out, err = run_cli(*args, "-C", str(tmp_path))
    assert (code, out, err) == (2, "", f"error: {path}: {problem}\n")


def test_an_agent_file_with_an_alias_bomb_is_skipped_not_expanded(tmp_path: Path) -> None:
    folder = tmp_path / ".mlx-subagents" / "agents"
    folder.mkdir(parents=True)
    path = folder / "laughs.md"
    path.write_text(f"---\nname: laughs\ndescription: D.\n{LAUGHS}---\nBody.\n")
    catalog = discover_agents(tmp_path, scope="project")
    assert catalog.warnings == [f"skipped {path}: in the frontmatter, {TOO_MANY}"]


@pytest.mark.parametrize("depth", [OVERFLOW, PAST_CAP])
def test_deep_json_in_a_string_is_caught_too(tmp_path: Path, run_cli: Any, depth: int) -> None:
    path = tmp_path / "script.json"
    path.write_text(json.dumps([{"tool_calls": [{"name": "ls", "arguments": nested_json(depth)}]}]))
    code, out, err = run_cli("run", "scout", "hi", "-m", f"scripted:{path}", "-C", str(tmp_path))
    assert (code, out, err) == (2, "", f"error: {path}: replies[0].tool_calls[0].arguments: {TOO_DEEP}\n")


@pytest.mark.parametrize("depth", [OVERFLOW, PAST_CAP])
def test_a_deep_answer_is_a_mismatch_the_model_can_fix(depth: int) -> None:
    with pytest.raises(AnswerMismatch) as info:
        parse_answer(nested_json(depth), {"type": "array"})
    assert str(info.value) == f"the answer is too large to check: {TOO_DEEP}"


def test_a_date_that_does_not_exist_in_a_tasks_file_is_one_line(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    path = tmp_path / "tasks.yaml"
    path.write_text("- agent: scout\n  task: 2024-13-45\n")
    code, out, err = run_cli("parallel", "-f", str(path), "-m", write_script(["done"]), "-C", str(tmp_path))
    assert (code, out, err) == (2, "", f"error: {path}: invalid YAML: month must be in 1..12\n")
