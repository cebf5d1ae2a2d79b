"""A cancellation that lands in the loop turn an awaited result arrives in is never lost.

`asyncio.wait_for` before Python 3.12 returned the result and dropped the cancellation (CPython
gh-86296): a parallel run cancelled 2-30 ms after it started, as its tasks' first tool threads
returned, ran on to their next replies (a CI run waited 31 s for a scripted 30 s reply).
"""

from __future__ import annotations

import asyncio

import pytest

from mlx_subagents.deadlines import within
from mlx_subagents.tools.threads import run_in_thread


def test_a_cancel_in_the_turn_the_result_arrives_propagates() -> None:
    async def main() -> None:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        waiter = asyncio.create_task(within(future, 10))
        await asyncio.sleep(0)  # the waiter awaits the future now
        future.set_result(1)  # its wake-up is queued ...
        waiter.cancel()  # ... and the cancel comes in the same turn
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(main())


def test_a_tool_thread_that_returns_as_its_call_is_cancelled_ends_cancelled() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        caller: asyncio.Task[str] | None = None

        def tool() -> str:
            assert caller is not None
            loop.call_soon_threadsafe(caller.cancel)  # Ctrl-C lands just before the result
            return "listing"

        caller = asyncio.create_task(run_in_thread(tool, timeout=10, what="ls"))
        with pytest.raises(asyncio.CancelledError):
            await caller

    asyncio.run(main())


def test_the_limit_still_raises_timeout_and_a_result_in_time_is_returned() -> None:
    async def main() -> None:
        assert await within(asyncio.sleep(0, "done"), 5) == "done"
        assert await within(asyncio.sleep(0, "done"), None) == "done"
        with pytest.raises(TimeoutError):
            await within(asyncio.sleep(5), 0.01)

    asyncio.run(main())
