"""The models a delegated call may name (issue 44, item 2): only the granted ones (its file's `models:`,
`--allow-model`, imported and the run's own), offered by name in the tool's schema; one whose weights do
not fit the memory left is refused before it loads; the `models` form lists them and what each agent
runs on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.mcp_server.run_agents import run_schema
from mlx_subagents.runs.model_grants import describe_models
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.runs.prepared import Parent
from mlx_subagents.runs.runner import Runner
from mlx_subagents.runs.tasks import MODEL_ENV, ModelRef
from mlx_subagents.runs.transcripts import load_run, read_transcript
from mlx_subagents.tools import Workspace
from tests.helpers import call, make_runner, run_parent, scripted_host, write_agent


def tool_messages(run_id: str) -> list[str]:
    record = load_run(run_id)
    return [
        m["content"] for m in read_transcript(record.transcript_path(record.tasks[0])).messages if m["role"] == "tool"
    ]


def test_a_call_may_name_only_granted_models_and_the_schema_offers_them_by_name(
    tmp_path: Path, write_script: Any, run_cli: Any
) -> None:
    other = write_script({"agents": {"scout": {"replies": ["found on the other model"]}}}, "other.json")
    allowed = write_script({"agents": {"scout": {"replies": ["found on the allowed model"]}}}, "allowed.json")
    lead = write_agent(tmp_path, "lead", "read, subagent", f"models: {other}\n")
    tasks = [
        {"agent": "scout", "task": "look", "model": other, "label": "granted"},
        {"agent": "scout", "task": "look", "model": allowed, "label": "operator"},
        {"agent": "scout", "task": "look", "model": str(tmp_path / "elsewhere"), "label": "outside"},
    ]
    model = write_script({"agents": {"lead": {"replies": [call("subagent", tasks=tasks), "done"]}}})

    code, out, err = run_cli("run", "lead", "go", "-m", model, "-C", str(tmp_path), "-y", "--allow-model", allowed)

    assert (code, out) == (0, "done\n"), err
    [parallel] = tool_messages("last")
    assert "### [granted] completed\nfound on the other model" in parallel
    assert "### [operator] completed\nfound on the allowed model" in parallel
    assert (
        f"### [outside] failed (error): model '{tmp_path / 'elsewhere'}' is not granted to 'lead': it may name "
        f"{other}, {allowed}, {model}; grant more with models: in {lead}, --allow-model NAME, or `subagent models "
        "import`, or leave model out"
    ) in parallel


def test_the_schema_offers_the_grants_on_this_machine_as_an_enum_and_nothing_when_only_the_runs_model_is_granted(
    tmp_path: Path, tiny_qwen3_path: Path
) -> None:
    """The enum offered models not on the machine (qwen-b, ops-model): a call naming one was refused."""
    host = scripted_host(["x"])
    lead = write_agent(tmp_path, "lead", "read, subagent", f"models: {tiny_qwen3_path}, qwen-b\n")
    plain = write_agent(tmp_path, "plain", "read, subagent")
    runner = make_runner(tmp_path, host, assume_yes=True, allow_models=("ops-model",))
    bare = make_runner(tmp_path, host, assume_yes=True)

    def schema(r: Any, name: str) -> dict[str, Any]:
        parent = Parent(r.catalog.get(name), name, 0, ModelRef(host.model_id), None)
        return r.board_tools(parent, Workspace(tmp_path))["subagent"].schema()["function"]["parameters"]

    offered = ["", str(tiny_qwen3_path), host.model_id]
    params = schema(runner, "lead")
    assert params["properties"]["model"]["enum"] == offered
    assert params["properties"]["tasks"]["items"]["properties"]["model"]["enum"] == offered
    assert params["properties"]["steps"]["items"]["properties"]["model"]["enum"] == offered
    assert "models" in params["properties"]
    # Only the run's own model is granted: no choice, so neither field costs the model's context.
    assert not {"model", "models"} & set(schema(bare, "plain")["properties"])
    assert "model" not in schema(bare, "plain")["properties"]["tasks"]["items"]["properties"]
    # An MCP client may name what the operator granted, offered the same way.
    assert run_schema(runner)["properties"]["model"]["enum"] == ["", host.model_id]
    assert lead.is_file() and plain.is_file()


@pytest.mark.slow
def test_weights_that_do_not_fit_the_memory_left_are_refused_before_anything_loads(
    tmp_path: Path, tiny_qwen3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = tmp_path / "big-model"
    shutil.copytree(tiny_qwen3_path, big)
    weights = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    monkeypatch.setattr("mlx_subagents.host.kv.budget.total_memory", lambda: weights - 1024)
    loads: list[str] = []
    monkeypatch.setattr("mlx_subagents.host.mlx.mlx_host.MlxModelHost.start", lambda self: loads.append("loaded"))
    script = {
        "agents": {"orchestrator": {"replies": [call("subagent", agent="scout", task="look", model=str(big)), "ok"]}}
    }
    host = scripted_host(script)
    result = run_parent(make_runner(tmp_path, host, allow_models=(str(big),)))

    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    assert tool_messages(result.run_id) == [
        f"Error: subagent call refused: model '{big}' needs {mib(weights)} for its weights, more than the "
        f"{mib(weights - 1024)} of memory left ({mib(weights - 1024)} in all); name a smaller model, or leave model out"
    ]
    assert loads == []  # refused before it loaded


@pytest.mark.slow
def test_the_models_form_lists_each_granted_model_and_what_each_agent_runs_on(
    tmp_path: Path, tiny_qwen3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_agent(tmp_path, "lead", "read, subagent", f"agents: scout, pinned\nmodels: {tiny_qwen3_path}\n")
    write_agent(tmp_path, "pinned", "read", f"model: {tiny_qwen3_path}\n")
    host = scripted_host({"agents": {"lead": {"replies": [call("subagent", models=True), "ok"]}}})
    monkeypatch.setenv(MODEL_ENV, host.model_id)  # no --model: each agent runs on what its file or parent says
    runner = Runner(tmp_path, RunOptions(assume_yes=True), hosts={host.model_id: host})
    result = run_parent(runner, agent="lead")

    size = sum(f.stat().st_size for f in tiny_qwen3_path.rglob("*") if f.is_file()) / 2**20
    config = json.loads((tiny_qwen3_path / "config.json").read_text())
    assert tool_messages(result.run_id) == [
        'Models you may name (the "model" field):\n'
        f"- {tiny_qwen3_path}: not loaded; context {config['max_position_embeddings']:,} tokens, native tools, "
        f"{size:.1f} MiB; fits this machine\n"
        f"- {host.model_id}: resident; context {host.context_window:,} tokens, {host.tool_mode} tools\n"
        "What each agent runs on when you name no model:\n"
        f"- scout: {host.model_id} (yours: it runs on its parent's model)\n"
        f"- pinned: {tiny_qwen3_path} (its file's model:)"
    ]


def test_the_models_form_lists_the_runs_own_model_when_nothing_else_is_granted(tmp_path: Path) -> None:
    """Nothing but the run's own model is granted, so the schema offers no enum; the `models` form still
    lists it, as the refusal of another model does (it said "no models are granted here")."""
    script = {
        "agents": {
            "orchestrator": {
                "replies": [call("subagent", models=True), call("subagent", agent="scout", task="x", model="a/b"), "ok"]
            }
        }
    }
    host = scripted_host(script)
    result = run_parent(make_runner(tmp_path, host))
    listed, refused = tool_messages(result.run_id)
    assert listed.splitlines()[:2] == [
        'Models you may name (the "model" field):',
        f"- {host.model_id}: resident; context {host.context_window:,} tokens, {host.tool_mode} tools",
    ]
    assert refused.startswith(
        f"Error: subagent call refused: model 'a/b' is not granted to 'orchestrator': it may name {host.model_id};"
    )
    # On an engine nothing is granted (a task's own model cannot be checked there): the form says so.
    assert describe_models((), {}, [("scout", "qwen", "the run's --model on http://e/v1")]).splitlines() == [
        "No model may be named here: this run's models are its engine's; leave model out.",
        "What each agent runs on when you name no model:",
        "- scout: qwen (the run's --model on http://e/v1)",
    ]
