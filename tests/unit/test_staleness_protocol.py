"""Stateful property tests of the staleness-bounded SampleBuffer and its version protocol.

A hypothesis ``RuleBasedStateMachine`` drives the real ``SampleBuffer`` with arbitrary
interleavings of group starts, turns (the serving worker lags the trainer by 0..1 versions),
completions, failures, cancellations, unbiased-selection deadlines, batch takes and version
bumps (only after a batch, as the trainer does). The test keeps its own model of every
trajectory's token versions, built only from what it fed the buffer, and checks:

- no trained sample has a generated token older than (version at consumption - alpha);
- no sample is trained twice, every batch is exactly ``batch_size`` samples of whole groups, and
  only completed (never failed or cancelled) trajectories are trained;
- no completed sample is lost: completed = consumed + dropped (with a reason, "stale" ones really
  stale) + still held, disjointly, and held samples are admissible now;
- the in-flight bound holds at all times, and admission pauses only at it;
- checkpoint/restore keeps every held sample and restarts the running work;
- liveness: driving every running trajectory to completion at the current version always yields
  a batch within a few rounds (a rule, and again at teardown);
- waste accounting: every generated token is trained, wasted under exactly one reason, or still
  in flight (in total and per domain), and the model's token count agrees with the buffer's;
- progress: members may be slow (``lag_one``: the rest of the run trains batches past one
  member, again and again, so its group's members go stale one after another) or stuck
  (``stick``: a member never takes another turn); no group in flight has started more than
  ``max_group_attempts`` trajectories per slot, no group still collecting members is older
  than the group time limit (``time_passes`` drops it, as the controller's timer does), the
  buffer keeps exactly one record per running or held trajectory (so at most the in-flight
  bound), and ``drive_to_batch`` still yields a batch with stuck members around.

``fresh_start`` (a first token waits for a version of headroom), ``abort_stale`` (running
trajectories made stale by a bump are aborted and restarted at once) and version-aware admission
(``capacity``: a group starts only if ``has_capacity`` for the newest serving worker) are drawn
per example, and so is ``hold_for_groups`` (a ready batch is held exactly while an open group
still collecting has a token the next version would make stale, or while it takes a group that
could join a later batch and the groups whose last chance is the next batch outnumber its
places, one of them still collecting; ``take_batch``'s ``release`` stands for the controller's
hold bound); liveness must hold under each. Every batch takes the groups the model's view of
the default batch order picks (last batch first, then oldest tokens, then oldest group).
Weights reach two simulated workers by *eager, staggered apply* (``apply_on_worker``: any worker
may take the trainer's newest version at any time, one at a time, independently of batches), and
a turn may straddle an apply (its first tokens at the old version, the rest at the new one).
Groups of the ``long`` domain carry their own larger bound (per-domain alpha); every trained
token is checked against its own group's bound.
"""

from __future__ import annotations

import random
from collections import Counter

import msgspec
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from rollart.controller.buffer.core import Sample, SampleBuffer

configs = st.fixed_dictionaries(
    {
        "alpha": st.integers(0, 2),
        "group_size": st.integers(1, 3),
        "groups_per_batch": st.integers(1, 2),
        "redundancy": st.integers(0, 2),
        "selection": st.sampled_from(["first", "unbiased"]),
        "check": st.sampled_from(["per_turn", "admission"]),
        "on_stale": st.sampled_from(["restart", "drop"]),
        "max_attempts": st.integers(1, 3),
        "long_extra_alpha": st.integers(0, 2),
        "fresh_start": st.booleans(),
        "abort_stale": st.booleans(),
        "capacity": st.booleans(),
        "max_group_attempts": st.sampled_from([None, 1, 2, 4]),
        "hold": st.booleans(),
    }
)
#: the group time limit in the model's time units (``time_passes``); a complete group found
#: at its deadline is checked again ``RECHECK`` later, as the controller does
GROUP_TIMEOUT, RECHECK = 10, 1
picks = st.integers(0, 10**6)


def make_sample(tid: str, group_key: str, versions: list[int], reward: float) -> Sample:
    """One prompt token (not generated) followed by the generated tokens with ``versions``."""
    n = len(versions)
    return Sample(
        sample_id=tid,
        group_key=group_key,
        token_ids=[1] + [2] * n,
        loss_mask=[0] + [1] * n,
        behaviour_logprobs=[0.0] + [-0.5] * n,
        versions=[-1, *versions],
        reward=reward,
    )


class StalenessProtocol(RuleBasedStateMachine):
    @initialize(cfg=configs, seed=st.integers(0, 2**16))
    def setup(self, cfg: dict, seed: int) -> None:
        self.cfg = cfg
        self.alpha = cfg["alpha"]
        self.G = cfg["group_size"]
        self.B = cfg["group_size"] * cfg["groups_per_batch"]
        self.k = cfg["redundancy"]
        # hold_for_groups: only with the per-turn check and the strict bound (SampleBuffer)
        self.hold = bool(cfg.get("hold")) and cfg["check"] == "per_turn" and cfg.get(
            "staleness_control", "bound") == "bound"
        self.buf = SampleBuffer(
            alpha=self.alpha,
            batch_size=self.B,
            group_size=self.G,
            redundancy=self.k,
            selection=cfg["selection"],
            check=cfg["check"],
            on_stale=cfg["on_stale"],
            max_attempts=cfg["max_attempts"],
            rng=random.Random(seed),
            on_drop=self._on_drop,
            fresh_start=cfg["fresh_start"],
            abort_stale=cfg["abort_stale"],
            max_group_attempts=cfg["max_group_attempts"],
            staleness_control=cfg.get("staleness_control", "bound"),
            hold_for_groups=self.hold,
        )
        self.cap = (self.alpha + 1) * self.B + self.k * self.buf.max_groups
        self.live: set[str] = set()
        self.group: dict[str, str] = {}
        self.tokens: dict[str, list[int]] = {}
        self.completed: set[str] = set()
        self.consumed: set[str] = set()
        self.dropped: dict[str, str] = {}
        self.failed_or_cancelled: set[str] = set()
        self.next_group = 0
        self.seed = seed
        self.base_consumed = self.base_dropped = 0
        self.restored = False
        self.workers = [0, 0]  # versions two inference workers serve
        self.galpha: dict[str, int] = {}  # group -> its bound
        self.generated = 0
        self.starts: Counter[str] = Counter()  # group -> trajectories started
        self.stuck: set[str] = set()  # live members that never take another turn
        self.now = 0
        self.deadline: dict[str, int] = {}  # open group -> its time limit

    # ------------------------------------------------------------------ helpers
    def _on_drop(self, tid: str, reason: str) -> None:
        assert tid in self.completed and tid not in self.dropped and tid not in self.consumed
        if reason == "stale":
            assert min(self.tokens[tid]) < self.buf.version - self.galpha[self.group[tid]], (
                f"{tid} dropped as stale with versions {self.tokens[tid]} at "
                f"version {self.buf.version}"
            )
        else:
            assert reason in ("unselected", "retired"), reason
        event(f"dropped {reason}")
        self.dropped[tid] = reason

    def _add(self, tid: str | None) -> None:
        if tid is not None:
            assert tid not in self.tokens, f"id {tid} issued twice"
            self.live.add(tid)
            self.group[tid] = self.buf.group_of(tid)
            self.tokens[tid] = []
            self.starts[self.group[tid]] += 1

    def _drain(self) -> None:
        for tid in self.buf.drain_aborts():
            # abort_stale: a bump made this running trajectory stale; abort and restart it.
            assert self.cfg["abort_stale"] and tid in self.live
            floor = self.buf.version - self.galpha[self.group[tid]]
            assert self.tokens[tid] and min(self.tokens[tid]) < floor, (tid, self.tokens[tid])
            self._gone(tid)
            self.failed_or_cancelled.add(tid)
            self._add(self.buf.restart_trajectory(tid))
        for tid in self.buf.drain_restarts():
            self._add(tid)
        for tid in self.buf.drain_cancels():
            # A group given up on its attempts: its live members are cancelled.
            assert self.cfg["max_group_attempts"] is not None
            self._cancel(tid)

    def _pick(self, i: int) -> str:
        return sorted(self.live)[i % len(self.live)]

    def _moving(self) -> list[str]:
        return sorted(self.live - self.stuck)

    def _pick_moving(self, i: int) -> str:
        moving = self._moving()
        return moving[i % len(moving)]

    def _gone(self, tid: str) -> None:
        self.live.discard(tid)
        self.stuck.discard(tid)

    def _start_group(self, long: bool = False) -> bool:
        key = f"g{self.next_group}"
        alpha = self.alpha + self.cfg["long_extra_alpha"] if long else self.alpha
        serving = max(self.workers)
        if self.cfg["capacity"] and not self.buf.has_capacity(serving, alpha):
            # Version-aware admission: every batch this group could join is spoken for.
            nxt = self.buf.version + (1 if self.buf.batch_outstanding else 0)
            assert self.buf.stats().groups_in_flight > 0 or serving + alpha < nxt
            return False
        ids = self.buf.try_start_group(key, "long" if long else "short", alpha)
        if ids is None:
            self._check_refusal()
            return False
        self.galpha[key] = alpha
        self.deadline[key] = self.now + GROUP_TIMEOUT
        self.next_group += 1
        assert len(ids) == self.G + self.k
        for tid in ids:
            self._add(tid)
        return True

    def _turn(self, tid: str, serving: int, ntok: int, newer: int = 0) -> str:
        """One turn served at ``serving``; its last ``newer`` tokens come after an apply of the
        trainer's version (staggered eager apply mid-turn)."""
        verdict = self.buf.begin_turn(tid, serving)
        event(f"verdict {verdict}")
        floor = self.buf.version - self.galpha[self.group[tid]]
        toks = self.tokens[tid]
        if verdict in ("continue", "drop"):
            if verdict == "continue" and (self.cfg["check"] == "per_turn" or not toks):
                assert all(v >= floor for v in toks) and serving >= floor
            newer = min(newer, ntok)
            versions = [serving] * (ntok - newer) + [self.buf.version] * newer
            self.buf.record_tokens(tid, versions)
            self.generated += ntok
            toks.extend(versions)
        elif verdict == "restart":
            assert toks and min(toks) < floor and self.cfg["on_stale"] == "restart"
            self._gone(tid)
            self.failed_or_cancelled.add(tid)
            self._add(self.buf.restart_trajectory(tid))
        elif verdict == "cancel":
            self.buf.cancel(tid)
            self._gone(tid)
            self.failed_or_cancelled.add(tid)
        else:
            # fresh_start: a first token needs one version of headroom (floor + 1).
            fresh = self.cfg["fresh_start"] and not toks and self.galpha[self.group[tid]] >= 1
            assert verdict == "wait" and serving < floor + (1 if fresh else 0), (
                verdict, serving, floor)
        self._drain()
        return verdict

    def _complete(self, tid: str, reward: float) -> list[str]:
        sample = make_sample(tid, self.group[tid], self.tokens[tid], reward)
        self._gone(tid)
        self.completed.add(tid)
        cancels = self.buf.complete(tid, sample)
        self._drain()
        for c in cancels:
            assert c in self.live and self.group[c] == self.group[tid], c
        return cancels

    def _cancel(self, tid: str) -> None:
        if tid in self.live:
            self.buf.cancel(tid)
            self._gone(tid)
            self.failed_or_cancelled.add(tid)
            self._drain()

    def _members(self, key: str) -> list[int]:
        """Token versions of group ``key``'s members that count for staleness: its held
        samples once it is complete (it trains on those), else its live and held ones."""
        held = self.completed - self.consumed - set(self.dropped)
        pool = held if self.buf.group_complete(key) else self.live | held
        return [v for t in pool if self.group[t] == key for v in self.tokens[t]]

    def _plan(self) -> list[str]:
        """The model's view of the default ``assemble_batch``: the complete groups whose last
        batch this is first, then those whose last but one, then the rest; within each, oldest
        token first, then oldest group. ``[]`` below a batch's worth of complete groups."""
        v = self.buf.version
        ready = []
        for key, *_ in self.buf.open_groups():
            if self.buf.group_complete(key):
                oldest = min([*self._members(key), v])
                tier = min(max(oldest + self.galpha[key] - v, 0), 2)
                ready.append((tier, oldest, int(key[1:]), key))
        need = self.B // self.G
        return [r[-1] for r in sorted(ready)[:need]] if len(ready) >= need else []

    def _at_risk(self, plan: list[str]) -> bool:
        """The model's view of ``holds_batch`` for a batch taking ``plan``: an open group
        still collecting has a member (running or held) with a token that the next version
        makes stale; or the batch takes a group that could join a later batch while more
        groups than a batch holds have their last chance at the next version, one of them
        still collecting."""
        nxt = self.buf.version + 1
        at_next, waiting = 0, False
        for key, *_ in self.buf.open_groups():
            if key in plan:
                continue
            toks = self._members(key)
            complete = self.buf.group_complete(key)
            if not complete and any(v < nxt - self.galpha[key] for v in toks):
                return True
            if toks and min(toks) == nxt - self.galpha[key]:
                at_next += 1
                waiting |= not complete
        younger = any(not self._members(k) or min(self._members(k)) > nxt - self.galpha[k]
                      for k in plan)
        return younger and waiting and at_next > self.B // self.G

    def _take(self, release: bool = False) -> bool:
        """Take a batch; ``release``: the controller's hold bound has passed (``hold``)."""
        version = self.buf.version
        plan = self._plan()
        at_risk = bool(plan) and self._at_risk(plan)
        batch = self.buf.take_batch(hold=not release)
        self._drain()
        if batch is None:
            if self.buf.holding:
                assert self.hold and not release and at_risk, "held a batch for no group"
                event("batch held for a group")
            return False
        assert not (self.hold and not release and at_risk), "took a batch a group is held for"
        assert len(batch) == self.B
        event(f"batch at version {min(version, 3)}{'+' if version >= 3 else ''}")
        counts = Counter(s.group_key for s in batch)
        assert all(c == self.G for c in counts.values()), counts
        assert sorted(counts) == sorted(plan), (counts, plan)
        ids = [s.sample_id for s in batch]
        assert len(set(ids)) == len(ids)
        for s in batch:
            tid = s.sample_id
            assert tid in self.completed and tid not in self.failed_or_cancelled
            assert tid not in self.consumed, f"{tid} trained twice"
            assert tid not in self.dropped
            self._check_trained(tid, version)
            self.consumed.add(tid)
        return True

    def _check_trained(self, tid: str, version: int) -> None:
        """The staleness bound of a sample trained at ``version``."""
        assert all(v >= version - self.galpha[self.group[tid]] for v in self.tokens[tid]), (
            f"{tid} versions {self.tokens[tid]} trained at version {version}"
        )

    def _check_refusal(self) -> None:
        """Admission pauses only at the in-flight bound."""
        assert self.buf.stats().groups_in_flight >= self.buf.max_groups

    def _check_held(self, tid: str) -> None:
        """Held samples are re-checked on every version bump: all admissible now."""
        floor = self.buf.version - self.galpha[self.group[tid]]
        assert all(v >= floor for v in self.tokens[tid])

    # ------------------------------------------------------------------ rules
    @rule(long=st.booleans())
    def start_group(self, long: bool) -> None:
        self._start_group(long)

    @precondition(lambda self: self.live - self.stuck)
    @rule(i=picks, lag=st.integers(0, 1), ntok=st.integers(1, 4))
    def turn(self, i: int, lag: int, ntok: int) -> None:
        self._turn(self._pick_moving(i), max(0, self.buf.version - lag), ntok)

    @rule(w=st.integers(0, 1))
    def apply_on_worker(self, w: int) -> None:
        """Eager, staggered apply: worker ``w`` takes the trainer's newest version now (right
        after its push, before any batch), while the other keeps serving its own."""
        self.workers[w] = self.buf.version

    @precondition(lambda self: self.live - self.stuck)
    @rule(i=picks, w=st.integers(0, 1), ntok=st.integers(1, 4), newer=st.integers(0, 4))
    def turn_on_worker(self, i: int, w: int, ntok: int, newer: int) -> None:
        """A turn on worker ``w``; if that worker lags, an apply may land mid-turn (the last
        ``newer`` tokens at the new version) and the worker then serves it."""
        tid = self._pick_moving(i)
        serving = self.workers[w]
        if serving == self.buf.version:
            newer = 0
        if self._turn(tid, serving, ntok, newer) in ("continue", "drop") and newer:
            self.workers[w] = self.buf.version

    @precondition(lambda self: self.live - self.stuck)
    @rule(i=picks, reward=st.floats(-1, 1), cancel_now=st.booleans())
    def complete(self, i: int, reward: float, cancel_now: bool) -> None:
        for c in self._complete(self._pick_moving(i), reward):
            if cancel_now:
                self._cancel(c)

    @precondition(lambda self: self.live)
    @rule(i=picks, reason=st.sampled_from(["env_error", "reward_error", "worker_lost"]))
    def fail(self, i: int, reason: str) -> None:
        tid = self._pick(i)
        self._gone(tid)
        self.failed_or_cancelled.add(tid)
        self._add(self.buf.fail(tid, reason))
        self._drain()

    @precondition(lambda self: self.live)
    @rule(i=picks)
    def cancel(self, i: int) -> None:
        self._cancel(self._pick(i))

    @precondition(lambda self: self.live)
    @rule(i=picks)
    def close_group(self, i: int) -> None:
        for c in self.buf.close_group(self.group[self._pick(i)]):
            self._cancel(c)

    @precondition(lambda self: not self.buf.batch_outstanding)
    @rule(release=st.booleans())
    def take_batch(self, release: bool) -> None:
        self._take(release)

    @precondition(lambda self: self.buf.batch_outstanding)
    @rule()
    def advance_version(self) -> None:
        self.buf.advance_version()
        self._drain()

    @precondition(lambda self: not self.buf.batch_outstanding)
    @rule(via_json=st.booleans())
    def checkpoint_and_restore(self, via_json: bool) -> None:
        """Resume from a snapshot: held samples survive, running work restarts fresh."""
        snap = self.buf.snapshot()
        if via_json:
            snap = msgspec.json.decode(msgspec.json.encode(snap))
        held = self.buf.held_sample_ids()
        self.buf = SampleBuffer.restore(snap, rng=random.Random(self.seed), on_drop=self._on_drop)
        # Not a checkpointed setting: the caller's (the controller sets the scenario's).
        self.buf.max_group_attempts = self.cfg["max_group_attempts"]
        self.buf.hold_for_groups = self.hold
        self.failed_or_cancelled |= self.live
        self.live.clear()
        self.stuck.clear()
        # A restored group counts its attempts from its restored members; its time anew.
        self.starts = Counter(self.group[tid] for tid in held)
        self.deadline = {key: self.now + GROUP_TIMEOUT for key, *_ in self.buf.open_groups()}
        self.base_consumed, self.base_dropped = len(self.consumed), len(self.dropped)
        self.restored = True
        self._drain()
        assert self.buf.held_sample_ids() == held - set(self.dropped)

    @precondition(lambda self: self.live - self.stuck)
    @rule(i=picks)
    def stick(self, i: int) -> None:
        """A member that never takes another turn (a hung env step, say): only a failure (its
        timeout), a cancel, or its group's time limit ends it."""
        self.stuck.add(self._pick_moving(i))

    @precondition(lambda self: self.live - self.stuck)
    @rule(i=picks)
    def lag_one(self, i: int) -> None:
        """One member is slow: it takes a turn, then every other moving trajectory runs to
        completion and a batch is trained past it (again and again when repeated, so its
        siblings finish and go stale while it lags)."""
        slow = self._pick_moving(i)
        self._turn(slow, self.buf.version, 1)
        if self.buf.batch_outstanding:
            self.buf.advance_version()
            self._drain()
        self.workers = [self.buf.version] * len(self.workers)
        while self._start_group():
            pass
        self._run_all(skip={slow})
        # Held for the slow member (``hold``) until the controller's hold bound passes.
        if self._take() or self._take(release=True):
            self.buf.advance_version()
            self._drain()

    @rule(dt=st.integers(1, GROUP_TIMEOUT))
    def time_passes(self, dt: int) -> None:
        """The caller's group time limit (the buffer has no clock): a group still collecting
        members at its deadline is dropped and its live members cancelled (and a consumed or
        retired group's stragglers); a complete one waits for the trainer and is checked
        again later."""
        self.now += dt
        for key, due in sorted(self.deadline.items()):
            if due > self.now:
                continue
            if self.buf.group_complete(key):
                self.deadline[key] = self.now + RECHECK
                continue
            del self.deadline[key]
            if self.buf.group_status(key) == "open":
                live = self.buf.drop_group(key, "group_timeout")
                assert self.buf.group_status(key) != "open"
            else:  # stragglers of a consumed or retired group (stuck ones never learn it)
                live = self.buf.live_members(key)
            for tid in live:
                self._cancel(tid)

    def _run_all(self, skip: set[str]) -> None:
        """Every running trajectory but the stuck and ``skip`` ones takes one turn (so the
        ones left over carry tokens of this version and go stale after the bump), then they
        complete one by one."""
        for tid in sorted(self.live - self.stuck - skip):
            if tid in self.live:
                assert self._turn(tid, self.buf.version, 1) != "wait"
        for tid in sorted(self.live - self.stuck - skip, key=lambda t: (self.group[t], t)):
            while tid in self.live and tid not in self.stuck:
                verdict = self._turn(tid, self.buf.version, 1)
                assert verdict != "wait"
                if verdict in ("continue", "drop"):
                    for c in self._complete(tid, 0.5):
                        self._cancel(c)

    @rule()
    def drive_to_batch(self) -> None:
        """Liveness: run the work to completion at the current version -> a batch.

        Every running trajectory first takes one turn, then they complete one by one until a
        batch can be taken. Stuck members never move: when a round brings no batch, their
        groups' time passes (``time_passes``) and new groups take their places.
        """
        if self.buf.batch_outstanding:
            self.buf.advance_version()
            self._drain()
        self.workers = [self.buf.version] * len(self.workers)  # the newest weights arrive
        for _ in range(12):
            if self._take():
                return
            while self._start_group():
                pass
            self._run_all(skip=set())
            if self.buf.ready_samples() >= self.B and self._take():
                return
            # Stuck members may hold the batch: the controller's hold bound releases it.
            if self.buf.ready_samples() >= self.B and self._take(release=True):
                return
            self.time_passes(GROUP_TIMEOUT)
        raise AssertionError(f"no batch after driving all work: {self.buf.stats()}")

    # ------------------------------------------------------------------ invariants
    @invariant()
    def in_flight_bound(self) -> None:
        s = self.buf.stats()
        held = self.completed - self.consumed - set(self.dropped)
        assert s.running == len(self.live) and s.held == len(held)
        assert s.in_flight == len(self.live) + len(held) <= s.in_flight_bound <= self.cap
        assert s.groups_in_flight <= self.buf.max_groups

    @invariant()
    def tokens_accounted(self) -> None:
        """Every generated token is trained, wasted for exactly one reason, or in flight."""
        s = self.buf.stats()
        assert s.generated_tokens == s.trained_tokens + sum(s.wasted_tokens.values()) \
            + s.in_flight_tokens
        if not self.base_consumed and not self.base_dropped and not self.restored:
            assert s.generated_tokens == self.generated
        assert sum(d.generated_tokens for d in s.domains.values()) == s.generated_tokens
        for reason, n in s.wasted_tokens.items():
            assert sum(d.wasted_tokens.get(reason, 0) for d in s.domains.values()) == n
        assert sum(d.trained for d in s.domains.values()) == s.consumed
        assert set(s.wasted_tokens) <= {"stale", "redundancy", "failed", "unselected", "retired", "resume"}

    @invariant()
    def nothing_lost(self) -> None:
        held = self.completed - self.consumed - set(self.dropped)
        assert self.buf.held_sample_ids() == held
        assert set(self.buf.running_ids()) == self.live
        s = self.buf.stats()
        assert s.consumed == len(self.consumed) - self.base_consumed
        assert sum(s.dropped.values()) == len(self.dropped) - self.base_dropped
        for tid in held:
            self._check_held(tid)

    @invariant()
    def progress(self) -> None:
        """No group past its bound in attempts or (while still collecting) in time; one
        buffer record per running or held trajectory."""
        s = self.buf.stats()
        assert len(self.buf._trajs) == s.in_flight <= s.in_flight_bound
        limit = self.cfg["max_group_attempts"]
        for key, *_ in self.buf.open_groups():
            if limit is not None:
                assert self.starts[key] <= limit * (self.G + self.k), (key, self.starts[key])
            if not self.buf.group_complete(key):
                assert self.now < self.deadline[key], (key, self.now, self.deadline[key])
        assert set(s.groups_dropped) <= {"attempts_exhausted", "group_attempts",
                                         "group_timeout"}
        if limit is None:
            assert "group_attempts" not in s.groups_dropped

    def teardown(self) -> None:
        if hasattr(self, "buf"):
            self.drive_to_batch()


StalenessProtocol.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStalenessProtocol = StalenessProtocol.TestCase
