"""`EngineHost` against a real engine process: `mlx_lm.server` serving the tiny model on 127.0.0.1.

The random model emits noise, so these tests assert structure (finish reasons, usage, the
prefix cache, the server's own log), not text. Replies are kept to a few tokens.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.host.engine.engine_host import EngineHost
from mlx_subagents.host.protocol import DEFAULT_CONTEXT_WINDOW, GenerateArgs
from tests.helpers import texts

pytestmark = [pytest.mark.slow, pytest.mark.process]  # the module's fixture starts `mlx_lm.server`

START_TIMEOUT = 120.0
SYSTEM = {"role": "system", "content": "You are a scout. Answer in one line."}


@dataclass(frozen=True)
class Server:
    url: str
    model: str
    log: Path

    def debug_lines(self) -> int:
        """mlx_lm.server logs every generated token at DEBUG level: a count of work done."""
        return self.log.read_text(errors="replace").count(" - DEBUG - ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tiny_qwen3_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("engine-server")
    (home / "hf" / "hub").mkdir(parents=True)  # the server's model listing scans this cache
    env = {**os.environ, "HF_HOME": str(home / "hf"), "HF_HUB_OFFLINE": "1"}
    port, model, log = free_port(), str(tiny_qwen3_path.resolve()), home / "server.log"
    command = [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen([*command, "--log-level", "DEBUG"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until_healthy(process, port, log)
        yield Server(f"http://127.0.0.1:{port}/v1", model, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_until_healthy(process: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"mlx_lm.server exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"mlx_lm.server did not come up within {START_TIMEOUT:g} s:\n{log.read_text()[-2000:]}")


def run(coro: Any, timeout: float = 120) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_a_streamed_reply_completes_with_the_engines_usage(server: Server) -> None:
    pieces: list[str] = []

    async def go() -> Any:
        async with EngineHost(server.url, server.model) as host:
            assert host.context_window == DEFAULT_CONTEXT_WINDOW  # mlx_lm.server lists no window
            assert await host.served_models() == [server.model]
            messages = [SYSTEM, {"role": "user", "content": "where is auth handled?"}]
            return await host.session("s").generate(messages, GenerateArgs(max_tokens=8, on_event=texts(pieces.append)))

    reply = run(go())
    assert reply.finish_reason in ("length", "stop")
    assert 0 < reply.usage.generated_tokens <= 8
    assert reply.usage.generated_tokens == 8 or reply.finish_reason == "stop"
    assert reply.usage.prompt_tokens > 10 and reply.usage.cached_tokens == 0
    assert reply.usage.prefilled_tokens == reply.usage.prompt_tokens
    assert len(pieces) > 1 and "".join(pieces) == reply.raw_text  # streamed, not one block


def test_a_sessions_next_turn_hits_the_engines_prefix_cache(server: Server) -> None:
    async def go() -> tuple[Any, Any]:
        async with EngineHost(server.url, server.model) as host:
            session = host.session("s")
            messages = [SYSTEM, {"role": "user", "content": "list the tests folder"}]
            first = await session.generate(messages, GenerateArgs(max_tokens=4))
            messages += [first.to_message(), {"role": "user", "content": "and the docs folder"}]
            return first, await session.generate(messages, GenerateArgs(max_tokens=4))

    first, second = run(go())
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.cached_tokens >= first.usage.prompt_tokens - 2  # at least the whole first prompt
    assert second.usage.prefilled_tokens == second.usage.prompt_tokens - second.usage.cached_tokens


def test_cancelling_a_reply_stops_the_servers_stream(server: Server) -> None:
    async def go() -> None:
        started = asyncio.Event()
        async with EngineHost(server.url, server.model) as host:
            messages = [SYSTEM, {"role": "user", "content": "write a very long essay"}]
            task = asyncio.create_task(
                host.session("s").generate(
                    messages, GenerateArgs(max_tokens=3000, on_event=texts(lambda _: started.set()))
                )
            )
            await asyncio.wait_for(started.wait(), 60)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    before = server.debug_lines()
    run(go())
    closed = ("BrokenPipeError", "ConnectionResetError")  # the server saw the stream closed (either way)
    deadline = time.monotonic() + 20
    while not any(c in server.log.read_text(errors="replace") for c in closed) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert any(c in server.log.read_text(errors="replace") for c in closed)
    stopped_at = server.debug_lines()
    time.sleep(1.5)
    assert server.debug_lines() == stopped_at < before + 3000  # and generates nothing more


def test_four_concurrent_sessions_all_complete(server: Server) -> None:
    async def go() -> list[Any]:
        async with EngineHost(server.url, server.model) as host:
            replies = [
                host.session(f"child-{i}").generate(
                    [SYSTEM, {"role": "user", "content": f"task {i}"}], GenerateArgs(max_tokens=6)
                )
                for i in range(4)
            ]
            return await asyncio.gather(*replies)

    replies = run(go())
    assert len(replies) == 4
    for reply in replies:
        assert reply.finish_reason in ("length", "stop")
        assert 0 < reply.usage.generated_tokens <= 6 and reply.usage.prompt_tokens > 5
