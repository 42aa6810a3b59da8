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
and its expected final footprint. That is the mean final footprint of its domain's last
``MEAN_WINDOW`` trajectories that finished their turns (one cut short, failed or cancelled, held
only part of it; a window, not the whole run, so that the mean follows response lengths that
grow as training goes on); before
any of them finished, a projection from the turns seen so far, capped at ``prior_tokens`` (the
longest a trajectory may grow). A trajectory whose first prompt was
``p`` tokens and that holds ``t`` after ``k >= 2`` of at most ``max_turns`` turns is expected to
end at ``p + (t - p) x (max_turns - 1) / (k - 1)``: every later turn adds an observation and a
response as the turns after the first did (the first turn adds a response only, so it cannot
tell how large observations are). A trajectory with fewer turns is expected at its domain's
projection: the mean of its trajectories' projections at their second turn; before any second
turn, the mean first-turn footprint times ``max_turns`` (the first prompt counted as every
turn's growth: an over-estimate); before any first turn returned, ``prior_tokens``, or for a
domain of one turn its first prompt plus ``max_tokens_per_turn`` when that is less (its KV
holds the prompt and one response, whatever the trajectory cap; an agent's first turn, admitted
before its prompt exists, stays at ``prior_tokens``). A
``max_turns`` far above the turns trajectories really take keeps the projections high until the
domain's first finish. So the hold guards the cache from a run's first burst on, and where
``prior_tokens`` is loose the projections replace it as the first turns return.

The per-pool sums are kept as trajectories start, turn and end; the domain means and
projections they use are refreshed once the finishes, first and second turns since the last
refresh reach ``REFRESH_FRACTION`` of the live trajectories (every one while fewer than
1/``REFRESH_FRACTION`` are live), so a check costs O(1) and a refresh O(live) amortised over
many events. A pool's KV capacity is the sum of its live workers' reported
``WorkerStats.kv_capacity_tokens`` (vLLM: ``num_gpu_blocks x block_size``; a worker whose
stats carry none yet counts at its pool's reported mean: ``LLMProxy``). The engine holds a
sequence's KV in whole blocks (``WorkerStats.kv_block_tokens``: vLLM's ``block_size``, 128 on
its CPU backend unless set), so each trajectory is charged to its pool at its expected
footprint rounded up to whole blocks of that pool; a pool whose block size is not known is
charged token by token. A new trajectory
starts on a pool when the charges of the pool's live trajectories plus its own fit
``share x capacity``, or when the pool has no live trajectory (nothing to protect: a trajectory
larger than the whole cache still runs, alone); otherwise it waits, first come first served,
until a trajectory on that pool turns or ends or its capacity changes (``poke``). A pool whose
capacity is not known (no worker of it reported one) is never gated. ``num_waits`` /
``wait_s`` count a wait when it ends (started or cancelled), so per-step deltas pair waits with
their seconds. The first wait on each pool is logged (one WARNING line).

The gate holds only a trajectory's *first* turn: a live trajectory's later turns always go
ahead (holding them would keep their KV and stop the work that frees it).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

#: refresh the domain means and projections once the finishes, first and second turns since
#: the last refresh reach this share of the live trajectories (module docstring)
REFRESH_FRACTION = 1 / 64
#: a domain's mean final footprint is over its last this many finished trajectories: the mean's
#: standard error is then 1/64 of the footprints' standard deviation, and lengths that change
#: over a run (response lengths grow as RL training goes on: DeepSeek-AI, "DeepSeek-R1",
#: arXiv 2501.12948, Fig. 3) are followed within as many finishes instead of averaged over the
#: whole run
MEAN_WINDOW = 4096


@dataclass
class _Live:
    pool: str
    domain: str
    tokens: int  # KV tokens its worker holds now (its first prompt before its first turn)
    first_prompt: int  # tokens of its first prompt
    expected: float  # its expected footprint under the current domain means, in whole blocks
    turns: int = 0  # turns completed: from the first on its footprint is a measured one


class KVWorkingSet:
    """Per-pool admission of new trajectories by their expected KV footprint (module docstring).

    Args:
        capacity: pool name -> the pool's KV capacity in tokens now, ``None`` when not known
            (then the pool is not gated).
        prior_tokens: the longest a trajectory may grow, in tokens (the run's
            ``max_tokens_per_trajectory``), >= 1: every projection's cap, and a trajectory's
            expected footprint before its domain's first turn returned (before its first finish
            for a domain not in ``max_turns``), except a one-turn domain's with a known prompt
            (``max_tokens_per_turn``).
        share: share of the capacity the working sets may fill, in (0, 1].
        max_turns: domain name -> its cap on turns per trajectory, for the projection before
            the domain's first finish; a domain not in it is expected at ``prior_tokens``
            until then.
        mean_window: finished trajectories per domain its mean final footprint is over (the
            last ones), >= 1.
        max_tokens_per_turn: the cap on one turn's response in tokens (the run's
            ``max_tokens_per_turn``), >= 1: before its domain's first turn returned, a
            trajectory of a domain whose ``max_turns`` is 1 and whose first prompt is known
            (> 0 tokens) is expected at that prompt plus this, when less than
            ``prior_tokens``; ``None``: at ``prior_tokens``.
        block_tokens: pool name -> tokens per block of its engines' KV cache now, ``None``
            when not known (then its trajectories are charged token by token); ``None``: no
            pool's is known.

    Raises:
        ValueError: ``prior_tokens`` < 1, ``share`` out of range, a ``max_turns`` < 1,
            ``mean_window`` < 1 or ``max_tokens_per_turn`` < 1.
    """

    def __init__(self, capacity: Callable[[str], int | None], *, prior_tokens: int,
                 share: float = 1.0, max_turns: Mapping[str, int] | None = None,
                 mean_window: int = MEAN_WINDOW, max_tokens_per_turn: int | None = None,
                 block_tokens: Callable[[str], int | None] | None = None) -> None:
        if prior_tokens < 1:
            raise ValueError(f"prior_tokens must be >= 1, got {prior_tokens}")
        if mean_window < 1:
            raise ValueError(f"mean_window must be >= 1, got {mean_window}")
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], got {share}")
        if max_tokens_per_turn is not None and max_tokens_per_turn < 1:
            raise ValueError(f"max_tokens_per_turn must be >= 1, got {max_tokens_per_turn}")
        self.max_tokens_per_turn = max_tokens_per_turn
        self.max_turns = dict(max_turns or {})
        for domain, turns in self.max_turns.items():
            if turns < 1:
                raise ValueError(f"max_turns of domain {domain!r} must be >= 1, got {turns}")
        self.capacity, self.prior_tokens, self.share = capacity, prior_tokens, share
        self.mean_window = mean_window
        self.block_tokens = block_tokens
        #: pool -> the block size its live trajectories are charged at (absent: 1)
        self._charged_at: dict[str, int] = {}
        self._live: dict[str, _Live] = {}
        #: domain -> the final footprints (tokens) of its last ``mean_window`` finished
        #: trajectories, and their sum
        self._final: dict[str, tuple[deque[int], int]] = {}
        #: domain -> the mean final footprint in use (refreshed from ``_final``)
        self._mean: dict[str, float] = {}
        #: domain -> (first turns completed, their summed footprints in tokens); (second turns
        #: completed, the trajectories' projections then, summed); and the projection in use
        #: for a trajectory of it with fewer than two turns (from those two)
        self._first: dict[str, tuple[int, int]] = {}
        self._second: dict[str, tuple[int, float]] = {}
        self._projection: dict[str, float] = {}
        self._events_since_refresh = 0
        #: pools whose first wait was logged
        self._warned: set[str] = set()
        #: pool -> (live trajectories, their expected footprints summed)
        self._pools: dict[str, tuple[int, float]] = {}
        self._waiters: dict[str, deque[tuple[asyncio.Future[None], str, str, int]]] = {}
        #: first turns that had to wait, and the seconds they waited in all (the owner's
        #: clock), counted when each wait ended
        self.num_waits = 0
        self.wait_s = 0.0

    def expected_tokens(self, domain: str, tokens: int = 0, turns: int = 0,
                        first_prompt: int = 0) -> float:
        """Expected final KV footprint (tokens) of a trajectory of ``domain`` holding ``tokens``
        now after ``turns`` completed turns, its first prompt ``first_prompt`` tokens long
        (module docstring)."""
        mean = self._mean.get(domain)
        if mean is None:
            mean = self._projected(domain, tokens, turns, first_prompt)
        return max(float(tokens), mean)

    def _projected(self, domain: str, tokens: int, turns: int, first_prompt: int) -> float:
        prior = float(self.prior_tokens)
        cap = self.max_turns.get(domain)
        if cap is None:
            return prior
        if turns >= 2 and cap > 1:
            return min(prior, first_prompt + (tokens - first_prompt) * (cap - 1) / (turns - 1))
        own = self._projection.get(domain)
        if own is not None:
            return own
        if turns:
            return min(prior, float(tokens) * cap)
        if cap == 1 and tokens and self.max_tokens_per_turn is not None:
            # One turn: its prompt and at most one response, whatever the trajectory cap. An
            # agent's first turn is admitted before its prompt exists (0 tokens): the cap.
            return min(prior, float(tokens + self.max_tokens_per_turn))
        return prior

    def _charge_of(self, live: _Live) -> float:
        """``live``'s expected footprint rounded up to whole blocks of the size its pool's
        charges are at (``_block`` brings that up to date before every read)."""
        return self._charge(self.expected_tokens(live.domain, live.tokens, live.turns,
                                                 live.first_prompt),
                            self._charged_at.get(live.pool, 1))

    def _block(self, pool: str) -> int:
        """Tokens per KV block of ``pool`` now (1 when not known); charges its live
        trajectories again when it changed (a worker reported its block size only now)."""
        size = self.block_tokens(pool) if self.block_tokens is not None else None
        size = size if size is not None and size > 1 else 1
        if self._charged_at.get(pool, 1) != size:
            self._charged_at[pool] = size
            n, total = 0, 0.0
            for live in self._live.values():
                if live.pool == pool:
                    live.expected = self._charge_of(live)
                    n, total = n + 1, total + live.expected
            if n:
                self._pools[pool] = (n, total)
        return size

    @staticmethod
    def _charge(tokens: float, block: int) -> float:
        """``tokens`` rounded up to whole blocks of ``block`` tokens (1: as they are)."""
        return tokens if block == 1 else float(math.ceil(tokens / block) * block)

    def pool_tokens(self, pool: str) -> float:
        """Expected footprints (tokens, each rounded up to whole KV blocks of ``pool``) of the
        live trajectories on ``pool``, summed."""
        self._block(pool)
        return self._pools.get(pool, (0, 0.0))[1]

    def num_live(self, pool: str) -> int:
        return self._pools.get(pool, (0, 0.0))[0]

    def fits(self, pool: str, domain: str, num_prompt_tokens: int = 0) -> bool:
        """Whether a new trajectory of ``domain`` whose first prompt is ``num_prompt_tokens``
        long may start on ``pool`` now."""
        cap = self.capacity(pool)
        if cap is None or not self.num_live(pool):
            return True
        own = self._charge(self.expected_tokens(domain, num_prompt_tokens), self._block(pool))
        return self.pool_tokens(pool) + own <= self.share * cap

    def is_live(self, traj_id: str) -> bool:
        return traj_id in self._live

    async def admit(self, traj_id: str, pool: str, domain: str, num_prompt_tokens: int,
                    clock: Callable[[], float]) -> None:
        """Start ``traj_id`` (of ``domain``, first prompt ``num_prompt_tokens`` long) on
        ``pool``: at once when it fits and no earlier trajectory waits for that pool, else when
        trajectories ending on the pool made room. Cancelling the caller while it waits leaves
        nothing behind."""
        if self.try_start(traj_id, pool, domain, num_prompt_tokens):
            return
        queue = self._waiters.setdefault(pool, deque())
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append((fut, traj_id, domain, num_prompt_tokens))
        if pool not in self._warned:
            self._warned.add(pool)
            log.warning("affinity: pool %s: its live trajectories' expected KV footprints "
                        "(%.0f tokens) leave no room in its KV cache (%s tokens) for a new "
                        "one's (%.0f); new trajectories wait for room (working-set hold)",
                        pool, self.pool_tokens(pool), self.capacity(pool),
                        self._charge(self.expected_tokens(domain, num_prompt_tokens),
                                     self._block(pool)))
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

    def try_start(self, traj_id: str, pool: str, domain: str, num_prompt_tokens: int) -> bool:
        """Start ``traj_id`` on ``pool`` now if :meth:`admit` would not wait (it fits and no
        earlier trajectory waits for that pool); ``True`` also when it is live already."""
        if traj_id in self._live:
            return True
        if self._waiters.get(pool) or not self.fits(pool, domain, num_prompt_tokens):
            return False
        self._start(traj_id, pool, domain, num_prompt_tokens)
        return True

    def _start(self, traj_id: str, pool: str, domain: str, tokens: int) -> None:
        live = _Live(pool, domain, tokens, tokens, 0.0)
        live.expected = self._charge_of(live)
        self._live[traj_id] = live
        n, total = self._pools.get(pool, (0, 0.0))
        self._pools[pool] = (n + 1, total + live.expected)

    def held(self, traj_id: str, tokens: int) -> None:
        """``traj_id``'s worker holds ``tokens`` KV tokens for it now (after a turn). The
        caller pokes the trajectory's pool (its sum may have fallen)."""
        live = self._live.get(traj_id)
        if live is None:
            return
        live.turns += 1
        live.tokens = tokens
        expected = self._charge_of(live)
        n, total = self._pools[live.pool]
        self._pools[live.pool] = (n, total + expected - live.expected)
        live.expected = expected
        if live.domain in self._mean or live.domain not in self.max_turns:
            return
        if live.turns == 1:
            count, summed = self._first.get(live.domain, (0, 0))
            self._first[live.domain] = (count + 1, summed + tokens)
            self._event(live.pool)
        elif live.turns == 2:
            count, projected = self._second.get(live.domain, (0, 0.0))
            self._second[live.domain] = (count + 1, projected + self._projected(
                live.domain, tokens, 2, live.first_prompt))
            self._event(live.pool)

    def ended(self, traj_id: str, *, finished: bool = True) -> None:
        """``traj_id`` ended: the first trajectories waiting for its pool (for every pool, when
        the means were refreshed) that now fit start. Its footprint counts in its domain's mean
        when it ``finished`` its turns after at least one; one cut short (failed, cancelled,
        restarted as stale) held only part of what its turns would have grown to, and would
        bias the mean low."""
        live = self._live.pop(traj_id, None)
        if live is None:
            return
        n, total = self._pools[live.pool]
        self._pools[live.pool] = (n - 1, total - live.expected) if n > 1 else (0, 0.0)
        if live.turns and finished:
            window, tokens = self._final.get(live.domain) or (deque(), 0)
            window.append(live.tokens)
            tokens += live.tokens
            if len(window) > self.mean_window:
                tokens -= window.popleft()
            self._final[live.domain] = (window, tokens)
            self._event(live.pool)
        self._wake(live.pool)

    def _event(self, pool: str) -> None:
        """A finish, a first or a second turn: refresh the domain means and projections once
        enough accumulated."""
        self._events_since_refresh += 1
        if self._events_since_refresh >= REFRESH_FRACTION * len(self._live):
            self._refresh()
            # New means change every pool's sum, not only this one's.
            for other in [p for p in self._waiters if p != pool]:
                self._wake(other)

    def _refresh(self) -> None:
        """The domain means (over each domain's window of finishes) and projections from
        the events so far, and every live expectation and pool sum under them (also clears
        the sums' rounding drift)."""
        self._events_since_refresh = 0
        self._mean = {d: tokens / len(window) for d, (window, tokens) in self._final.items()}
        self._projection = {}
        for d, (count, tokens) in self._first.items():
            self._projection[d] = min(float(self.prior_tokens), tokens / count * self.max_turns[d])
        for d, (count, projected) in self._second.items():
            self._projection[d] = projected / count
        pools: dict[str, tuple[int, float]] = {}
        for live in self._live.values():
            live.expected = self._charge_of(live)
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
