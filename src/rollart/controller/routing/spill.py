"""Online hardware affinity: a saturated pool's domain spills its new trajectories to a pool
with room, and comes back when the pressure falls.

The scenario maps each task domain to a pool (``domains.pool``), the paper's static affinity.
Its weakness is that the split fits one load: when a domain's pool saturates while another pool
has room, the static rule keeps queueing that domain's requests. :class:`SpillPolicy` watches
each pool's pressure, as its workers report it with every reply
(``rollart.transport.messages.WorkerStats``):

- ``waiting_share``: requests the engines hold back (``num_waiting``: no KV room or no batch
  slot) over the requests they hold, summed over the pool's live workers, the requests queued
  in the controller's send window counted as waiting too. A worker's last ``WorkerStats``
  predates the requests sent to it since (at a step's burst it still shows the pool drained
  by the end of the last step): those (its requests in flight beyond the ones its stats
  hold) are held too, running up to the most requests the worker has been seen running at
  once (``PoolGauge``: its observed capacity, batch slots or KV room) and waiting beyond it,
  all waiting when its stats showed requests waiting, all running before any capacity is seen;
- ``kv_cache_usage``: the mean share of KV-cache blocks in use, over the workers that report it.

A pool with a paused worker (a weight update under way: requests wait for it, not for room) is
judged neither saturated nor roomy, so no domain moves on account of a pause.

A pool is **saturated** when ``waiting_share >= saturated_waiting_share``, its KV usage
``>= kv_usage_high``, or its KV cache is full of its live trajectories' working sets
(``working_set_full``: the proxy holds new trajectories' first turns for it,
``rollart.controller.routing.workingset``); it has **room** when ``waiting_share <=
room_waiting_share``, its KV usage is below ``kv_usage_high`` and its working sets leave room. A domain whose home pool is saturated while another has room
spills: its *new* trajectories go to the pool with room that has the lowest waiting share. A
live trajectory's next turn never moves: its prefix lives on its worker (the proxy keeps each
trajectory on the pool it started on). The domain returns home once the home pool has room
again and the spill has lasted ``min_hold_s`` (hysteresis: the two thresholds and the hold keep
a pool at the edge from flapping), or at once when its spill target saturates in turn. When
nothing saturates the static mapping is the rule.

Every transition is logged (one WARNING line per move, visible at ``rollart run``'s default
log level) and counted, the latest kept
(:attr:`SpillPolicy.transitions`, :attr:`SpillPolicy.num_moves`), spills per domain and target
pool (:attr:`SpillPolicy.num_spills`) and returns per domain (:attr:`SpillPolicy.num_returns`);
trajectories routed away from their home pool are counted per domain
(:attr:`SpillPolicy.num_spilled`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

#: moves kept for the step metrics (a flapping pool must not grow memory)
MAX_KEPT_MOVES = 256


class _Stats(Protocol):
    @property
    def paused(self) -> bool: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float | None: ...


class _Worker(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def last_stats(self) -> _Stats | None: ...


@dataclass(frozen=True)
class PoolPressure:
    """One pool's pressure now: ``waiting_share`` in [0, 1] (0 with nothing held), the mean
    ``kv_usage`` in [0, 1] over the workers that report it (``None``: none does), and whether a
    worker is ``paused``."""

    waiting_share: float
    kv_usage: float | None
    paused: bool = False
    #: the pool turns new trajectories away: its live trajectories' KV working sets fill its
    #: cache (``rollart.controller.routing.workingset``)
    working_set_full: bool = False


@dataclass(frozen=True)
class Transition:
    """A domain's move: ``to_pool`` is where its new trajectories go from time ``t`` (s, the
    controller's clock) on; ``why`` in words."""

    t: float
    domain: str
    from_pool: str
    to_pool: str
    why: str
    #: the domain's pool in the static affinity: a move to it is a return, any other a spill
    home: str


def pool_pressure(workers: Sequence[_Worker], window_waiting: Callable[[str], int],
                  in_flight: Callable[[str], int] | None = None,
                  capacity: Callable[[str], int] | None = None) -> PoolPressure:
    """The pressure of a pool with live ``workers``; ``window_waiting(name)``: requests of that
    worker waiting in the controller's send window; ``in_flight(name)``: requests sent to it
    and not ended (``None``: count only what its stats report); ``capacity(name)``: the most
    requests it has been seen running at once (module docstring)."""
    running = waiting = 0
    kv: list[float] = []
    paused = False
    for w in workers:
        stats = w.last_stats
        queued = window_waiting(w.name)
        run_w = wait_w = 0
        if stats is not None:
            paused = paused or stats.paused
            run_w, wait_w = stats.num_running, stats.num_waiting
            if stats.kv_cache_usage is not None:
                kv.append(stats.kv_cache_usage)
        if in_flight is not None:
            unseen = max(0, in_flight(w.name) - run_w - wait_w)  # sent since the stats
            cap = capacity(w.name) if capacity is not None else 0
            # Full when its stats showed requests waiting; no capacity seen yet: no basis to
            # call any of them waiting (a run's first burst).
            free = 0 if wait_w else max(0, cap - run_w) if cap else unseen
            run_w, wait_w = run_w + min(unseen, free), wait_w + max(0, unseen - free)
        running += run_w
        waiting += wait_w + queued
    held = running + waiting
    return PoolPressure(waiting / held if held else 0.0, sum(kv) / len(kv) if kv else None,
                        paused)


class PoolGauge:
    """Pool pressure as routing should read it: ``pool_pressure`` with the requests sent since
    each worker's last stats, and each worker's observed capacity (the most requests its
    stats ever showed running), kept here."""

    def __init__(self) -> None:
        #: worker name -> most requests seen running at once
        self.capacity: dict[str, int] = {}

    def pressure(self, workers: Sequence[_Worker], window_waiting: Callable[[str], int],
                 in_flight: Callable[[str], int]) -> PoolPressure:
        cap = self.capacity
        for w in workers:
            stats = w.last_stats
            if stats is not None and stats.num_running > cap.get(w.name, 0):
                cap[w.name] = stats.num_running
        return pool_pressure(workers, window_waiting, in_flight,
                             lambda name: cap.get(name, 0))


class SpillPolicy:
    """Which pool a domain's new trajectories go to (see the module docstring).

    Args:
        saturated_waiting_share: a pool at or above this waiting share is saturated, in (0, 1].
        room_waiting_share: a pool at or below it has room, in [0, saturated_waiting_share).
        kv_usage_high: KV-cache usage at or above which a pool is saturated, in (0, 1].
        min_hold_s: seconds a spill lasts at least before the domain may return home.
        clock: the controller's clock (seconds).

    Raises:
        ValueError: thresholds out of order or out of range.
    """

    def __init__(self, *, saturated_waiting_share: float,
                 room_waiting_share: float, kv_usage_high: float, min_hold_s: float,
                 clock: Callable[[], float]) -> None:
        if not 0.0 < saturated_waiting_share <= 1.0:
            raise ValueError(f"saturated_waiting_share {saturated_waiting_share} not in (0, 1]")
        if not 0.0 <= room_waiting_share < saturated_waiting_share:
            raise ValueError(f"room_waiting_share {room_waiting_share} not in "
                             f"[0, saturated_waiting_share = {saturated_waiting_share})")
        if not 0.0 < kv_usage_high <= 1.0:
            raise ValueError(f"kv_usage_high {kv_usage_high} not in (0, 1]")
        self.saturated_waiting_share = saturated_waiting_share
        self.room_waiting_share = room_waiting_share
        self.kv_usage_high = kv_usage_high
        self.min_hold_s = min_hold_s
        self.clock = clock
        #: domain -> (pool it spills to, since when)
        self._spilled: dict[str, tuple[str, float]] = {}
        #: per domain, trajectories started on a pool other than the domain's home
        self.num_spilled: dict[str, int] = {}
        #: the latest moves, in order (at most ``MAX_KEPT_MOVES``)
        self.transitions: deque[Transition] = deque(maxlen=MAX_KEPT_MOVES)
        #: moves so far
        self.num_moves = 0
        #: per domain, per pool spilled to: spills so far (moves away from home)
        self.num_spills: dict[str, dict[str, int]] = {}
        #: per domain: returns home so far
        self.num_returns: dict[str, int] = {}

    def saturated(self, p: PoolPressure) -> bool:
        return not p.paused and (p.waiting_share >= self.saturated_waiting_share
                or p.working_set_full
                or (p.kv_usage is not None and p.kv_usage >= self.kv_usage_high))

    def has_room(self, p: PoolPressure) -> bool:
        return not p.paused and not p.working_set_full and (
                p.waiting_share <= self.room_waiting_share
                and (p.kv_usage is None or p.kv_usage < self.kv_usage_high))

    def spilled_to(self, domain: str) -> str | None:
        """The pool ``domain`` spills to now, ``None`` when it is at home."""
        spill = self._spilled.get(domain)
        return spill[0] if spill is not None else None

    def pool_for(self, domain: str, home: str, pressure: Callable[[str], PoolPressure],
                 pools: Sequence[str]) -> str:
        """The pool a new trajectory of ``domain`` starts on, updating the domain's state.
        ``home``: the domain's pool in the static affinity; ``pressure(pool)``: that pool's
        pressure now; ``pools``: the pools with a live worker.
        """
        now = self.clock()
        spill = self._spilled.get(domain)
        if spill is not None:
            target, since = spill
            if target not in pools or self.saturated(pressure(target)):
                self._move(now, domain, target, home, home, f"pool {target!r} saturated in turn"
                           if target in pools else f"pool {target!r} has no live worker")
            elif now - since >= self.min_hold_s and self.has_room(pressure(home)):
                self._move(now, domain, target, home, home, f"pool {home!r} has room again")
            else:
                self.num_spilled[domain] = self.num_spilled.get(domain, 0) + 1
                return target
            return home
        if home not in pools:
            return home  # the proxy says the pool is exhausted; no spill hides a dead pool
        here = pressure(home)
        if not self.saturated(here):
            return home
        best: tuple[float, str] | None = None
        for name in pools:
            if name == home:
                continue
            p = pressure(name)
            if self.has_room(p) and (best is None or p.waiting_share < best[0]):
                best = (p.waiting_share, name)
        if best is None:
            return home
        kv = f", KV {here.kv_usage:.2f}" if here.kv_usage is not None else ""
        if here.working_set_full:
            kv += ", its KV cache full of live trajectories' working sets"
        self._move(now, domain, home, best[1], home,
                   f"pool {home!r} saturated (waiting share {here.waiting_share:.2f}{kv}), "
                   f"pool {best[1]!r} has room (waiting share {best[0]:.2f})")
        self.num_spilled[domain] = self.num_spilled.get(domain, 0) + 1
        return best[1]

    def _move(self, now: float, domain: str, src: str, dst: str, home: str, why: str) -> None:
        if dst == home:
            self._spilled.pop(domain, None)
            self.num_returns[domain] = self.num_returns.get(domain, 0) + 1
        else:
            self._spilled[domain] = (dst, now)
            to = self.num_spills.setdefault(domain, {})
            to[dst] = to.get(dst, 0) + 1
        self.transitions.append(Transition(now, domain, src, dst, why, home))
        self.num_moves += 1
        # WARNING: `rollart run` logs at WARNING, and a move is rare (one line per move, the
        # hold and the two thresholds keep it from flapping), so the user sees every one.
        log.warning("affinity: domain %s's new trajectories go to pool %s (from %s): %s",
                    domain, dst, src, why)
