"""The endpoints' client table (one client per API and User-Agent) stays bounded, and the local models a
request may load fit beside the resident ones, in process."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from mlx_subagents.host.mlx.loading import imported_models_dir
from mlx_subagents.models.catalog import folder_size
from mlx_subagents.runs.options import RunOptions
from mlx_subagents.serve import endpoints
from mlx_subagents.serve.api_errors import ApiError
from mlx_subagents.serve.endpoints import ApiFront
from mlx_subagents.serve.service import ServeConfig, Service
from mlx_subagents.serve.state import serve_paths


def scope(agent: str) -> dict[str, object]:
    return {"headers": [(b"user-agent", agent.encode())]}


def test_the_client_table_forgets_the_client_idle_the_longest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each new User-Agent past the bound forgets the least recently used idle client, never one being
    answered: the table and the server's client list stay at the bound however many agents a caller invents."""
    monkeypatch.setattr(endpoints, "MAX_API_CLIENTS", 3)
    service = Service(ServeConfig(RunOptions(), cwd=tmp_path, port=None), serve_paths(tmp_path), "token")
    front = ApiFront(service)
    first, second, third = (front.client("openai", scope(f"tool/{i}")) for i in range(3))
    first.serving = 1  # answering a request now: kept, though the least recently used
    assert front.client("openai", scope("tool/2")) is third  # the same client again: now the most recent
    front.client("openai", scope("tool/3"))
    assert [c.name for c in front.clients.values()] == ["tool/0", "tool/2", "tool/3"]
    first.serving = 0
    for i in range(4, 40):
        front.client("anthropic", scope(f"tool/{i}"))
    assert [c.name for c in front.clients.values()] == ["tool/37", "tool/38", "tool/39"]
    assert sorted(c.name for c in service.clients) == ["tool/37", "tool/38", "tool/39"]
    assert second.id not in service.clients.all


def test_a_local_model_that_does_not_fit_beside_the_resident_ones_is_refused_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen3_path: Path
) -> None:
    """A request may name any local model, and a model loaded stays resident: one that cannot fit in RAM
    beside the models held is refused in one line (503) before anything loads, so that naming every local
    model in turn cannot make the server hold them all."""
    shutil.copytree(tiny_qwen3_path, imported_models_dir() / "tiny")
    size = folder_size(imported_models_dir() / "tiny")
    service = Service(ServeConfig(RunOptions(), cwd=tmp_path, port=None), serve_paths(tmp_path), "token")
    front = ApiFront(service)
    monkeypatch.setattr(endpoints, "total_memory", lambda: size - 1)
    listed: list[int] = []  # the catalog's listings: each reads every local model's folder
    catalog = endpoints.list_models
    monkeypatch.setattr(endpoints, "list_models", lambda: listed.append(1) or catalog())
    with pytest.raises(ApiError) as refused:
        asyncio.run(front.host_for("tiny"))
    assert len(listed) == 1  # once per request: it was listed for the name, then again for the size
    assert (refused.value.status, refused.value.param) == (503, "model")
    assert refused.value.message == (
        f"model 'tiny' ({size / 2**30:.1f} GiB of weights) does not fit beside the models this server holds "
        f"(0.0 GiB) in this machine's {(size - 1) / 2**30:.1f} GiB of RAM; name a model it holds, or restart it "
        "with --model tiny"
    )
    assert service.pool.hosts == {}
    with pytest.raises(ApiError) as unknown:
        asyncio.run(front.host_for("nope"))
    assert (unknown.value.status, len(listed)) == (404, 2)
    assert unknown.value.message == (
        "model 'nope' is not served here (GET /v1/models lists them: tiny); name one of them"
    )
