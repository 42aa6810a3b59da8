"""Polling helper shared by the integration tests (services change state asynchronously)."""

from __future__ import annotations

import asyncio
import time


async def wait_for(predicate, timeout_s: float = 20.0, every_s: float = 0.05):
    """Await ``predicate()`` every ``every_s`` seconds until it returns a truthy value (returned).

    Raises:
        AssertionError: still falsy after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(every_s)
    raise AssertionError(f"condition not met within {timeout_s} s")
