"""Model resolution: every failure a user can fix is one line that says what to do."""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import ModelNotFoundError, RequestError
from mlx_subagents.host import MlxModelHost, make_host
from mlx_subagents.host.mlx.loading import config_context_window, cpu_download_note, resolve_model_path
from mlx_subagents.host.scripted import ScriptedHost
from mlx_subagents.shipped import demo_dir


def test_missing_local_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path(str(missing))
    assert str(info.value) == (
        f"model folder {missing} does not exist; pass an existing folder or a hub id like "
        "mlx-community/Qwen3-4B-Instruct-2507-4bit"
    )


def test_folder_without_weights(tmp_path: Path, tiny_qwen3_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen3_path, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(
        ModelNotFoundError, match=r"has no \*\.safetensors weights; download or convert the model into it$"
    ):
        resolve_model_path(str(folder))
    (folder / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        resolve_model_path(str(folder))


def test_hub_id_not_cached_while_offline() -> None:
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path("mlx-community/Qwen3-4B-Instruct-2507-4bit")
    message = str(info.value)
    assert message.startswith(
        "model 'mlx-community/Qwen3-4B-Instruct-2507-4bit' is not in the local Hugging Face cache"
    )
    assert "hf download mlx-community/Qwen3-4B-Instruct-2507-4bit" in message
    assert "\n" not in message


def test_mlx_prefix_and_local_load(tiny_qwen3_path: Path) -> None:
    async def go() -> tuple[str, Path | None]:
        async with MlxModelHost(f"mlx/{tiny_qwen3_path}") as host:
            return host.model_id, host.model_path

    model_id, path = asyncio.run(go())
    assert model_id == str(tiny_qwen3_path) and path == tiny_qwen3_path.resolve()


def test_host_start_failure_is_the_one_line_error(tmp_path: Path) -> None:
    async def go() -> None:
        async with MlxModelHost(str(tmp_path / "missing")):
            pass

    with pytest.raises(ModelNotFoundError, match="does not exist"):
        asyncio.run(go())


def test_context_window_from_nested_text_config() -> None:
    assert config_context_window({"max_position_embeddings": 4096}) == 4096
    assert config_context_window({"text_config": {"max_position_embeddings": 2048}}) == 2048
    assert config_context_window({}) is None


def test_make_host_picks_the_backend(tmp_path: Path) -> None:
    script = tmp_path / "s.json"
    script.write_text('{"replies": [{"content": "hi"}]}')
    assert isinstance(make_host(f"scripted:{script}"), ScriptedHost)
    assert isinstance(make_host("mlx-community/x"), MlxModelHost)


def test_hosts_are_chosen_by_kind_and_each_is_built_from_the_settings(tmp_path: Path) -> None:
    from mlx_subagents.host import HOST_CLASSES, HostSettings, SharedKVBudget, host_class, host_kind
    from mlx_subagents.host.engine.engine_host import EngineHost

    assert {kind: host_class(kind) for kind in HOST_CLASSES} == {
        "mlx": MlxModelHost,
        "engine": EngineHost,
        "scripted": ScriptedHost,
    }
    with pytest.raises(ValueError) as info:
        host_class("vllm")
    assert str(info.value) == "unknown host kind 'vllm'; the kinds: mlx, engine, scripted"
    assert [host_kind("mlx-community/x"), host_kind("scripted:s.json"), host_kind("m", "http://gpu:8000/v1")] == [
        "mlx",
        "scripted",
        "engine",
    ]

    def factory(name: str, ids: object) -> list[object]:
        return []

    budget = SharedKVBudget("1GB")
    settings = HostSettings(
        engine="http://gpu:8000/v1",
        api_key="k",
        start_timeout=5.0,
        context_window=2048,
        batching=False,
        kv_budget=budget,
        prefix_cache=0,
        prefill_slice=64,
        processor_factory=factory,
        draft="off",
    )
    mlx = MlxModelHost.from_settings("mlx-community/x", settings)
    assert (mlx.model_id, mlx.batching, mlx._window_override, mlx._shared, mlx._store_bytes, mlx.prefill_slice) == (
        "mlx-community/x",
        False,
        2048,
        budget,
        0,
        64,
    )
    assert mlx._processor_factory is factory and mlx.draft == "off"
    engine = EngineHost.from_settings("qwen3", settings)
    assert (engine.url, engine.model_id, engine.start_timeout, engine.context_window) == (
        "http://gpu:8000/v1",
        "qwen3",
        5.0,
        2048,
    )
    assert isinstance(make_host("qwen3", settings), EngineHost)
    with pytest.raises(ValueError) as info:
        EngineHost.from_settings("qwen3", HostSettings())
    assert str(info.value) == "an engine host needs the engine's URL; model 'qwen3' names none"
    script = tmp_path / "s.json"
    script.write_text('{"replies": [{"content": "hi"}]}')
    scripted = ScriptedHost.from_settings(f"scripted:{script}", settings)
    assert (scripted.path, scripted.context_window) == (script, 2048)


def test_a_runs_options_become_its_host_settings() -> None:
    from mlx_subagents.host import HostSettings, SharedKVBudget
    from mlx_subagents.runs.options import RunOptions

    options = RunOptions(batching=False, kv_budget=2**30, prefix_cache=0, context_window=0, timeout=9.0, api_key="k")
    assert options.host_settings() == HostSettings(
        api_key="k", start_timeout=9.0, context_window=None, batching=False, kv_budget=2**30, prefix_cache=0
    )
    assert RunOptions(prefill_slice="32").host_settings().prefill_slice == 32
    assert RunOptions().host_settings().prefill_slice == "auto"
    with pytest.raises(RequestError, match=r"^--prefill-slice 'soon' is not auto, off or a number of tokens; "):
        RunOptions(prefill_slice="soon")
    assert RunOptions(draft="Lookup").host_settings().draft == "lookup" and RunOptions().host_settings().draft == "auto"
    with pytest.raises(RequestError, match=r"^--draft 'always' is not auto, off or lookup; use e.g. auto$"):
        RunOptions(draft="always")
    budget = SharedKVBudget(2**30)
    assert options.host_settings("http://gpu:8000/v1", budget) == HostSettings(
        engine="http://gpu:8000/v1",
        api_key="k",
        start_timeout=9.0,
        batching=False,
        kv_budget=budget,
        prefix_cache=0,
    )


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`hub(answer)`: the Hugging Face hub reached at a local address, online; `answer` is what it says to a
    model's info (a JSON object), None for a hub that refuses every connection."""
    import huggingface_hub.constants as hf

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(hf, "HF_HUB_OFFLINE", False)
    servers: list[HTTPServer] = []
    refusing: list[socket.socket] = []

    def start(answer: dict[str, Any] | None) -> None:
        if answer is None:  # a port bound and never listening: refused at once, and no other process takes it
            refusing.append(socket.socket())
            refusing[-1].bind(("127.0.0.1", 0))
            monkeypatch.setattr(hf, "ENDPOINT", f"http://127.0.0.1:{refusing[-1].getsockname()[1]}")
            return

        class ModelInfo(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(answer).encode()
                self.send_response(200 if self.path.startswith("/api/models/") else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        server = HTTPServer(("127.0.0.1", 0), ModelInfo)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.setattr(hf, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")

    yield start
    for server in servers:
        server.shutdown()
    for held in refusing:
        held.close()


def test_a_download_on_a_cpu_says_first_what_it_costs_and_the_ways_that_take_seconds(
    hub: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """On Linux the first command headed for a 2.3 GB 4B model on the CPU without a word: one SmolLM2-135M
    turn took 3.6 minutes there. The line comes before the download, whether or not the hub answers."""
    import mlx.core as mx

    on_cpu = mx.default_device() == mx.cpu
    repo = "mlx-community/Qwen3-4B-Instruct-2507-4bit"
    hub(None)
    with pytest.raises(ModelNotFoundError, match=f"^model '{repo}' is not in the local cache and could not be"):
        resolve_model_path(repo)
    demo = shlex.quote(str(demo_dir()))  # the checkout's examples/demo here, the package's demo/ in a wheel
    replay = shlex.quote(f"scripted:{demo_dir() / 'replay.yaml'}")
    ways = (
        f". Without a model, a replay shows every command: subagent run scout 'where is auth handled?' -C {demo} "
        f"--model {replay}; for a real model in seconds, an engine: docs/engines.md (llama.cpp's server, --engine URL)"
    )
    unsized = "; mlx runs on this machine's CPU, where an agent's first turn takes minutes, or hours for a 4B model"
    assert caplog.messages == ([f"downloading {repo}{unsized}{ways}"] if on_cpu else [])
    siblings = [("model.safetensors", 2_262_000_000), ("config.json", 1_000), ("README.md", 9_000_000)]
    hub({"id": repo, "siblings": [{"rfilename": name, "size": size} for name, size in siblings]})
    sized = " (2.3 GB); mlx runs on this machine's CPU, where an agent's first turn of it takes about 91 minutes"
    expected = f"downloading {repo}{sized}{ways}"
    assert cpu_download_note(repo) == (expected if on_cpu else None)
