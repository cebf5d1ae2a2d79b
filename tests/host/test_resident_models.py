"""Several resident models in one runner: one KV budget between them, and a delegated child's model
must be on this machine (never downloaded mid-delegation). Real loads of tiny models; scripted parents."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents import Runner
from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.kv.budget import DEFAULT_BUDGET_FRACTION
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.runs.tasks import ModelRef
from tests.helpers import call, make_runner, run_parent, scripted_host

MIB = 2**20


@pytest.fixture
def two_models(tiny_qwen3_path: Path, tmp_path: Path) -> tuple[Path, Path]:
    """Two resident models: the tiny model in two folders (two hosts, weights of the same size)."""
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(tiny_qwen3_path, first)
    shutil.copytree(tiny_qwen3_path, second)
    return first, second


def weights(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


async def resident(runner: Any, path: Path) -> MlxModelHost:
    host = await runner.preparer.host_for(ModelRef(str(path)))
    assert isinstance(host, MlxModelHost)
    return host


async def fill(host: MlxModelHost, n_sessions: int, n_words: int) -> None:
    """`n_sessions` sessions with a long prompt each, left idle with their caches held."""

    async def one(i: int) -> None:
        text = " ".join(f"w{i}x{j}" for j in range(n_words))
        await host.session(f"s{i}").generate([{"role": "user", "content": text}], GenerateArgs(max_tokens=1))

    await asyncio.gather(*(one(i) for i in range(n_sessions)))


@pytest.mark.slow
def test_a_second_resident_model_takes_half_of_the_one_kv_budget(tmp_path: Path, two_models: Any) -> None:
    first, second = two_models
    runner = make_runner(tmp_path, str(first), kv_budget=4 * MIB, save_transcripts=False)

    async def go() -> None:
        a = await resident(runner, first)
        assert (a.kv_budget, a.context_window) == (4 * MIB, 1280)  # 512 bytes a token, for 5 sessions
        await fill(a, 6, 150)
        held = (await a.memory_stats()).kv_bytes_total
        assert held > 2 * MIB  # more than its share once a second model is resident
        b = await resident(runner, second)
        assert (a.kv_budget, b.kv_budget) == (2 * MIB, 2 * MIB)  # one budget: 4 MiB between them
        assert b.context_window == 512  # what 2 MiB holds for 5 sessions
        assert a.context_window == 1280  # a's sessions keep their window; admission keeps them in budget
        stats = await a.memory_stats()
        # The least recently used of six equal caches were spilled, as few as bring a within its share.
        kept = 6 - stats.pool["evictions"]
        assert stats.kv_bytes_total == held * kept // 6 <= 2 * MIB < held * (kept + 1) // 6
        # a's next turn is admitted within its share and the pair stays within the one budget
        await fill(a, 2, 150)
        assert (await a.memory_stats()).kv_bytes_total + (await b.memory_stats()).kv_bytes_total <= 4 * MIB
        await runner.preparer.close()

    asyncio.run(go())


def test_the_default_budget_counts_every_resident_models_weights(
    tmp_path: Path, two_models: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = two_models
    ram = 16 * 2**30
    monkeypatch.setattr("mlx_subagents.host.kv.budget.total_memory", lambda: ram)
    runner = make_runner(tmp_path, str(first), save_transcripts=False)

    async def go() -> None:
        a = await resident(runner, first)
        assert a.kv_budget == int((ram - weights(first)) * DEFAULT_BUDGET_FRACTION)  # as with one model alone
        b = await resident(runner, second)
        both = int((ram - weights(first) - weights(second)) * DEFAULT_BUDGET_FRACTION)
        assert (a.kv_budget, b.kv_budget) == (both // 2, both // 2)
        await runner.preparer.close()

    asyncio.run(go())


def test_a_share_too_small_for_the_second_model_refuses_it_and_keeps_the_first(tmp_path: Path, two_models: Any) -> None:
    first, second = two_models
    runner = make_runner(tmp_path, str(first), kv_budget=2 * MIB, save_transcripts=False)

    async def go() -> None:
        a = await resident(runner, first)
        with pytest.raises(Exception) as info:
            await resident(runner, second)
        assert str(info.value) == (
            f"the KV budget of 1 MiB (its share of 2 MiB across the resident models) holds only 0 tokens per "
            f"session for 5 sessions of {second}; raise --kv-budget"
        )
        assert a.kv_budget == 2 * MIB  # the first keeps its budget: the second never became resident
        assert list(runner.preparer.hosts) == [ModelRef(str(first))]
        await runner.preparer.close()

    asyncio.run(go())


REMOTE = "mlx-community/not-on-this-machine"


def remote_agent(home: Path) -> None:
    """A user agent whose file names a hub model that is not in the local cache, and a parent that may start it."""
    agents = home / "agents"
    agents.mkdir(parents=True)
    (agents / "remote.md").write_text(f"---\nname: remote\ndescription: remote agent\nmodel: {REMOTE}\n---\nDo it.\n")
    (agents / "lead.md").write_text(
        "---\nname: lead\ndescription: lead agent\nmodel: scripted:memory\ntools: ls, subagent\nagents: scout, remote\n---\n"
        "Delegate.\n"
    )


def test_a_child_on_a_model_that_is_not_local_is_refused_before_any_task_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # online: only the rule keeps it from downloading
    asked: list[bool] = []
    real = huggingface_hub.snapshot_download

    def snapshot_download(*args: Any, **kwargs: Any) -> Any:
        asked.append(bool(kwargs.get("local_files_only")))
        if not kwargs.get("local_files_only"):
            raise AssertionError("a download was started")
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    remote_agent(Path(os.environ["MLX_SUBAGENTS_HOME"]))
    chain = call("subagent", chain=[{"agent": "scout", "task": "look"}, {"agent": "remote", "task": "then this"}])
    host = scripted_host({"agents": {"lead": {"replies": [chain, "gave up"]}, "scout": {"replies": ["found it"]}}})
    # No --model: each agent's own model counts (the lead's is the scripted host, the scout inherits it).
    runner = Runner(cwd=tmp_path, options=RunOptions(scope="user"), hosts={host.model_id: host})
    result = run_parent(runner, agent="lead")

    assert result.output == "gave up"
    [sent] = [m for m in host.history["lead"][-1] if m["role"] == "tool"]
    assert sent["content"] == (
        f"Error: subagent call refused: model '{REMOTE}' is not in the local Hugging Face cache, and a model chosen "
        f"during a delegation is never downloaded; name a local model, or download it once while online (`hf "
        f"download {REMOTE}`) or pass a local folder"
    )
    assert "lead > scout" not in host.history  # refused before the first step started
    assert asked == [True]  # the cache was looked at, nothing downloaded
