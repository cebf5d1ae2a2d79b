"""Warm starts: a shared prefix written to disk by one process and loaded by the next (issue 28)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from mlx_subagents.errors import RequestError
from mlx_subagents.host import GenerateArgs, MlxModelHost
from mlx_subagents.host.kv.prefix_files import TEMP_PREFIX, clear_prefixes, evict, list_prefixes, prefix_cache_dir
from mlx_subagents.host.kv.prefix_store import PrefixStore
from tests.helpers import spawn_cli, task_text

SYSTEM = "You are a scout. " + " ".join(f"Rule {i}: read file number {i} with care." for i in range(40))
OTHER = "You are a planner. " + " ".join(f"Step {i}: plan part {i} of the change." for i in range(40))


def ask(path: Path, system: str = SYSTEM, **host: Any) -> list[Any]:
    """One new host (as a new process has), one greedy first turn per system prompt given."""

    async def go() -> list[Any]:
        async with MlxModelHost(str(path), **host) as h:
            replies = []
            for i, text in enumerate(system.split("\0")):
                messages = [{"role": "system", "content": text}, {"role": "user", "content": "find the config"}]
                replies.append(await h.session(f"s{i}").generate(messages, GenerateArgs(max_tokens=12, temperature=0)))
            return replies

    return asyncio.run(go())


def stored() -> list[Path]:
    return sorted(prefix_cache_dir().glob("*.safetensors"))


def prefix_name(n: int) -> str:
    """A name as the store gives its files: 40 hex digits."""
    return f"{n:040x}.safetensors"


def fake_prefix(path: Path, size: int, header: Any = None) -> Path:
    """A file of `size` bytes with a safetensors header: the store's own metadata unless `header` says
    otherwise (a model's weights, say)."""
    meta = {"__metadata__": {"0.key": "k", "0.format": "1", "0.model": "m", "0.n_tokens": "300"}}
    data = json.dumps(meta if header is None else header).encode()
    body = len(data).to_bytes(8, "little") + data
    path.write_bytes(body + b"\0" * max(0, size - len(body)))
    return path


@pytest.mark.slow
@pytest.mark.process
def test_processes_in_a_row_start_warm_and_two_at_once_leave_one_good_file(
    tiny_qwen3_path: Path, tmp_path: Path, preloaded_python: list[str]
) -> None:
    """Three `subagent run`, each a process of its own (a fork of the worker's preloaded process, which
    imported mlx and the runner but never ran a model nor read the prefix store)."""
    home = tmp_path / "home"
    env = {"MLX_SUBAGENTS_HOME": str(home)}
    args = ("run", "scout", "where is the config parsed?", "--model", str(tiny_qwen3_path), "--cwd", str(tmp_path))
    args += ("--json", "--max-turns", "1", "--max-tokens", "12")
    run = lambda: spawn_cli(*args, env=env, python=preloaded_python)  # noqa: E731
    together = [run(), run()]  # both cold, both write the same prefix
    cold = [json.loads(p.communicate(timeout=120)[0]) for p in together]
    folder = home / "cache" / "prefixes"
    assert [p.name.startswith(TEMP_PREFIX) for p in folder.iterdir()] == [False]  # one file, no leftovers

    out, errors = run().communicate(timeout=120)
    warm = json.loads(out)

    prompt, cached = warm["usage"]["input_tokens"], warm["usage"]["cached_tokens"]
    # Both prefilled cold, or the later one already found the earlier one's whole file.
    assert sorted(c["usage"]["cached_tokens"] for c in cold) in ([0, 0], [0, cached])
    assert prompt == cold[0]["usage"]["input_tokens"]
    # The agent's whole prompt and tools: only the task message is new (at most a token a byte, and
    # the template's few around it).
    task = task_text("where is the config parsed?", tmp_path)
    assert prompt - len(task.encode()) - 16 < cached < prompt
    assert warm["output"] == cold[0]["output"] == cold[1]["output"]
    assert warm["stop_reason"] == cold[0]["stop_reason"]
    assert "prefix cache" not in errors


@pytest.mark.slow
def test_a_bad_file_is_deleted_with_one_warning_and_the_run_is_a_correct_cold_run(
    tiny_qwen3_path: Path, tmp_path: Path, caplog: Any
) -> None:
    cold = ask(tiny_qwen3_path)[0]
    (good,) = stored()
    backup = tmp_path / "good"
    shutil.copy(good, backup)
    ask(tiny_qwen3_path, OTHER)
    foreign = next(p for p in stored() if p != good)
    size = good.stat().st_size

    def flip(path: Path) -> None:  # one byte of the keys, far past the header
        data = bytearray(path.read_bytes())
        data[size - 100] ^= 0xFF
        path.write_bytes(bytes(data))

    cases = {
        "its checksum disagrees": flip,
        "it cannot be read": lambda p: p.write_bytes(p.read_bytes()[: size // 2]),
        "it was written for another model": lambda p: shutil.copy(foreign, p),
    }
    for reason, damage in cases.items():
        shutil.copy(backup, good)
        damage(good)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mlx_subagents.prefix_cache"):
            reply = ask(tiny_qwen3_path)[0]
        assert [r.getMessage().split(" because ")[1].split(";")[0] for r in caplog.records][0].startswith(reason)
        assert len(caplog.records) == 1, reason
        assert (reply.raw_text, reply.usage.cached_tokens) == (cold.raw_text, 0), reason
        assert good.read_bytes() == backup.read_bytes(), reason  # computed again and written again, whole

    warm = ask(tiny_qwen3_path)[0]
    assert warm.raw_text == cold.raw_text and warm.usage.cached_tokens > 0


def test_a_folder_that_cannot_be_written_turns_the_tier_off_with_one_warning(
    tiny_qwen3_path: Path, tmp_path: Path, caplog: Any
) -> None:
    cold = ask(tiny_qwen3_path, prefix_cache=0)[0]
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="mlx_subagents.prefix_cache"):
        reply = ask(tiny_qwen3_path, prefix_cache_dir=blocker / "prefixes")[0]
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["prefix cache off"]
    assert f"cannot write the prefix cache folder {blocker / 'prefixes'}" in caplog.records[0].getMessage()
    assert reply.raw_text == cold.raw_text

    # The folder goes away after the start (a disk that fills, a folder deleted): the write fails, once.
    folder = tmp_path / "gone"

    async def go() -> Any:
        async with MlxModelHost(str(tiny_qwen3_path), prefix_cache_dir=folder) as host:
            folder.rmdir()
            folder.write_text("now a file")
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "find the config"}]
            return await host.session("s").generate(messages, GenerateArgs(max_tokens=12, temperature=0))

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlx_subagents.prefix_cache"):
        reply = asyncio.run(go())
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["prefix cache off"]
    assert reply.raw_text == cold.raw_text


@pytest.mark.slow
def test_the_folder_stays_under_its_bound_least_recently_used_first(tiny_qwen3_path: Path, tmp_path: Path) -> None:
    ask(tiny_qwen3_path)
    (one,) = stored()
    ask(tiny_qwen3_path, OTHER)
    ask(tiny_qwen3_path)  # loads the first prefix: the other one is now the least recently used
    bound = one.stat().st_size * 3 // 2
    warm = ask(tiny_qwen3_path, prefix_cache=bound)[0]  # a lower bound holds from the start
    assert stored() == [one] and warm.usage.cached_tokens > 0
    ask(tiny_qwen3_path, OTHER, prefix_cache=bound)  # a write evicts too
    assert len(stored()) == 1 and one not in stored()
    assert sum(p.stat().st_size for p in prefix_cache_dir().iterdir()) <= bound

    # By last use, and a temporary file left by a process that died mid-write goes too.
    folder = tmp_path / "lru"
    folder.mkdir()
    names = [prefix_name(n) for n in range(3)] + [f"{TEMP_PREFIX}7-8-{'d' * 40}.safetensors"]
    for i, name in enumerate(names):
        fake_prefix(folder / name, 100)
        os.utime(folder / name, (1000 + i, 1000 + i))
    assert evict(folder, 250, now=1000 + 3600) == 1
    assert sorted(p.name for p in folder.iterdir()) == names[1:3]


@pytest.mark.slow
def test_a_hybrid_prefix_is_a_snapshot_at_its_end(tiny_qwen35_path: Path) -> None:
    cold = ask(tiny_qwen35_path)[0]
    warm = ask(tiny_qwen35_path)[0]
    assert warm.raw_text == cold.raw_text
    assert 0 < warm.usage.cached_tokens == cold.usage.prompt_tokens - warm.usage.prefilled_tokens
    assert warm.usage.prefilled_tokens < 32


def test_subagent_cache_lists_and_clears(tiny_qwen3_path: Path, run_cli: Any) -> None:
    ask(tiny_qwen3_path)
    (entry,) = list_prefixes()
    code, out, err = run_cli("cache", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["folder"] == str(prefix_cache_dir())
    assert [(p["model"], p["tokens"], p["bytes"]) for p in data["prefixes"]] == [
        (str(tiny_qwen3_path), entry.n_tokens, entry.nbytes)
    ]
    code, out, err = run_cli("cache")
    assert out.startswith(f"{tiny_qwen3_path}  {entry.n_tokens} tokens  ")
    assert err.strip() == f"1 prefixes, {entry.nbytes / 2**20:.1f} MiB in {prefix_cache_dir()}"
    code, out, err = run_cli("cache", "clear")
    assert (code, err.strip()) == (0, f"deleted 1 prefixes ({entry.nbytes / 2**20:.1f} MiB) from {prefix_cache_dir()}")
    assert stored() == [] and run_cli("cache", "--json")[1].count('"model"') == 0


def test_a_prefix_cache_that_is_not_a_size_is_one_line(run_cli: Any) -> None:
    code, out, err = run_cli("run", "scout", "x", "--model", "scripted:none.json", "--prefix-cache", "lots")
    assert (code, out) == (2, "")
    assert err.strip() == "error: --prefix-cache 'lots' is not a size; use e.g. 2GB, 512MiB or off"


def test_sliding_window_caches_come_back_as_they_were(tmp_path: Path) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from mlx_subagents.host.kv.prefix_store import PrefixStore, cache_kind

    def filled(n: int) -> list[Any]:
        cache = [KVCache(), RotatingKVCache(max_size=32), RotatingKVCache(max_size=512)]  # one wraps, one does not
        for layer in cache:
            for start in range(0, n, 25):  # in chunks, as prefill feeds them
                k = mx.arange(start * 8, min(n, start + 25) * 8, dtype=mx.float32).reshape(1, 1, -1, 8)
                layer.update_and_fetch(k, -k)
        return cache

    ids = list(range(300))
    store = PrefixStore(tmp_path, 2**30, "test", cache_kind(filled(1)) or "", "test", min_tokens=1)
    store.save(ids, filled(len(ids)))
    store.close()
    loaded = store.load(ids)
    assert loaded is not None and store.loads == 1
    step = mx.ones((1, 1, 1, 8))
    for before, after in zip(filled(len(ids)), loaded):
        assert (type(after), after.offset) == (type(before), before.offset)
        for a, b in zip(before.update_and_fetch(step, step), after.update_and_fetch(step, step)):
            assert mx.array_equal(a, b).item()  # the next token sees the same keys and values


def test_cache_clear_and_eviction_delete_only_what_the_store_wrote(
    tmp_path: Path, run_cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = prefix_cache_dir()
    folder.mkdir(parents=True)
    ours = [fake_prefix(folder / prefix_name(n), 1000) for n in (1, 2)]
    temp = fake_prefix(folder / f"{TEMP_PREFIX}3-4-{'e' * 40}.safetensors", 10)
    weights = fake_prefix(folder / "model-00001-of-00002.safetensors", 5000, {"__metadata__": {"format": "pt"}})
    foreign = fake_prefix(folder / prefix_name(9), 5000, {"__metadata__": {"format": "pt"}})
    damaged = folder / prefix_name(10)
    damaged.write_bytes(b"\xff" * 8 + b"junk")
    bad_count = fake_prefix(folder / prefix_name(11), 100)
    bad_count.write_bytes(bad_count.read_bytes().replace(b'"300"', b'"3x0"'))
    fifo = folder / prefix_name(12)
    os.mkfifo(fifo)  # would hang a plain open

    code, out, err = run_cli("cache", "--json")

    assert code == 0
    assert sorted(p["file"] for p in json.loads(out)["prefixes"]) == [str(p) for p in ours]
    fix = "delete it (subagent cache clear deletes only the files it wrote)"
    assert sorted(err.strip().splitlines()) == sorted(
        [
            f"warning: skipped {foreign}: not a prefix file this tool wrote (no key and format in its header); {fix}",
            f"warning: skipped {damaged}: not a readable prefix file (ValueError); {fix}",
            f"warning: skipped {bad_count}: a damaged prefix file (its token count is '3x0'); {fix}",
            f"warning: skipped {fifo}: not a regular file (a FIFO, device or socket); a prefix file must be a "
            "regular file",
        ]
    )
    assert evict(folder, 0) == 2  # over any bound: still only its own
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in (temp, weights, foreign, damaged, bad_count, fifo)
    )
    size = temp.stat().st_size
    assert clear_prefixes() == (1, size)  # the temporary file, by its name
    assert weights.stat().st_size == foreign.stat().st_size == 5000


def test_a_linked_prefix_folder_is_never_used_nor_cleared(tmp_path: Path, run_cli: Any, caplog: Any) -> None:
    weights = tmp_path / "a-model"
    weights.mkdir()
    shard = fake_prefix(weights / prefix_name(1), 1000)  # even one that looks like the store's own
    folder = prefix_cache_dir()
    folder.parent.mkdir(parents=True)
    folder.symlink_to(weights)

    code, _, err = run_cli("cache", "clear")

    assert (code, err.strip()) == (
        2,
        f"error: the prefix cache was not cleared: {folder} is a symbolic link; make {folder} a real folder (the "
        "prefix cache never follows a link)",
    )
    with pytest.raises(RequestError):
        list_prefixes()
    with caplog.at_level(logging.WARNING, logger="mlx_subagents.prefix_cache"):
        store = PrefixStore(folder, 10, "identity", "KVCache", "m")
    assert not store.enabled
    assert [r.getMessage() for r in caplog.records] == [
        f"prefix cache off: {folder} is a symbolic link; make {folder} a real folder (the prefix cache never follows "
        "a link); the run goes on without it (see `subagent cache`)"
    ]
    assert shard.stat().st_size == 1000
