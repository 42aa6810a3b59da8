"""Every admitted group finishes: trained, or dropped with a counted reason, within a bound on
the trajectories it starts (``max_group_attempts``) and on wall time (``run.group_timeout_s``).

The buffer cases drive the real ``SampleBuffer`` through a small discrete-event run (turns of
jittered length, a trainer that takes ``train_s`` per step, greedy admission, workers serving
the trainer's version): one member of the first group is slow once (its first turn takes
``slow_s``). Its siblings finish, are held, go stale, are replaced; the slow one is restarted
when it comes back; and from then on the members finish out of phase, each going stale
before the last one finishes. Without a limit the group is refilled for as long as the run
lasts (the first test shows it on this very run); with one it is given up and its place goes
to a new group.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import random

import pytest
from test_controller_faults import backends, check_batches, scenario
from test_controller_modes import run_steps

from helpers.fakes import LAZY_POLICY, FakeEnvHost
from rollart.config import parse_scenario
from rollart.controller import Cluster
from rollart.controller.buffer.core import Sample, SampleBuffer
from rollart.transport.errors import ConfigError


def make_sample(tid: str, key: str, versions: list[int]) -> Sample:
    n = len(versions)
    return Sample(sample_id=tid, group_key=key, token_ids=[1] + [2] * n, loss_mask=[0] + [1] * n,
                  behaviour_logprobs=[0.0] + [-0.5] * n, versions=[-1, *versions], reward=0.5)


def simulate(*, steps: int, on_stale: str = "restart", check: str = "per_turn",
             max_group_attempts: int | None = None, group_size: int = 2, batch_size: int = 4,
             turns: int = 4, turn_s: float = 0.5, jitter: float = 0.3, slow_s: float = 10.0,
             train_s: float = 2.0, seed: int = 0) -> dict:
    """Run ``steps`` training steps; returns what the checks need (trajectories started per
    group, the first group's fate, the largest record count seen, the buffer)."""
    buf = SampleBuffer(alpha=1, batch_size=batch_size, group_size=group_size,
                       on_stale=on_stale, check=check,  # type: ignore[arg-type]
                       max_group_attempts=max_group_attempts)
    rng = random.Random(seed)
    events: list[tuple[float, int, str, str, int]] = []
    order = itertools.count()
    now = 0.0
    tokens: dict[str, list[int]] = {}
    started: dict[str, int] = {}
    group_seq = itertools.count()
    training = False
    max_records = max_in_flight_bound = 0

    def push(at: float, kind: str, tid: str = "", turn: int = 0) -> None:
        heapq.heappush(events, (at, next(order), kind, tid, turn))

    def start(tid: str) -> None:
        tokens[tid] = []
        key = buf.group_of(tid)
        started[key] = started.get(key, 0) + 1
        push(now, "turn", tid, 0)

    def drain() -> None:
        for tid in buf.drain_aborts():
            fresh = buf.restart_trajectory(tid)
            if fresh is not None:
                start(fresh)
        for tid in buf.drain_restarts():
            start(tid)
        for tid in buf.drain_cancels():
            buf.cancel(tid)

    def admit() -> None:
        while (ids := buf.try_start_group(f"g{next(group_seq)}")) is not None:
            for tid in ids:
                start(tid)

    admit()
    while events and buf.version < steps:
        now, _, kind, tid, turn = heapq.heappop(events)
        if kind == "trained":
            buf.advance_version()
            training = False
        elif buf.is_live(tid):
            if turn == turns:
                for sibling in buf.complete(tid, make_sample(tid, buf.group_of(tid),
                                                             tokens[tid])):
                    buf.cancel(sibling)
            else:
                verdict = buf.begin_turn(tid, buf.version)
                if verdict == "cancel":
                    buf.cancel(tid)
                elif verdict == "restart":
                    fresh = buf.restart_trajectory(tid)
                    if fresh is not None:
                        start(fresh)
                else:
                    tokens[tid].append(buf.version)
                    buf.record_tokens(tid, [buf.version])
                    took = turn_s * (1 + jitter * (2 * rng.random() - 1))
                    if tid == "g0/1" and turn == 0:
                        took = slow_s  # slow once: the first turn of one member
                    push(now + took, "turn", tid, turn + 1)
        drain()
        if not training and not buf.batch_outstanding and buf.take_batch() is not None:
            training = True
            drain()
            push(now + train_s, "trained")
        admit()
        s = buf.stats()
        max_records = max(max_records, len(buf._trajs))
        max_in_flight_bound = max(max_in_flight_bound, s.in_flight_bound)
        assert len(buf._trajs) == s.in_flight <= s.in_flight_bound
    return {"buf": buf, "started": started, "g0_open": "g0" in buf._groups,
            "max_records": max_records, "max_in_flight_bound": max_in_flight_bound}


#: (on_stale, check, train_s, slow_s): runs where, without a limit, the first group never
#: finishes (the rollart and AReaL checks, both stale policies, a 10 s and a 100 s slow turn)
LIVELOCKS = [("restart", "per_turn", 2.0, 10.0), ("drop", "per_turn", 3.0, 10.0),
             ("restart", "admission", 3.0, 10.0), ("drop", "admission", 1.0, 100.0),
             ("restart", "per_turn", 1.0, 100.0)]


@pytest.mark.parametrize(("on_stale", "check", "train_s", "slow_s"), LIVELOCKS)
def test_without_a_group_limit_a_member_slow_once_keeps_its_group_refilled(
        on_stale: str, check: str, train_s: float, slow_s: float) -> None:
    """What the limit is for, on the run the next test uses: 100 steps after one member was
    slow once, its group is still open and has started dozens of trajectories per slot."""
    out = simulate(steps=100, on_stale=on_stale, check=check, train_s=train_s, slow_s=slow_s)
    assert out["g0_open"]
    assert out["started"]["g0"] > 20 * 2


@pytest.mark.parametrize(("on_stale", "check", "train_s", "slow_s"), LIVELOCKS)
def test_a_member_slow_once_does_not_keep_its_group_forever(
        on_stale: str, check: str, train_s: float, slow_s: float) -> None:
    limit = 8
    out = simulate(steps=100, on_stale=on_stale, check=check, train_s=train_s, slow_s=slow_s,
                   max_group_attempts=limit)
    buf, started = out["buf"], out["started"]
    assert not out["g0_open"], "the slow-once group is still open"
    assert max(started.values()) <= limit * 2  # no group past its bound, in attempts
    st = buf.stats()
    assert st.groups_dropped.get("group_attempts", 0) >= 1
    # Its waste is counted (and every token still accounted for).
    assert st.generated_tokens == st.trained_tokens + sum(st.wasted_tokens.values()) \
        + st.in_flight_tokens
    assert st.wasted_tokens.get("retired", 0) > 0
    # Records: one per running or held trajectory, never above the in-flight bound.
    assert out["max_records"] <= out["max_in_flight_bound"]
    assert buf.version == 100  # admission started new groups in its place: the run went on


def test_group_attempts_counts_every_kind_of_new_trajectory() -> None:
    """Retries, staleness restarts and stale replacements all use the group's attempts; the
    one past them gives the group up, lists its live members, drops its held ones."""
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=2, max_attempts=5,
                       max_group_attempts=2)
    a, b = buf.try_start_group("g")
    a2 = buf.fail(a, "env_error")  # retry: 3 of 4
    assert a2 is not None
    for tid in (a2, b):
        assert buf.begin_turn(tid, 0) == "continue"
        buf.record_tokens(tid, [0])
    buf.complete(b, make_sample(b, "g", [0]))
    for other in ("o1", "o2"):  # two batches of other groups: b and a2 go stale
        v = buf.version
        ids = buf.try_start_group(other)
        assert ids is not None
        for tid in ids:
            buf.begin_turn(tid, v)
            buf.record_tokens(tid, [v])
            buf.complete(tid, make_sample(tid, other, [v]))
        assert buf.take_batch() is not None
        buf.advance_version()  # at version 2, b is stale: replaced (4 of 4)
    (b3,) = buf.drain_restarts()
    assert buf.begin_turn(a2, 2) == "restart"  # a2 is stale: its restart would be the 5th
    assert buf.restart_trajectory(a2) is None
    assert sorted(buf.drain_cancels()) == [b3]
    assert buf.drain_cancels() == []
    buf.cancel(b3)
    st = buf.stats()
    assert st.groups_dropped == {"group_attempts": 1}
    assert st.running == st.held == st.groups_in_flight == 0
    assert len(buf._trajs) == 0
    with pytest.raises(ConfigError, match="max_group_attempts"):
        SampleBuffer(alpha=0, batch_size=2, group_size=2, max_group_attempts=0)


# ---------------------------------------------------------------------- the controller
def test_defaults_bound_every_group_out_of_the_box() -> None:
    run = parse_scenario('[[pools]]\nname = "p"\n[[domains]]\nname = "d"\nenv = "e"\n'
                         'pool = "p"\nreward = "r"\n', "t.toml").run
    assert run.trajectory_timeout_s is not None and run.group_timeout_s is not None
    assert run.group_timeout_s >= run.trajectory_timeout_s
    assert run.max_group_attempts == 8
    with pytest.raises(ConfigError, match="run.group_timeout_s: 100 s is below "
                                          "run.trajectory_timeout_s 200 s"):
        scenario(trajectory_timeout_s=200.0, group_timeout_s=100.0)


class StuckPromptEnv(FakeEnvHost):
    """Every session opened with the first seed seen (the first group's prompt) hangs on its
    first step; the others answer in 1 s."""

    stuck_seed: int | None = None

    async def step(self, session_id, action, *, timeout_s=None):
        s = self.sessions[session_id]
        if self.stuck_seed is None:
            self.stuck_seed = s.seed
        if s.seed == self.stuck_seed:
            await asyncio.sleep(1e9)
        return await super().step(session_id, action, timeout_s=timeout_s)


@pytest.mark.looptime
async def test_a_group_that_cannot_finish_is_dropped_at_its_timeout(caplog) -> None:
    # Its members time out at 400 s and are retried (3 attempts would end at 1200 s): the
    # group's own limit of 1000 s comes first.
    env = StuckPromptEnv(turns=2, latency=lambda i, s: 1.0)
    sc = scenario(trajectory_timeout_s=400.0, group_timeout_s=1000.0, env_timeout_s=1e8)
    caplog.set_level(logging.WARNING, logger="rollart.controller.rollout.admission")
    async with Cluster.from_scenario(sc, backends=backends(env)) as c:
        t0 = asyncio.get_running_loop().time()
        steps: list = []
        async with asyncio.timeout(1e5):
            while c.controller is None or c.controller.buffer.stats_dropped(
                    "group_timeout") == 0:
                steps += await run_steps(c, 1)
        dropped_at = asyncio.get_running_loop().time() - t0
        steps += await run_steps(c, 2)  # the run goes on
        assert c.controller is not None
        assert "g0" not in c.controller.groups
        assert c.controller.admission.group_deadline("g0") is None
        st = c.controller.buffer.stats()
    check_batches(steps)
    assert 1000.0 <= dropped_at < 1100.0
    assert st.groups_dropped == {"group_timeout": 1}
    assert st.failed == {"trajectory_timeout": 4}  # two attempts of its two members
    stuck = [sid for sid, s in env.sessions.items() if s.seed == env.stuck_seed]
    assert stuck == []  # every session of it was closed (its last members cancelled)
    assert any("group g0 dropped: not complete 1000 s after its admission" in r.getMessage()
               for r in caplog.records)


@pytest.mark.looptime
async def test_a_complete_group_waiting_for_the_trainer_is_not_timed_out() -> None:
    # Every trajectory takes ~2 s; the trainer 100 s per step: complete groups wait for it
    # far longer than group_timeout_s, and none is dropped.
    env = FakeEnvHost(turns=1, latency=lambda i, s: 1.0)
    sc = scenario(trajectory_timeout_s=10.0, group_timeout_s=20.0)
    b = backends(env)
    b.trainer.train_s = 100.0
    async with Cluster.from_scenario(sc, backends=b) as c:
        steps = await run_steps(c, 4)
        assert c.controller is not None
        st = c.controller.buffer.stats()
    check_batches(steps)
    assert st.groups_dropped == {}


@pytest.mark.looptime
@pytest.mark.parametrize(("mode", "alpha", "on_stale", "policy", "outcome"), [
    ("rollart", 1, "restart", "lazy", "group_attempts"),
    ("rollart", 1, "drop", "lazy", "group_attempts"),
    ("rollart", 1, "restart", "default", "trained"),
    ("areal", 1, "restart", "default", "trained"), ("one_off", 1, "restart", "default", "trained"),
    ("sync_plus", 0, "restart", "default", "trained"),
    ("sync", 0, "restart", "default", "trained")])
async def test_every_mode_finishes_a_group_whose_member_was_slow_once(
        mode: str, alpha: int, on_stale: str, policy: str, outcome: str) -> None:
    # Session 0 (a member of g0) takes 300 s for its first step; every other step 1 s, and
    # the trainer is instant. The group ends, trained or dropped with a counted reason (in
    # rollart mode under the lazy policy its siblings go stale while it waits, past
    # max_group_attempts; under the default policy it is trained), and the run trains on.
    # AReaL's policy trains it however stale; the modes without overlap wait.
    env = FakeEnvHost(turns=2, latency=lambda i, s: 300.0 if i == 0 and s == 0 else 1.0)
    sc = scenario(mode=mode, alpha=alpha, on_stale=on_stale, env_timeout_s=1e6,
                  **(LAZY_POLICY if policy == "lazy" else {}))
    loop_time = asyncio.get_running_loop().time
    async with Cluster.from_scenario(sc, backends=backends(env)) as c:
        steps = await run_steps(c, 1, timeout_s=5000.0)
        assert c.controller is not None
        ctl = c.controller
        async with asyncio.timeout(5000.0):
            while "g0" in ctl.groups:
                steps += await run_steps(c, 1, timeout_s=5000.0)
        steps += await run_steps(c, 1, timeout_s=5000.0)
        st = ctl.buffer.stats()
        trained = any(s.group_key == "g0" for step in steps for s in step.samples)
        assert ("trained" if trained else set(st.groups_dropped)) == (
            "trained" if outcome == "trained" else {outcome})
        assert loop_time() < 1000.0  # well within any wall-clock bound
    check_batches(steps)
