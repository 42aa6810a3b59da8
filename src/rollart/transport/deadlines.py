"""Bucketed expiry of RPC calls: one armed loop timer per client, not one per call.

A loop timer per call (``loop.call_later``) keeps a ``TimerHandle`` (and on uvloop a ``UVTimer``)
plus its argument tuple alive for the whole call: with env steps of ~10 s and 10k trajectories
that is ~10k live GC-tracked objects per client, promoted through every generation (issue 11).
``DeadlineWheel`` instead files each call's 8-byte call id in a bucket keyed by
``(deadline tick, message kind, timeout)``: a ``bytearray`` (not GC-tracked) that grows by 8
bytes per call. Buckets sit in a heap by tick; one loop timer is armed at the earliest tick.
A call that completes early is not removed (that would cost a search); its id is simply not
found among the pending calls when its bucket fires. Memory: 8 bytes per call until its
deadline tick, plus one small bucket per (tick, kind, timeout) seen.

Bound: a call filed at loop time ``t`` with timeout ``T`` expires at tick ``k * granularity_s``
where ``k = ceil((t + T) / granularity_s)``, so never before ``t + T`` and at most
``granularity_s`` after it (plus whatever lag the loop itself has, as with any loop timer).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable

#: Width of a deadline bucket in seconds: how late, at most, a call's timeout fires. RPC
#: timeouts are seconds to minutes (heartbeat liveness 10 s, env step 120 s, generate 600 s),
#: so 0.1 s is below their resolution, and one client's timer fires at most 10 times a second.
EXPIRY_GRANULARITY_S = 0.1

#: (8-byte call id, message kind name, timeout in seconds) of a call whose deadline passed.
ExpireCallback = Callable[[bytes, str, float], None]
_Key = tuple[int, str, float]


class DeadlineWheel:
    """Deadlines of one client's calls, expired in buckets of ``granularity_s`` seconds.

    Args:
        loop: the event loop (its ``time()`` is the clock; ``call_at`` arms the one timer).
        on_expired: called once per filed call whose deadline passed, with the call id, kind
            and timeout given to ``add``; it must ignore ids that already completed.
        granularity_s: bucket width (> 0): a call expires no earlier than its timeout and at
            most ``granularity_s`` later (see the module docstring).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, on_expired: ExpireCallback,
                 granularity_s: float = EXPIRY_GRANULARITY_S) -> None:
        if not granularity_s > 0:
            raise ValueError(f"granularity_s must be > 0, got {granularity_s}")
        self._loop = loop
        self._on_expired = on_expired
        self.granularity_s = granularity_s
        self._buckets: dict[_Key, bytearray] = {}
        self._heap: list[_Key] = []
        self._timer: asyncio.TimerHandle | None = None
        self._armed_tick = 0

    def __len__(self) -> int:
        """Call ids filed and not yet expired (completed calls included until their tick)."""
        return sum(len(ids) for ids in self._buckets.values()) // 8

    def add(self, call_id: bytes, kind: str, timeout_s: float) -> None:
        """File ``call_id`` (8 bytes) to expire ``timeout_s`` seconds from now (``loop.time()``);
        an infinite ``timeout_s`` never expires (nothing is filed).

        Raises:
            ValueError: ``timeout_s`` is NaN.
        """
        if timeout_s == math.inf:
            return
        if timeout_s != timeout_s:
            raise ValueError(f"timeout_s of a {kind} call is NaN")
        tick = math.ceil((self._loop.time() + timeout_s) / self.granularity_s)
        key = (tick, kind, timeout_s)
        ids = self._buckets.get(key)
        if ids is None:
            ids = self._buckets[key] = bytearray()
            heapq.heappush(self._heap, key)
            if self._timer is None or tick < self._armed_tick:
                self._arm(tick)
        ids += call_id

    def _arm(self, tick: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._armed_tick = tick
        self._timer = self._loop.call_at(tick * self.granularity_s, self._fire)

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        heap = self._heap
        g = self.granularity_s
        # A loop may run a timer up to its clock resolution early: only ticks truly past go.
        while heap and heap[0][0] * g <= now:
            key = heapq.heappop(heap)
            ids = self._buckets.pop(key)
            _, kind, timeout_s = key
            for pos in range(0, len(ids), 8):
                self._on_expired(bytes(ids[pos:pos + 8]), kind, timeout_s)
        if heap:
            self._arm(heap[0][0])

    def close(self) -> None:
        """Forget every deadline and disarm the timer (no callback runs after this)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._buckets.clear()
        self._heap.clear()
