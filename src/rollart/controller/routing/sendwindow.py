"""Per-worker send window: at most ``max_generate_in_flight`` generate requests outstanding on
one worker.

Why: a request's ``generate_timeout_s`` must measure the worker, not a queue. Without
a window, a burst (a run's start, a weight apply releasing thousands of trajectories at once)
puts every request on the wire at once; a worker that takes them in slower than they come
holds a backlog in ZeroMQ's queues (high-water mark 0 by design: nothing is dropped), requests
at its tail time out although the worker is healthy, their trajectories are retried, and each
retry adds a new request (a whole prompt, for a new trajectory) to the same backlog. At 50k
trajectories x 32k tokens on one SIMULATED worker: 22,241 generate timeouts, memory in use
21.4 GB when the run stopped (``ControllerStalledError``); with the window 0 timeouts
(docs/performance/controller-overhead.md).

With the window, requests beyond ``max_generate_in_flight`` wait in the controller, in arrival
order, and each one's timeout starts when it is sent. Waiting costs a future per waiting request
only; below the bound :meth:`try_acquire` is a dict lookup and a compare. Keep
``max_generate_in_flight`` above what the engine runs at once (vLLM's ``max_num_seqs``) so its
scheduler never runs dry.

The wait has no timeout of its own. Every slot is released when its call ends (reply, error
or timeout); a worker that stops answering heartbeats is declared dead, which ends its calls,
and its waiters are woken (:meth:`drop`) to route again. A worker alive to its heartbeats but
answering nothing (a hung engine) is found by its first call to time out: the proxy probes it
and quarantines it if the probe fails too (``rollart.controller.routing.hangcheck``), which drops it
from its pool and from here, so its waiters route again to other workers rather than each
waiting for a slot that a timeout frees.

"At most ``max_generate_in_flight``" counts what the controller waits for: a timed-out
request's slot is free at once, while its abort may still be on the way to the worker.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable


class SendWindow:
    """Slots of outstanding generate requests, per worker name.

    Args:
        names: the workers' names.
        max_generate_in_flight: slots per worker (>= 1; ``run.max_generate_in_flight``), or
            ``None`` for no bound.

    Attributes:
        in_flight: worker name -> slots taken (requests sent and not ended, plus slots handed
            to a waiter that has not sent yet).
        num_waits: requests that had to wait for a slot (a cumulative count).
    """

    def __init__(self, names: Iterable[str], max_generate_in_flight: int | None) -> None:
        if max_generate_in_flight is not None and max_generate_in_flight < 1:
            raise ValueError("send window: max_generate_in_flight must be >= 1 or None, got "
                             f"{max_generate_in_flight}")
        self.max_generate_in_flight = max_generate_in_flight
        self.in_flight: dict[str, int] = {name: 0 for name in names}
        self._waiters: dict[str, deque[asyncio.Future[bool]]] = {
            name: deque() for name in self.in_flight}
        # Waiters not yet woken or cancelled (the deque may still hold cancelled ones).
        self._waiting: dict[str, int] = dict.fromkeys(self.in_flight, 0)
        self.num_waits = 0

    def load(self, name: str) -> int:
        """Requests on ``name`` as routing counts them: slots taken plus live waiters (0 for
        an unknown name)."""
        return self.in_flight.get(name, 0) + self._waiting.get(name, 0)

    def waiting(self, name: str) -> int:
        """Requests waiting for a slot on ``name`` now (cancelled ones not counted)."""
        return self._waiting[name]

    def try_acquire(self, name: str) -> bool:
        """Take a slot on ``name`` if one is free and nobody waits for it (FIFO: a request
        that arrives while others wait queues behind them). True if taken."""
        queue = self._waiters[name]
        while queue and queue[0].done():  # cancelled waiters left behind
            queue.popleft()
        bound = self.max_generate_in_flight
        if bound is not None and (queue or self.in_flight[name] >= bound):
            return False
        self.in_flight[name] += 1
        return True

    async def wait(self, name: str) -> bool:
        """Wait, in arrival order, for a slot on ``name`` (call after ``try_acquire`` failed).

        Returns:
            True: the slot is this caller's (release it when the call ends); False: the worker
            was dropped while waiting (nothing to release; route again).
        Raises:
            asyncio.CancelledError: the caller was cancelled (a slot handed over at that
                moment is passed on).
        """
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters[name].append(fut)
        self._waiting[name] += 1
        self.num_waits += 1
        try:
            return await fut
        except asyncio.CancelledError:
            if not fut.done() or fut.cancelled():
                self._waiting[name] -= 1  # still queued: release() will skip it
            elif fut.result():
                # Cancelled after release() handed it the slot but before it ran: pass it on.
                self.release(name)
            raise
        finally:
            del fut

    def release(self, name: str) -> None:
        """End one slot on ``name``: hand it to the longest waiter, else free it."""
        queue = self._waiters[name]
        while queue:
            fut = queue.popleft()
            if not fut.done():
                self._waiting[name] -= 1
                fut.set_result(True)  # the slot passes on: in_flight unchanged
                return
        self.in_flight[name] -= 1

    def drop(self, name: str) -> None:
        """``name`` left its pool: wake its waiters with False (they route again). Slots of
        calls still in flight there are released as those calls end."""
        queue = self._waiters[name]
        while queue:
            fut = queue.popleft()
            if not fut.done():
                self._waiting[name] -= 1
                fut.set_result(False)
