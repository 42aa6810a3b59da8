"""KV working-set admission: a pool starts a new trajectory only while the KV cache its live
trajectories will need fits the pool's KV capacity.

A multi-turn trajectory's prefix stays in its engine's KV cache between turns (vLLM's automatic
prefix caching), so its next turn prefills only the new observation. When a pool holds more
live trajectories than its KV cache can keep, the cache evicts least-recently-used prefixes, and
those are the prefixes of the trajectories whose turn comes next: every turn recomputes its
whole context, and prefill grows with the square of the turns. That is thrashing, and the cure
is the working-set rule (P. J. Denning, "The working set model for program behavior", CACM 11(5),
1968): admit new work only while the working sets of the admitted work fit in memory.

A live trajectory's working set is its expected KV footprint in tokens: the larger of what its
worker holds now (prompt and generated tokens of its last turn; its first prompt before that)
and the mean final footprint of its domain's finished trajectories (before any finished:
``prior_tokens``, the longest a trajectory may grow). The per-pool sums are kept as trajectories
start, turn and end; the domain means they use are refreshed once the finishes since the last
refresh reach 1/``REFRESH_FRACTION`` of the live trajectories (every finish while fewer than
that are live), so a check costs O(1) and a refresh O(live) amortised over many finishes. A pool's KV capacity is the sum of its live workers' reported
``WorkerStats.kv_capacity_tokens`` (vLLM: ``num_gpu_blocks x block_size``). A new trajectory
starts on a pool when the expected footprints of the pool's live trajectories plus its own fit
``share x capacity``, or when the pool has no live trajectory (nothing to protect: a trajectory
larger than the whole cache still runs, alone); otherwise it waits, first come first served,
until a trajectory on that pool ends or its capacity changes (``poke``). A pool whose capacity
is not known (a worker that does not report it) is never gated. ``num_waits`` / ``wait_s``
count a wait when it ends (started or cancelled), so per-step deltas pair waits with their
seconds.

The gate holds only a trajectory's *first* turn: a live trajectory's later turns always go
ahead (holding them would keep their KV and stop the work that frees it).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

#: refresh the domain means once the finishes since the last refresh reach this share of the
#: live trajectories (module docstring)
REFRESH_FRACTION = 1 / 64


@dataclass
class _Live:
    pool: str
    domain: str
    tokens: int  # KV tokens its worker holds now (its first prompt before its first turn)
    expected: float  # its expected footprint under the current domain means
    turned: bool = False  # a turn completed: its footprint is a measured one


class KVWorkingSet:
    """Per-pool admission of new trajectories by their expected KV footprint (module docstring).

    Args:
        capacity: pool name -> the pool's KV capacity in tokens now, ``None`` when not known
            (then the pool is not gated).
        prior_tokens: a trajectory's expected footprint in tokens before any trajectory of its
            domain has finished (the run's ``max_tokens_per_trajectory``), >= 1.
        share: share of the capacity the working sets may fill, in (0, 1].

    Raises:
        ValueError: ``prior_tokens`` < 1 or ``share`` out of range.
    """

    def __init__(self, capacity: Callable[[str], int | None], *, prior_tokens: int,
                 share: float = 1.0) -> None:
        if prior_tokens < 1:
            raise ValueError(f"prior_tokens must be >= 1, got {prior_tokens}")
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.capacity, self.prior_tokens, self.share = capacity, prior_tokens, share
        self._live: dict[str, _Live] = {}
        #: domain -> (finished trajectories, their summed final footprints in tokens)
        self._final: dict[str, tuple[int, int]] = {}
        #: domain -> the mean final footprint in use (refreshed from ``_final``)
        self._mean: dict[str, float] = {}
        self._finishes_since_refresh = 0
        #: pool -> (live trajectories, their expected footprints summed)
        self._pools: dict[str, tuple[int, float]] = {}
        self._waiters: dict[str, deque[tuple[asyncio.Future[None], str, str, int]]] = {}
        #: first turns that had to wait, and the seconds they waited in all (the owner's
        #: clock), counted when each wait ended
        self.num_waits = 0
        self.wait_s = 0.0

    def expected_tokens(self, domain: str, tokens: int = 0) -> float:
        """Expected final KV footprint (tokens) of a trajectory of ``domain`` holding ``tokens``
        now."""
        return max(float(tokens), self._mean.get(domain, float(self.prior_tokens)))

    def pool_tokens(self, pool: str) -> float:
        """Expected footprints (tokens) of the live trajectories on ``pool``, summed."""
        return self._pools.get(pool, (0, 0.0))[1]

    def num_live(self, pool: str) -> int:
        return self._pools.get(pool, (0, 0.0))[0]

    def fits(self, pool: str, domain: str, num_prompt_tokens: int = 0) -> bool:
        """Whether a new trajectory of ``domain`` whose first prompt is ``num_prompt_tokens``
        long may start on ``pool`` now."""
        cap = self.capacity(pool)
        if cap is None or not self.num_live(pool):
            return True
        return (self.pool_tokens(pool) + self.expected_tokens(domain, num_prompt_tokens)
                <= self.share * cap)

    def is_live(self, traj_id: str) -> bool:
        return traj_id in self._live

    async def admit(self, traj_id: str, pool: str, domain: str, num_prompt_tokens: int,
                    clock: Callable[[], float]) -> None:
        """Start ``traj_id`` (of ``domain``, first prompt ``num_prompt_tokens`` long) on
        ``pool``: at once when it fits and no earlier trajectory waits for that pool, else when
        trajectories ending on the pool made room. Cancelling the caller while it waits leaves
        nothing behind."""
        if traj_id in self._live:
            return
        queue = self._waiters.setdefault(pool, deque())
        if not queue and self.fits(pool, domain, num_prompt_tokens):
            self._start(traj_id, pool, domain, num_prompt_tokens)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append((fut, traj_id, domain, num_prompt_tokens))
        t0 = clock()
        try:
            # ``_wake`` puts it in the live set as it admits it: a cancelled caller that was
            # admitted in the same instant is taken out by its trajectory's ``ended``.
            await fut
        finally:
            self.num_waits += 1
            self.wait_s += clock() - t0
            if fut.cancelled():
                self._wake(pool)  # it may have held back later ones that fit

    def _start(self, traj_id: str, pool: str, domain: str, tokens: int) -> None:
        live = _Live(pool, domain, tokens, self.expected_tokens(domain, tokens))
        self._live[traj_id] = live
        n, total = self._pools.get(pool, (0, 0.0))
        self._pools[pool] = (n + 1, total + live.expected)

    def held(self, traj_id: str, tokens: int) -> None:
        """``traj_id``'s worker holds ``tokens`` KV tokens for it now (after a turn)."""
        live = self._live.get(traj_id)
        if live is not None:
            expected = self.expected_tokens(live.domain, tokens)
            n, total = self._pools[live.pool]
            self._pools[live.pool] = (n, total + expected - live.expected)
            live.tokens, live.turned, live.expected = tokens, True, expected

    def ended(self, traj_id: str) -> None:
        """``traj_id`` ended: its footprint counts in its domain's mean (when it generated) and
        the first trajectories waiting for its pool (for every pool, when the means were
        refreshed) that now fit start."""
        live = self._live.pop(traj_id, None)
        if live is None:
            return
        n, total = self._pools[live.pool]
        self._pools[live.pool] = (n - 1, total - live.expected) if n > 1 else (0, 0.0)
        if live.turned:
            count, tokens = self._final.get(live.domain, (0, 0))
            self._final[live.domain] = (count + 1, tokens + live.tokens)
            self._finishes_since_refresh += 1
            if self._finishes_since_refresh >= REFRESH_FRACTION * len(self._live):
                self._refresh()
                # New means change every pool's sum, not only this one's.
                for pool in [p for p in self._waiters if p != live.pool]:
                    self._wake(pool)
        self._wake(live.pool)

    def _refresh(self) -> None:
        """The domain means from every finish so far, and every live expectation and pool sum
        under them (also clears the sums' rounding drift)."""
        self._finishes_since_refresh = 0
        self._mean = {d: tokens / count for d, (count, tokens) in self._final.items()}
        pools: dict[str, tuple[int, float]] = {}
        for live in self._live.values():
            live.expected = self.expected_tokens(live.domain, live.tokens)
            n, total = pools.get(live.pool, (0, 0.0))
            pools[live.pool] = (n + 1, total + live.expected)
        self._pools = pools

    def poke(self, pool: str) -> None:
        """Start the waiters of ``pool`` that fit now (its capacity may have changed)."""
        if self._waiters.get(pool):
            self._wake(pool)

    def _wake(self, pool: str) -> None:
        queue = self._waiters.get(pool)
        while queue:
            fut, traj_id, domain, tokens = queue[0]
            if fut.done():  # cancelled while waiting
                queue.popleft()
                continue
            if not self.fits(pool, domain, tokens):
                break
            queue.popleft()
            self._start(traj_id, pool, domain, tokens)
            fut.set_result(None)

    def num_waiting(self, pool: str | None = None) -> int:
        """First turns waiting for room now (on ``pool``; ``None``: on every pool)."""
        return sum(1 for name, q in self._waiters.items() if pool in (None, name)
                   for f, *_ in q if not f.done())

    def full(self, pool: str) -> bool:
        """Whether ``pool`` turns new trajectories away now: some wait for it, or its live
        trajectories' expected footprints fill its share of the capacity."""
        if any(not f.done() for f, *_ in self._waiters.get(pool, ())):
            return True
        cap = self.capacity(pool)
        return cap is not None and self.pool_tokens(pool) >= self.share * cap
