"""Stateful property test of ``KVWorkingSet`` against a plain reference model.

A hypothesis ``RuleBasedStateMachine`` drives the real ``KVWorkingSet`` (on its own event loop,
with a fake clock) through arbitrary interleavings of first-turn admissions, replies (``held``
then ``poke``, as ``LLMProxy`` does after a checked turn), aborted replies (``poke`` only), ends
(of trajectories that turned or not, and of unknown ones), cancellations of waiting first turns
(also in the same instant as their wake-up), capacity changes (with or without a ``poke``) and
the passing of time, over two pools and two domains (one with a turn cap, projected before its
first finish, a one-turn cap drawn too, with or without a response cap; one without, at the
prior until then), with KV block sizes drawn per pool (not known, 1, 16 or 128 tokens, and
changing as capacities do). The model keeps every live trajectory's
tokens and turns and recomputes each pool's expected footprints, each rounded up to whole
blocks of its pool's block size now, from scratch (no incremental sums), and keeps the domain means and projections in use by the documented refresh rule (once
the finishes, first and second turns since the last refresh reach ``REFRESH_FRACTION`` of
the live trajectories; larger fractions are drawn too, so that the means go stale between
refreshes with few live trajectories; a domain's mean is over its last ``mean_window``
finishes, small windows drawn too, so that old finishes leave it). It checks:

- ``pool_tokens`` / ``num_live`` equal the model's recomputation (so incremental sums neither
  drift nor go negative), and every pool's sum is exactly 0 once its last trajectory ended;
- ``expected_tokens`` equals the model's;
- a trajectory cut short (``finished=False``) leaves its domain's mean alone;
- a first turn starts at once exactly when no one waits for its pool and it fits (its own
  prompt counted; an empty or unknown-capacity pool takes anything), else it waits;
- waiters start first come first served, exactly as many as fit after each end / poke /
  cancellation (ties within rounding of the capacity bound may go either way);
- ``num_waiting``, ``full``, ``is_live`` agree with the model; ``num_waits`` counts each wait
  once when it ends (started or cancelled) and ``wait_s`` sums their fake-clock seconds;
- at teardown, ending every live trajectory starts or leaves nothing behind: no live
  trajectory, no waiter, every sum 0.
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from rollart.controller.routing import workingset
from rollart.controller.routing.workingset import REFRESH_FRACTION, KVWorkingSet

POOLS = ("A", "B")
DOMAINS = ("d", "e")
EPS = 1e-6  # fits decisions within this of the bound may go either way (float sums)


class WorkingSetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.now = 0.0
        self.cap: dict[str, int | None] = {"A": 400, "B": None}
        self.block: dict[str, int | None] = {"A": None, "B": None}
        self.prior = 100
        self.share = 1.0
        self.max_tokens_per_turn: int | None = None
        self.ws: KVWorkingSet | None = None
        # the model
        self.live: dict[str, list] = {}  # traj -> [pool, domain, tokens, turns, first prompt]
        self.final: dict[str, list[int]] = {}  # domain -> its last ``window`` footprints
        self.window = workingset.MEAN_WINDOW
        self.mean: dict[str, float] = {}
        self.max_turns: dict[str, int] = {}
        self.first: dict[str, tuple[int, int]] = {}
        self.second: dict[str, tuple[int, float]] = {}
        self.projection: dict[str, float] = {}
        self.since_refresh = 0
        self.queue: dict[str, list[tuple[str, str, int]]] = {p: [] for p in POOLS}
        self.tasks: dict[str, asyncio.Task] = {}
        self.wait_started: dict[str, float] = {}
        self.num_waits = 0
        self.wait_s = 0.0
        self.n = 0
        self.fraction = REFRESH_FRACTION

    # -- helpers ------------------------------------------------------------------------------

    def _ws(self) -> KVWorkingSet:
        if self.ws is None:
            self.ws = KVWorkingSet(lambda p: self.cap[p], prior_tokens=self.prior,
                                   share=self.share, max_turns=self.max_turns,
                                   mean_window=self.window,
                                   max_tokens_per_turn=self.max_tokens_per_turn,
                                   block_tokens=lambda p: self.block[p])
        return self.ws

    def _settle(self) -> None:
        for _ in range(3):
            self.loop.run_until_complete(asyncio.sleep(0))

    def projected(self, domain: str, tokens: int, turns: int, first: int) -> float:
        prior, cap = float(self.prior), self.max_turns.get(domain)
        if cap is None:
            return prior
        if turns >= 2 and cap > 1:
            return min(prior, first + (tokens - first) * (cap - 1) / (turns - 1))
        if domain in self.projection:
            return self.projection[domain]
        if turns:
            return min(prior, float(tokens) * cap)
        if cap == 1 and tokens and self.max_tokens_per_turn is not None:
            return min(prior, float(tokens + self.max_tokens_per_turn))
        return prior

    def expected(self, domain: str, tokens: int, turns: int = 0, first: int = 0) -> float:
        if domain in self.mean:
            return max(float(tokens), self.mean[domain])
        return max(float(tokens), self.projected(domain, tokens, turns, first))

    def charge(self, pool: str, tokens: float) -> float:
        size = self.block[pool] or 1
        return tokens if size == 1 else float(-(-tokens // size) * size)

    def pool_sum(self, pool: str) -> float:
        return sum(self.charge(p, self.expected(d, t, k, f))
                   for p, d, t, k, f in self.live.values() if p == pool)

    def n_live(self, pool: str) -> int:
        return sum(1 for p, *_ in self.live.values() if p == pool)

    def margin(self, pool: str, domain: str, tokens: int) -> float | None:
        """share x cap - (sum + own); None: fits unconditionally."""
        cap = self.cap[pool]
        if cap is None or not self.n_live(pool):
            return None
        return self.share * cap - (self.pool_sum(pool)
                                   + self.charge(pool, self.expected(domain, tokens)))

    def check_fit(self, pool: str, domain: str, tokens: int, started: bool) -> None:
        m = self.margin(pool, domain, tokens)
        if m is None or abs(m) > EPS:
            want = m is None or m >= 0
            assert started == want, (pool, domain, tokens, m, started)

    def model_wake(self, pool: str) -> None:
        """Compare the real wake-up of ``pool``'s waiters with the model's, in order."""
        q = self.queue[pool]
        while q:
            traj, domain, tokens = q[0]
            started = self._ws().is_live(traj)
            self.check_fit(pool, domain, tokens, started)
            if not started:
                break
            q.pop(0)
            self.live[traj] = [pool, domain, tokens, 0, tokens]
        for traj, *_ in q:  # FCFS: no later one started past a held one
            assert not self._ws().is_live(traj), f"{traj} started out of order"

    def end_waits_of_started(self) -> None:
        for traj, task in list(self.tasks.items()):
            if task.done():
                del self.tasks[traj]
                if traj in self.wait_started:
                    self.num_waits += 1
                    self.wait_s += self.now - self.wait_started.pop(traj)

    # -- rules --------------------------------------------------------------------------------

    @initialize(cap_a=st.sampled_from([None, 50, 150, 400, 1000]), prior=st.integers(1, 300),
                share=st.sampled_from([1.0, 0.5, 0.75, 0.3]),
                fraction=st.sampled_from([REFRESH_FRACTION, 0.25, 0.5, 1.0, 3.0]),
                max_turns=st.sampled_from([1, 2, 5]),
                window=st.sampled_from([workingset.MEAN_WINDOW, 1, 2, 3]),
                max_tokens_per_turn=st.one_of(st.none(), st.integers(1, 400)),
                block_a=st.sampled_from([None, 1, 16, 128]))
    def configure(self, cap_a: int | None, prior: int, share: float, fraction: float,
                  max_turns: int, window: int, max_tokens_per_turn: int | None,
                  block_a: int | None) -> None:
        """The run's parameters; ``fraction`` stands in for ``REFRESH_FRACTION`` (the module's
        own 1/64 refreshes at every event below 64 live trajectories, so larger ones let the
        means go stale between refreshes, as they do in a large run); domain ``d`` has a turn
        cap, ``e`` none; ``window`` small lets the means drop old finishes;
        ``max_tokens_per_turn`` bounds a one-turn trajectory before its domain's first turn."""
        self.cap["A"], self.prior, self.share = cap_a, prior, share
        self.block["A"] = block_a
        self.max_tokens_per_turn = max_tokens_per_turn
        self.window = window
        self.max_turns = {"d": max_turns}
        self.fraction = fraction
        workingset.REFRESH_FRACTION = fraction
        self._ws()

    @rule(pool=st.sampled_from(POOLS), domain=st.sampled_from(DOMAINS),
          prompt=st.integers(0, 400))
    def admit(self, pool: str, domain: str, prompt: int) -> None:
        ws = self._ws()
        self.n += 1
        traj = f"t{self.n}"
        waiting_before = bool(self.queue[pool])
        m = self.margin(pool, domain, prompt)
        task = self.loop.create_task(
            ws.admit(traj, pool, domain, prompt, lambda: self.now))
        self._settle()
        started = ws.is_live(traj)
        assert started == task.done()
        if waiting_before:
            assert not started, "started past earlier waiters"
        elif m is None or abs(m) > EPS:
            assert started == (m is None or m >= 0), (m, started)
        if started:
            self.live[traj] = [pool, domain, prompt, 0, prompt]
        else:
            self.queue[pool].append((traj, domain, prompt))
            self.tasks[traj] = task
            self.wait_started[traj] = self.now

    @precondition(lambda self: self.live)
    @rule(data=st.data(), grow=st.integers(0, 300), abort=st.booleans())
    def reply(self, data: st.DataObject, grow: int, abort: bool) -> None:
        ws = self._ws()
        traj = data.draw(st.sampled_from(sorted(self.live)))
        pool = self.live[traj][0]
        if not abort:
            tokens = self.live[traj][2] + grow
            ws.held(traj, tokens)
            entry = self.live[traj]
            entry[2], entry[3] = tokens, entry[3] + 1
            domain, turns = entry[1], entry[3]
            if domain not in self.mean and domain in self.max_turns and turns == 1:
                c, s = self.first.get(domain, (0, 0))
                self.first[domain] = (c + 1, s + tokens)
                self._event(pool)
            elif domain not in self.mean and domain in self.max_turns and turns == 2:
                c, s2 = self.second.get(domain, (0, 0.0))
                self.second[domain] = (c + 1, s2 + self.projected(domain, tokens, 2, entry[4]))
                self._event(pool)
        ws.poke(pool)
        self.model_wake(pool)
        self._settle()
        self.end_waits_of_started()

    def _end(self, traj: str, finished: bool = True) -> None:
        ws = self._ws()
        pool, domain, tokens, turns, _ = self.live.pop(traj)
        ws.ended(traj, finished=finished)
        if turns and finished:
            self.final[domain] = (self.final.get(domain, []) + [tokens])[-self.window:]
            self._event(pool)
        self.model_wake(pool)

    def _event(self, pool: str) -> None:
        """A finish or a first turn: the documented refresh rule."""
        self.since_refresh += 1
        if self.since_refresh >= self.fraction * len(self.live):
            self.since_refresh = 0
            self.mean = {d: sum(f) / len(f) for d, f in self.final.items()}
            self.projection = {d: min(float(self.prior), s / c * self.max_turns[d])
                               for d, (c, s) in self.first.items()}
            self.projection.update({d: s / c for d, (c, s) in self.second.items()})
            for other in sorted(self.queue):  # new means: every pool's waiters
                if other != pool:
                    self.model_wake(other)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), finished=st.booleans())
    def end(self, data: st.DataObject, finished: bool) -> None:
        """A trajectory ends: ``finished`` its turns, or cut short (its footprint is not a
        final one and stays out of its domain's mean)."""
        self._end(data.draw(st.sampled_from(sorted(self.live))), finished)
        self._settle()
        self.end_waits_of_started()

    @rule()
    def end_unknown(self) -> None:
        self._ws().ended("nobody")
        self._ws().held("nobody", 5)

    @precondition(lambda self: self.tasks)
    @rule(data=st.data())
    def cancel_waiter(self, data: st.DataObject) -> None:
        traj = data.draw(st.sampled_from(sorted(self.tasks)))
        task = self.tasks.pop(traj)
        pool = next(p for p, q in self.queue.items() if any(t == traj for t, *_ in q))
        task.cancel()
        self._settle()
        assert task.cancelled() and not self._ws().is_live(traj)
        self.queue[pool] = [w for w in self.queue[pool] if w[0] != traj]
        self.num_waits += 1
        self.wait_s += self.now - self.wait_started.pop(traj)
        self.model_wake(pool)
        self._settle()
        self.end_waits_of_started()

    @precondition(lambda self: self.live and self.tasks)
    @rule(data=st.data())
    def end_then_cancel_the_woken(self, data: st.DataObject) -> None:
        """A waiter woken by an end and cancelled in the same instant: live, its owner's
        cleanup ends it."""
        traj = data.draw(st.sampled_from(sorted(self.live)))
        self._end(traj)  # the model already moved the woken waiters to live
        woken = [t for t in list(self.tasks) if t in self.live]
        for t in woken:
            self.tasks[t].cancel()
        self._settle()
        for t in woken:
            task = self.tasks.pop(t)
            assert task.cancelled() and self._ws().is_live(t)
            self.num_waits += 1
            self.wait_s += self.now - self.wait_started.pop(t)
            self._end(t)  # the cancelled owner's release
            self._settle()
        self.end_waits_of_started()

    @rule(pool=st.sampled_from(POOLS), cap=st.sampled_from([None, 0, 50, 150, 400, 1000, 5000]),
          block=st.sampled_from([None, 1, 16, 128]), poke=st.booleans())
    def capacity_changes(self, pool: str, cap: int | None, block: int | None,
                         poke: bool) -> None:
        self._ws()
        self.cap[pool], self.block[pool] = cap, block
        if poke:
            self._ws().poke(pool)
            self.model_wake(pool)
            self._settle()
            self.end_waits_of_started()

    @rule(dt=st.floats(0.0, 10.0, allow_nan=False))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def sums_match_a_recomputation(self) -> None:
        if self.ws is None:
            return
        for pool in POOLS:
            assert self.ws.num_live(pool) == self.n_live(pool)
            got, want = self.ws.pool_tokens(pool), self.pool_sum(pool)
            assert got >= 0.0, (pool, got)
            assert abs(got - want) <= 1e-6 * max(1.0, want), (pool, got, want)
            if not self.n_live(pool):
                assert got == 0.0, (pool, got)
        for d in DOMAINS:
            for t in (0, 50, 1000):
                for k in (0, 1, 2, 3):
                    for f in (0, 20):
                        assert self.ws.expected_tokens(d, t, k, f) == self.expected(d, t, k, f)

    @invariant()
    def views_match(self) -> None:
        if self.ws is None:
            return
        for pool in POOLS:
            assert self.ws.num_waiting(pool) == len(self.queue[pool])
            cap = self.cap[pool]
            s = self.pool_sum(pool)
            full = bool(self.queue[pool]) or (cap is not None and s >= self.share * cap)
            if self.queue[pool] or cap is None or abs(s - self.share * cap) > EPS:
                assert self.ws.full(pool) == full
        assert self.ws.num_waiting() == sum(len(q) for q in self.queue.values())
        for traj in self.live:
            assert self.ws.is_live(traj)
        for traj in self.tasks:
            assert not self.ws.is_live(traj) and not self.tasks[traj].done()
        assert self.ws.num_waits == self.num_waits
        assert abs(self.ws.wait_s - self.wait_s) <= 1e-6 * max(1.0, self.wait_s)

    def teardown(self) -> None:
        try:
            if self.ws is not None:
                for traj in sorted(self.live):
                    if traj in self.live:
                        self._end(traj)
                        self._settle()
                        self.end_waits_of_started()
                # Waiters start as their pools empty (an empty pool takes its head, then the
                # next ones that fit): end those too, until none is left.
                for _ in range(1000):
                    if not self.live:
                        break
                    self._end(sorted(self.live)[0])
                    self._settle()
                    self.end_waits_of_started()
                assert not self.live and not self.tasks
                assert self.ws.num_waiting() == 0
                for pool in POOLS:
                    assert self.ws.num_live(pool) == 0 and self.ws.pool_tokens(pool) == 0.0
                assert self.ws.num_waits == self.num_waits
        finally:
            workingset.REFRESH_FRACTION = REFRESH_FRACTION
            for task in self.tasks.values():
                task.cancel()
            self.loop.run_until_complete(asyncio.sleep(0))
            self.loop.close()


WorkingSetMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestWorkingSetModel = WorkingSetMachine.TestCase
