"""OffLoopCalls: sync user code on bounded daemon threads with deadlines (in-process envs and
rewards); hung calls are abandoned and counted, never starving later calls."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rollart.controller.rollout.offloop import (
    OffLoopBusyError,
    OffLoopCalls,
    UnrequestedCancelError,
)


async def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def test_sync_calls_run_on_other_threads_and_async_ones_on_the_loop() -> None:
    calls = OffLoopCalls(max_threads=2)

    async def on_loop(x: int) -> tuple[str, int]:
        return threading.current_thread().name, x

    name, x = await calls.run(lambda x: (threading.current_thread().name, x), 3, timeout_s=30)
    assert (name.startswith("rollart-local"), x) == (True, 3)
    assert await calls.run(on_loop, 4, timeout_s=30) == (threading.current_thread().name, 4)

    def returns_awaitable():
        return on_loop(5)

    assert (await calls.run(returns_awaitable, timeout_s=30))[1] == 5
    with pytest.raises(ZeroDivisionError):
        await calls.run(lambda: 1 / 0, timeout_s=30)


async def test_hung_calls_are_abandoned_counted_and_bounded() -> None:
    release = threading.Event()
    calls = OffLoopCalls(max_threads=1, max_hung=2)
    try:
        for _ in range(2):  # twice the one thread slot
            with pytest.raises(TimeoutError):
                await calls.run(release.wait, 60, timeout_s=0.2, name="hang")
        assert (calls.num_hung, calls.num_timeouts) == (2, 2)
        with pytest.raises(OffLoopBusyError, match="2 local calls hung past their deadline"):
            await calls.run(lambda: 1, timeout_s=30)
        release.set()
        await _wait_for(lambda: calls.num_hung == 0)
        assert await calls.run(lambda: 7, timeout_s=30) == 7
    finally:
        release.set()


async def test_cancelled_error_raised_by_user_code_is_not_a_cancellation() -> None:
    calls = OffLoopCalls()

    def sync_cancels():
        raise asyncio.CancelledError()

    async def async_cancels():
        raise asyncio.CancelledError()

    for fn in (sync_cancels, async_cancels):
        with pytest.raises(UnrequestedCancelError, match="raised CancelledError"):
            await calls.run(fn, timeout_s=30)
    # A real cancellation of the caller still cancels.
    started = threading.Event()
    release = threading.Event()

    def blocks():
        started.set()
        release.wait(60)

    task = asyncio.create_task(calls.run(blocks, timeout_s=None))
    await _wait_for(started.is_set)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()


def test_bad_bounds() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        OffLoopCalls(max_threads=0)
