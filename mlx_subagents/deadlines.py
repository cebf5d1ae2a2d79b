"""`within`: an awaitable bounded in time that never swallows the caller's cancellation.

`asyncio.wait_for` before Python 3.12 drops a cancellation that arrives in the loop turn its
awaitable finishes in (CPython gh-86296): a Ctrl-C landing as a tool's thread returns was lost, and
the run went on to its next reply (a parallel run cancelled 2-30 ms after it started waited for
every running task's next turn). `asyncio.timeout` (3.11+; `async_timeout` on 3.10, which it was
taken from) cancels the awaiting task itself and tells its own cancellation from the caller's.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable
from typing import TypeVar

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - the asyncio.timeout of 3.11, as a package
    from async_timeout import timeout as _timeout

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
    """`awaitable`'s result, or `TimeoutError` after `seconds` (None: no limit); a cancellation of the
    awaiting task always propagates, even in the turn the awaitable finishes."""
    async with _timeout(seconds):
        return await awaitable
