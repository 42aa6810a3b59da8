"""Online hardware affinity: a saturated pool's domain spills its new trajectories to a pool with
room and comes back with hysteresis; live trajectories never move; the static mapping rules when
nothing saturates; moves are counted in the step metrics."""

from __future__ import annotations

import array
import asyncio
import logging
from typing import Any

import pytest
from test_controller_modes import run_steps

from helpers.fakes import TOK, FakeEnvHost, FakeReward, FakeTrainer, FakeWorker, _toml
from rollart.config import parse_scenario
from rollart.controller import Backends, Cluster
from rollart.controller.routing.proxy import LLMProxy
from rollart.controller.routing.spill import PoolGauge, PoolPressure, SpillPolicy, pool_pressure
from rollart.transport import messages as m
from rollart.transport.errors import ConfigError


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def policy(clock: Clock, hold_s: float = 10.0) -> SpillPolicy:
    return SpillPolicy(saturated_waiting_share=0.25, room_waiting_share=0.05,
                       kv_usage_high=0.95, min_hold_s=hold_s, clock=clock)


def pressures(**by_pool: tuple[float, float | None] | tuple[float, float | None, bool]):
    """``pool -> PoolPressure(waiting_share, kv_usage[, paused])``."""
    return lambda name: PoolPressure(by_pool[name][0], by_pool[name][1],
                                     True in by_pool[name][2:])


def test_policy_spills_holds_and_returns_with_hysteresis() -> None:
    clock = Clock()
    p = policy(clock)
    pools = ["A", "B"]
    # Nothing saturated: the static mapping.
    assert p.pool_for("d", "A", pressures(A=(0.2, None), B=(0.0, None)), pools) == "A"
    # A saturated, B has room: spill to B.
    assert p.pool_for("d", "A", pressures(A=(0.5, None), B=(0.0, None)), pools) == "B"
    assert p.spilled_to("d") == "B" and p.num_spilled == {"d": 1}
    # A has room again but the hold has not passed: stay on B.
    clock.t = 5.0
    assert p.pool_for("d", "A", pressures(A=(0.0, None), B=(0.1, None)), pools) == "B"
    # Between the thresholds after the hold: still B (hysteresis).
    clock.t = 20.0
    assert p.pool_for("d", "A", pressures(A=(0.1, None), B=(0.1, None)), pools) == "B"
    # A has room and the hold passed: home.
    assert p.pool_for("d", "A", pressures(A=(0.05, None), B=(0.1, None)), pools) == "A"
    assert p.spilled_to("d") is None and p.num_spilled == {"d": 3}
    assert [(t.from_pool, t.to_pool) for t in p.transitions] == [("A", "B"), ("B", "A")]
    assert p.num_moves == 2 and {t.home for t in p.transitions} == {"A"}
    assert p.num_spills == {"d": {"B": 1}} and p.num_returns == {"d": 1}


def test_policy_returns_at_once_when_the_target_saturates_and_never_spills_without_room() -> None:
    clock = Clock()
    p = policy(clock, hold_s=1e9)
    assert p.pool_for("d", "A", pressures(A=(0.5, None), B=(0.0, None)), ["A", "B"]) == "B"
    # B saturated in turn (by KV usage alone): back home although the hold has not passed.
    assert p.pool_for("d", "A", pressures(A=(0.5, None), B=(0.0, 0.97)), ["A", "B"]) == "A"
    assert "saturated in turn" in p.transitions[-1].why
    # A saturated but B has no room (waiting above the room threshold): stay home.
    assert p.pool_for("d", "A", pressures(A=(0.9, None), B=(0.1, None)), ["A", "B"]) == "A"
    # The target pool lost its last worker: home.
    assert p.pool_for("d", "A", pressures(A=(0.9, None), B=(0.0, None)), ["A", "B"]) == "B"
    assert p.pool_for("d", "A", pressures(A=(0.9, None), B=(0.0, None)), ["A"]) == "A"


def test_policy_picks_the_pool_with_most_room_and_rejects_bad_thresholds() -> None:
    p = policy(Clock())
    got = p.pool_for("d", "A", pressures(A=(0.3, None), B=(0.04, None), C=(0.0, None)),
                     ["A", "B", "C"])
    assert got == "C"
    with pytest.raises(ValueError, match="room_waiting_share"):
        SpillPolicy(saturated_waiting_share=0.2, room_waiting_share=0.2, kv_usage_high=0.9,
                    min_hold_s=0, clock=Clock())


def stats(name: str, running: int, waiting: int, kv: float | None = None) -> m.WorkerStats:
    return m.WorkerStats(worker=name, num_running=running, num_waiting=waiting, version=0,
                         kv_cache_usage=kv)


def test_pool_pressure_counts_engine_and_send_window_waiting_and_kv_usage() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")
    a.last_stats = stats("a", 6, 2, kv=0.5)
    b.last_stats = stats("b", 4, 0)
    p = pool_pressure([a, b], {"a": 0, "b": 2}.__getitem__)
    assert p.waiting_share == pytest.approx(4 / 14)
    assert p.kv_usage == pytest.approx(0.5)  # b does not report it
    assert pool_pressure([FakeWorker("c")], lambda _: 0) == PoolPressure(0.0, None)


def test_requests_sent_since_the_last_stats_are_held_running_up_to_the_seen_capacity() -> None:
    a = FakeWorker("a")
    gauge = PoolGauge()
    # No capacity seen yet (a run's first burst): nothing to call waiting.
    assert gauge.pressure([a], lambda _: 0, lambda _: 10).waiting_share == 0.0
    a.last_stats = stats("a", 4, 0)  # seen running 4 at once
    assert gauge.pressure([a], lambda _: 0, lambda _: 4).waiting_share == 0.0
    a.last_stats = stats("a", 0, 0)  # drained at the end of a step ...
    # ... then a burst of 10: 4 run (the capacity seen), 6 wait.
    assert gauge.pressure([a], lambda _: 0, lambda _: 10).waiting_share == pytest.approx(0.6)
    # The stats showed waiting: the engine was full, so every newer request waits too.
    a.last_stats = stats("a", 4, 2)
    assert gauge.pressure([a], lambda _: 1, lambda _: 10).waiting_share == pytest.approx(
        (2 + 4 + 1) / 11)


class ArrivingWorker(FakeWorker):
    """Sets ``all_arrived`` once ``expect`` requests reached it and its peers (``arrived`` is
    shared), each then held or answered as a ``FakeWorker`` does."""

    def __init__(self, name: str, arrived: list[str], all_arrived: asyncio.Event,
                 expect: int) -> None:
        super().__init__(name)
        self.arrived, self.all_arrived, self.expect = arrived, all_arrived, expect

    async def generate(self, request: m.Generate, *, timeout_s=None) -> m.GenerateResult:
        self.arrived.append(self.name)
        if len(self.arrived) == self.expect:
            self.all_arrived.set()
        return await super().generate(request, timeout_s=timeout_s)


@pytest.mark.looptime
async def test_a_burst_sent_since_the_last_stats_spills_once_past_the_seen_capacity() -> None:
    """At a step's burst the home pool's last stats still show it drained: the requests sent
    since are what saturates it. Seen running 2 at once, A takes the burst's first 3 new
    trajectories (the third waits: share 1/3 >= 0.25, saturated) and the rest spill to B;
    read from the stats alone, A would look drained and take all 8."""
    arrived: list[str] = []
    all_arrived = asyncio.Event()
    a, b = ArrivingWorker("a", arrived, all_arrived, 8), ArrivingWorker("b", arrived,
                                                                        all_arrived, 8)
    proxy = LLMProxy({"A": ("h800", [a]), "B": ("h20", [b])}, {"d": "A"},
                     spill=policy(Clock()))
    a.last_stats = stats("a", 2, 0)
    assert proxy.route("seen", "d") is a  # the proxy has seen a run 2 at once
    a.last_stats = stats("a", 0, 0)  # drained at the end of the last step
    a._running.clear()  # a's engine holds the burst (its replies, and new stats, come later)
    sp = m.SamplingParams(max_tokens=8)
    burst = [asyncio.create_task(proxy.generate(f"t{i}", "d", f"r{i}", array.array(
        "i", [1, 2, 3]), sp)) for i in range(8)]
    await all_arrived.wait()
    assert a.last_stats == stats("a", 0, 0) and a.in_flight == 3
    assert proxy.pool_pressure("A").waiting_share == pytest.approx(1 / 3)
    a._running.set()
    await asyncio.gather(*burst)
    assert (len(a.requests), len(b.requests)) == (3, 5)


def spilling_proxy(clock: Clock) -> tuple[LLMProxy, FakeWorker, FakeWorker]:
    a, b = FakeWorker("a"), FakeWorker("b")
    proxy = LLMProxy({"A": ("h800", [a]), "B": ("h20", [b])}, {"d": "A"},
                     spill=policy(clock))
    return proxy, a, b


def test_proxy_spills_new_trajectories_only_and_keeps_each_on_its_pool() -> None:
    clock = Clock()
    proxy, a, b = spilling_proxy(clock)
    assert proxy.route("live", "d") is a  # started before any pressure
    a.last_stats = stats("a", 4, 4)  # half of A's requests wait
    assert proxy.route("new", "d") is b  # a new trajectory goes where there is room
    assert proxy.route("live", "d") is a  # the live one's next turn stays with its prefix
    # The domain returns home; the spilled trajectory still finishes on B.
    a.last_stats = stats("a", 1, 0)
    clock.t = 60.0
    assert proxy.route("later", "d") is a
    assert proxy.route("new", "d") is b
    proxy.release("new")
    assert proxy.route("new", "d") is a  # an id seen again after release is a new trajectory


def test_without_spill_the_static_mapping_holds_under_saturation() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")
    proxy = LLMProxy({"A": ("h800", [a]), "B": ("h20", [b])}, {"d": "A"})
    a.last_stats = stats("a", 4, 40)
    assert proxy.route("t", "d") is a


def scenario_text(enabled: bool = True, **aa: Any) -> str:
    lines = ["[run]", 'mode = "rollart"', "alpha = 1", "batch_size = 4", "group_size = 2",
             "max_turns = 2", "max_tokens_per_turn = 16", "max_tokens_per_trajectory = 512",
             "[run.adaptive_affinity]", f"enabled = {_toml(enabled)}", "min_hold_s = 0.0"]
    lines += [f"{k} = {_toml(v)}" for k, v in aa.items()]
    lines += ['[[pools]]\nname = "A"\nhardware = "h800"',
              '[[pools]]\nname = "B"\nhardware = "h20"',
              '[[domains]]\nname = "d"\nenv = "count"\npool = "A"\nreward = "fake"']
    return "\n".join(lines)


def test_config_rejects_inverted_thresholds_and_a_single_pool_that_could_only_spill() -> None:
    with pytest.raises(ConfigError, match="run.adaptive_affinity.room_waiting_share"):
        parse_scenario(scenario_text(room_waiting_share=0.3, saturated_waiting_share=0.2), "x")
    one_pool = scenario_text(kv_working_set=False).replace(
        '[[pools]]\nname = "B"\nhardware = "h20"\n', "")
    with pytest.raises(ConfigError, match="run.adaptive_affinity.enabled"):
        parse_scenario(one_pool, "x")
    # With the KV working-set hold one pool has something to adapt.
    held = parse_scenario(one_pool.replace("kv_working_set = false", "kv_working_set = true"),
                          "x")
    assert held.run.adaptive_affinity.kv_working_set and len(held.pools) == 1
    assert parse_scenario(scenario_text(), "x").run.adaptive_affinity.enabled


class QueueingWorker(FakeWorker):
    """Reports a deep engine queue with every reply: its pool is saturated."""

    def _stats(self) -> m.WorkerStats:
        return m.WorkerStats(worker=self.name, num_running=max(1, self.in_flight),
                             num_waiting=8, version=self.version)


@pytest.mark.looptime
async def test_a_saturated_pool_spills_and_the_step_metrics_say_so(caplog) -> None:
    caplog.set_level(logging.INFO, logger="rollart.controller.routing.spill")
    sc = parse_scenario(scenario_text(), "affinity.toml")
    a, b = QueueingWorker("a"), FakeWorker("b")
    backends = Backends(pools={"A": [a], "B": [b]}, trainer=FakeTrainer(), tokenizer=TOK,
                        env_hosts=[FakeEnvHost(turns=2)], reward_service=FakeReward())
    async with Cluster.from_scenario(sc, backends=backends) as c:
        steps = await run_steps(c, 3)
        assert c.controller is not None
        policy_ = c.controller.proxy.spill
    spilled = sum(st.metrics.num_spilled_by_domain.get("d", 0) for st in steps)
    moves = [mv for st in steps for mv in st.metrics.affinity_moves]
    assert spilled > 0 and b.requests and policy_ is not None
    assert moves and moves[0].startswith("d: A -> B (pool 'A' saturated")
    # One WARNING line per move (seen at `rollart run`'s default level), not per trajectory.
    lines = [r for r in caplog.records if "new trajectories go to pool" in r.getMessage()]
    assert any("domain d's new trajectories go to pool B" in r.getMessage() for r in lines)
    assert len(lines) == policy_.num_moves < spilled
    assert {r.levelno for r in lines} == {logging.WARNING}
    # Every trajectory kept one pool for all its turns (its prefix lived there).
    for st in steps:
        for s in st.samples:
            assert len({w[0] for w in s.turn_workers}) == 1, s.turn_workers


class DrainingWorker(FakeWorker):
    """Reports ``waiting`` requests held back with every reply (deep while ``waiting`` > 0)."""

    waiting = 8

    def _stats(self) -> m.WorkerStats:
        return m.WorkerStats(worker=self.name, num_running=max(1, self.in_flight),
                             num_waiting=self.waiting, version=self.version)


@pytest.mark.looptime
async def test_the_step_metrics_count_spills_per_pool_and_returns() -> None:
    sc = parse_scenario(scenario_text(), "affinity.toml")
    a, b = DrainingWorker("a"), FakeWorker("b")
    backends = Backends(pools={"A": [a], "B": [b]}, trainer=FakeTrainer(), tokenizer=TOK,
                        env_hosts=[FakeEnvHost(turns=2)], reward_service=FakeReward())
    steps = []
    async with Cluster.from_scenario(sc, backends=backends) as c:
        async for st in c.train(steps=4):
            steps.append(st)
            if st.step == 1:
                # Pool A's queue drained (as a stats poll would report it).
                a.waiting = 0
                a.last_stats = a._stats()
    rows = [st.metrics for st in steps]
    moves = [mv for r in rows for mv in r.affinity_moves]
    assert moves[0].startswith("d: A -> B (pool 'A' saturated")
    assert any(mv.startswith("d: B -> A (pool 'A' has room again") for mv in moves), moves
    spills = sum(r.affinity_spills_by_domain.get("d", {}).get("B", 0) for r in rows)
    returns = sum(r.affinity_returns_by_domain.get("d", 0) for r in rows)
    # A saturated during step 1 only: one spill and, once it drained, one return
    assert (spills, returns) == (1, 1), [(r.affinity_spills_by_domain,
                                          r.affinity_returns_by_domain) for r in rows]
    assert rows[0].affinity_spills_by_domain == {"d": {"B": 1}}
    assert all(set(r.affinity_spills_by_domain.get("d", {})) <= {"B"} for r in rows)
    # each step's counts agree with the moves it lists
    for r in rows:
        assert len(r.affinity_moves) == sum(sum(to.values()) for to in
                                            r.affinity_spills_by_domain.values()) + sum(
            r.affinity_returns_by_domain.values())


@pytest.mark.looptime
async def test_switched_off_the_saturated_pool_keeps_its_domain() -> None:
    sc = parse_scenario(scenario_text(enabled=False), "affinity.toml")
    a, b = QueueingWorker("a"), FakeWorker("b")
    backends = Backends(pools={"A": [a], "B": [b]}, trainer=FakeTrainer(), tokenizer=TOK,
                        env_hosts=[FakeEnvHost(turns=2)], reward_service=FakeReward())
    async with Cluster.from_scenario(sc, backends=backends) as c:
        steps = await run_steps(c, 2)
    assert not b.requests and a.requests
    assert all(not st.metrics.num_spilled_by_domain and not st.metrics.affinity_moves
               and not st.metrics.affinity_spills_by_domain
               and not st.metrics.affinity_returns_by_domain for st in steps)


def test_spills_and_moves_become_scalars() -> None:
    from rollart.launcher.sinks import step_scalars

    row = {"num_spilled_by_domain": {"d": 3}, "affinity_moves": ["d: A -> B (x)"] * 3,
           "affinity_spills_by_domain": {"d": {"B": 1, "C": 1}},
           "affinity_returns_by_domain": {"d": 1}}
    scalars = step_scalars(row)
    assert scalars["spilled/d"] == 3.0 and scalars["affinity_moves"] == 3.0
    assert scalars["affinity_spills/d"] == 2.0 and scalars["affinity_returns/d"] == 1.0


def test_a_paused_pool_is_neither_saturated_nor_roomy() -> None:
    # During a weight update every request waits for the pause, not for room: no move.
    clock = Clock()
    p = policy(clock)
    assert p.pool_for("d", "A", pressures(A=(1.0, None, True), B=(0.0, None)), ["A", "B"]) == "A"
    assert p.pool_for("d", "A", pressures(A=(0.9, None), B=(0.0, None, True)), ["A", "B"]) == "A"
    assert p.num_moves == 0
    a = FakeWorker("a")
    a.last_stats = m.WorkerStats(worker="a", num_running=0, num_waiting=5, version=0,
                                 paused=True)
    assert pool_pressure([a], lambda _: 0).paused
