"""Running user code registered in the controller (local envs and rewards) off its event loop.

The controller is one asyncio loop serving every trajectory: a sync env step or reward function
that takes a second, run on the loop, delays every other trajectory's next request by that
second, and one that hangs stops the run with no error. :class:`OffLoopCalls` runs each sync
call on its own daemon thread, at most ``max_threads`` at once, under a deadline:

- past its deadline the caller gets ``TimeoutError`` at once; the thread cannot be killed, so it
  is *abandoned*: its slot is freed, it is counted in ``num_hung`` until it returns (its result
  is then discarded, with a log line), and at most ``max_hung`` may be abandoned at once (beyond
  that calls fail with :class:`OffLoopBusyError` instead of leaking threads without bound);
- async callables run on the loop under the same deadline (they must not block the loop);
- a ``CancelledError`` raised by the user code itself (not a cancellation of the caller) is
  re-raised as :class:`UnrequestedCancelError`, so it fails one call instead of looking like
  the controller cancelling the trajectory.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any

from rollart.threadcalls import AbandonableThreads
from rollart.transport.errors import RollartError

log = logging.getLogger(__name__)

THREAD_PREFIX = "rollart-local"


class OffLoopBusyError(RollartError):
    """Too many calls hung past their deadline are still running; this call was refused."""


class UnrequestedCancelError(RollartError):
    """User code raised ``asyncio.CancelledError`` although nobody cancelled the call."""


def requested_cancel() -> bool:
    """Whether the current task was asked to cancel (``Task.cancel``), as opposed to some code
    raising ``CancelledError`` on its own. Call from inside an ``except CancelledError``."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class OffLoopCalls:
    """Bounded daemon-thread calls with deadlines (see the module docstring).

    Args:
        max_threads: sync calls running at once (>= 1); more wait for a slot (inside their
            deadline).
        max_hung: abandoned calls still running before new calls are refused (>= 1).
        what: what the calls are, for log lines (e.g. ``"local env"``).

    Raises:
        ValueError: a bound < 1.
    """

    def __init__(self, max_threads: int = 16, max_hung: int = 64, what: str = "local") -> None:
        if max_threads < 1 or max_hung < 1:
            raise ValueError(f"max_threads and max_hung must be >= 1, got {max_threads}, "
                             f"{max_hung}")
        self.max_threads, self.max_hung, self.what = max_threads, max_hung, what
        #: calls that ran past their deadline (cumulative)
        self.num_timeouts = 0
        self._threads = AbandonableThreads(THREAD_PREFIX, what)
        self._slots: asyncio.Semaphore | None = None

    @property
    def num_hung(self) -> int:
        """Calls abandoned after their deadline and still running (gauge)."""
        return self._threads.num_hung

    async def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None,
                  name: str = "") -> Any:
        """``fn(*args)`` off the loop (sync) or on it (async), within ``timeout_s`` seconds
        (``None``: no deadline). A sync ``fn`` returning an awaitable has it awaited within the
        same deadline.

        Raises:
            TimeoutError: past the deadline (the thread, if any, is abandoned).
            OffLoopBusyError: ``max_hung`` abandoned calls are still running.
            UnrequestedCancelError: ``fn`` raised ``CancelledError`` on its own.
            Exception: whatever ``fn`` raised.
        """
        try:
            async with asyncio.timeout(timeout_s):
                if inspect.iscoroutinefunction(fn):
                    out = await fn(*args)
                else:
                    out = await self._thread(fn, args, name)
                    if inspect.isawaitable(out):
                        out = await out
                return out
        except TimeoutError:
            self.num_timeouts += 1
            raise
        except asyncio.CancelledError:
            if requested_cancel():
                raise
            raise UnrequestedCancelError(
                f"{self.what} {name or getattr(fn, '__qualname__', fn)!s} raised CancelledError "
                "although nobody cancelled it") from None

    async def _thread(self, fn: Callable[..., Any], args: tuple, name: str) -> Any:
        if self.num_hung >= self.max_hung:
            raise OffLoopBusyError(
                f"{self.num_hung} {self.what} calls hung past their deadline are still running "
                f"(limit {self.max_hung}); refusing {name or 'this call'}")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_threads)
        async with self._slots:
            return await self._threads.run(fn, args, name)
