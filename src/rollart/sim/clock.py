"""Virtual and real clocks for SIMULATED runs.

``run_virtual`` runs a coroutine on a ``looptime`` event loop (looptime 0.9): the loop's clock
jumps to the next scheduled timer whenever no callback is ready and no I/O is pending, so an
``asyncio.sleep(3600)`` returns at once with ``loop.time()`` 3600 s later. Simulated backends
only ever wait through the loop's timers, so a run is deterministic for a given seed (the
selector loop runs ready callbacks in FIFO order and timers in deadline order).

looptime patches a selector-based ``asyncio`` loop; uvloop has no Python-level selector to
patch, so virtual runs use the standard loop. ``run_real`` runs the same coroutine on uvloop
(or asyncio) in real time, for cross-checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import looptime

T = TypeVar("T")


def run_virtual(main: Callable[[], Awaitable[T]], *, idle_timeout_s: float = 1.0,
                end_s: float | None = None) -> T:
    """Run ``main()`` to completion on a virtual clock starting at 0.0 s.

    Args:
        main: coroutine function to run.
        idle_timeout_s: loop-time seconds with nothing scheduled (a deadlock: no timer, no I/O)
            after which every task gets ``looptime.IdleTimeoutError`` instead of a hang; it
            costs about that much real time.
        end_s: optional end of virtual time; tasks still waiting get
            ``looptime.LoopTimeoutError``.

    Returns what ``main()`` returns; re-raises what it raises.
    """
    # noop_cycles=1: one callback-free cycle before jumping the clock is enough for the
    # selector loop (ready callbacks already force a zero timeout); looptime's default of 42
    # only costs time when there are millions of timers.
    loop = looptime.new_event_loop(start=0.0, end=end_s, noop_cycles=1,
                                   idle_timeout=idle_timeout_s, idle_step=0.05)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main())
    finally:
        _shutdown(loop)


def run_real(main: Callable[[], Coroutine[Any, Any, T]], *, use_uvloop: bool = True) -> T:
    """Run ``main()`` on a real-time loop (uvloop by default)."""
    if use_uvloop:
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


def _shutdown(loop: asyncio.AbstractEventLoop) -> None:
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        asyncio.set_event_loop(None)
        loop.close()
