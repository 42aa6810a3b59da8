"""KV working-set admission: a new trajectory's first turn waits while its pool's KV cache is
full of the live trajectories' expected footprints, from a run's first burst on; before a
domain's first finish the footprints are projected from its turns, so the worst-case prior holds
only until the first turns return; live turns never wait; the waits and evictions are counted in
the step metrics; a simulated pool under load keeps its prefixes with it, and one whose cache
fits the real footprints but not the worst case loses nothing."""

from __future__ import annotations

import array
import asyncio
import dataclasses
import logging
from types import SimpleNamespace as NS

import msgspec
import pytest

from helpers.fakes import FakeWorker
from rollart.controller.routing.proxy import LLMProxy
from rollart.controller.routing.spill import PoolPressure, SpillPolicy
from rollart.controller.routing.workingset import KVWorkingSet
from rollart.transport import messages as m


def clock() -> float:
    return asyncio.get_running_loop().time()


def test_rejects_a_bad_prior_share_or_turn_cap() -> None:
    with pytest.raises(ValueError, match="prior_tokens"):
        KVWorkingSet(lambda p: 100, prior_tokens=0)
    with pytest.raises(ValueError, match="share"):
        KVWorkingSet(lambda p: 100, prior_tokens=10, share=1.5)
    with pytest.raises(ValueError, match="max_turns of domain 'd' must be >= 1, got 0"):
        KVWorkingSet(lambda p: 100, prior_tokens=10, max_turns={"d": 0})


def test_a_one_turn_domain_is_expected_at_its_prompt_and_one_response_at_most() -> None:
    """Before its first turn returned, a trajectory of a one-turn domain holds at most its
    prompt and one response (``max_tokens_per_turn``), whatever the trajectory cap; a domain of
    more turns, one without the response cap, or a prompt not known yet stays at the cap."""
    ws = KVWorkingSet(lambda p: 10_000, prior_tokens=1000, max_turns={"r": 1, "d": 4},
                      max_tokens_per_turn=300)
    assert ws.expected_tokens("r", 50) == 350
    assert ws.expected_tokens("r", 800) == 1000  # never above the trajectory cap
    # An agent's first turn is admitted before its prompt exists: not known to be short.
    assert ws.expected_tokens("r", 0) == 1000
    assert ws.expected_tokens("d", 50) == 1000
    assert ws.expected_tokens("x", 50) == 1000  # no turn cap known
    ws._start("t1", "A", "r", 50)
    ws._start("t2", "A", "r", 70)
    assert ws.pool_tokens("A") == 350 + 370
    ws.held("t1", 200)  # its first (and last) turn returned: its footprint, then the domain's
    assert ws.pool_tokens("A") == 200 + 200
    without = KVWorkingSet(lambda p: 10_000, prior_tokens=1000, max_turns={"r": 1})
    assert without.expected_tokens("r", 50) == 1000
    with pytest.raises(ValueError, match="max_tokens_per_turn must be >= 1, got 0"):
        KVWorkingSet(lambda p: 100, prior_tokens=10, max_tokens_per_turn=0)


def test_before_a_domains_first_finish_its_footprints_are_projected_from_its_turns() -> None:
    ws = KVWorkingSet(lambda p: 10_000, prior_tokens=1000, max_turns={"d": 4})
    ws._start("t1", "A", "d", 50)
    ws._start("u1", "A", "e", 50)  # no turn cap: the prior until its domain's first finish
    assert ws.pool_tokens("A") == 2000  # before any turn returned: the worst case
    ws.held("t1", 100)  # 1 of at most 4 turns: its footprint counted as every turn's, 100 x 4
    assert ws.expected_tokens("d", 100, 1, 50) == 400 and ws.pool_tokens("A") == 1400
    # A new trajectory of the domain: its first-turn mean times the cap.
    assert ws.expected_tokens("d", 50) == 400 and ws.expected_tokens("e", 50) == 1000
    ws.held("t1", 300)  # the first prompt once, then 3 more turns like its second: 50 + 250 x 3
    assert ws.pool_tokens("A") == 1800
    assert ws.expected_tokens("d", 50) == 800  # now the second turns' projection
    ws.held("t1", 400)  # 50 + 350 x 3 / 2
    assert ws.pool_tokens("A") == 1575
    assert ws.expected_tokens("d", 5000, 2, 50) == 5000  # never below what it holds
    assert ws.expected_tokens("d", 600, 2, 50) == 1000  # nor above the prior otherwise
    ws.held("u1", 120)
    assert ws.expected_tokens("e", 120, 1) == 1000
    ws.held("t1", 900)
    ws.ended("t1")  # a finish: the domain's mean replaces its projections
    assert ws.expected_tokens("d", 50) == 900 and ws.expected_tokens("d", 300, 2, 50) == 900
    assert ws.pool_tokens("A") == 1000


def test_a_loose_turn_cap_keeps_the_projection_high_until_the_first_finish() -> None:
    """Documented: the projection assumes every allowed turn is taken."""
    ws = KVWorkingSet(lambda p: 10_000, prior_tokens=100_000, max_turns={"d": 64})
    ws._start("t1", "A", "d", 1000)
    ws.held("t1", 1200)
    ws.held("t1", 1700)
    assert ws.expected_tokens("d", 1700, 2, 1000) == 1000 + 700 * 63


@pytest.mark.looptime
async def test_a_waiter_starts_when_the_first_turns_shrink_the_worst_case() -> None:
    ws = KVWorkingSet(lambda p: 1000, prior_tokens=1000, max_turns={"d": 4})
    await ws.admit("t1", "A", "d", 50, clock)
    waiting = asyncio.create_task(ws.admit("t2", "A", "d", 50, clock))
    await asyncio.sleep(2.0)
    assert not waiting.done()  # 1000 + 1000 expected on a 1000-token cache
    ws.held("t1", 100)  # t1 now 400, a new one 400 too
    ws.poke("A")
    await asyncio.wait_for(waiting, 5.0)
    assert ws.num_waits == 1 and ws.pool_tokens("A") == 800


@pytest.mark.looptime
async def test_a_first_turn_waits_for_room_and_starts_when_a_trajectory_ends() -> None:
    ws = KVWorkingSet(lambda p: 100, prior_tokens=60)
    await ws.admit("t1", "A", "d", 10, clock)  # an empty pool takes anything
    waiting = asyncio.create_task(ws.admit("t2", "A", "d", 10, clock))
    await asyncio.sleep(5.0)
    assert not waiting.done() and ws.num_waiting("A") == 1 and ws.full("A")
    # Another pool is not held back by A's queue.
    await ws.admit("u1", "B", "d", 10, clock)
    ws.held("t1", 40)
    ws.ended("t1")
    await asyncio.wait_for(waiting, 5.0)
    assert ws.is_live("t2") and ws.num_waits == 1 and ws.wait_s == pytest.approx(5.0)
    # The finished trajectory's footprint (40) is now the domain's expectation, not the prior.
    assert ws.expected_tokens("d") == 40 and ws.expected_tokens("d", 70) == 70


@pytest.mark.looptime
async def test_waiters_start_in_order_and_a_cancelled_one_holds_no_one_back() -> None:
    ws = KVWorkingSet(lambda p: 100, prior_tokens=45)
    await ws.admit("live", "A", "d", 5, clock)
    await ws.admit("live2", "A", "d", 5, clock)  # 90 of 100 expected
    order: list[str] = []

    async def start(tid: str) -> None:
        await ws.admit(tid, "A", "d", 5, clock)
        order.append(tid)

    first = asyncio.create_task(start("w1"))
    second = asyncio.create_task(start("w2"))
    third = asyncio.create_task(start("w3"))
    await asyncio.sleep(1.0)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert order == [] and ws.num_waiting("A") == 2
    ws.ended("live")  # room for one: the next in line, not the cancelled one
    await asyncio.sleep(1.0)
    assert order == ["w2"] and not third.done()
    ws.ended("live2")
    await asyncio.wait_for(third, 5.0)
    assert order == ["w2", "w3"] and not ws.is_live("w1")
    await asyncio.wait_for(second, 5.0)


async def test_an_unknown_capacity_and_a_trajectory_that_never_turned() -> None:
    ws = KVWorkingSet(lambda p: None, prior_tokens=10**9)
    for i in range(5):  # not gated without a capacity
        await ws.admit(f"t{i}", "A", "d", 10, clock)
    assert ws.num_live("A") == 5 and not ws.full("A")
    ws.ended("t0")  # failed before its first turn: no measured footprint
    assert ws.expected_tokens("d") == 10**9
    ws.held("t1", 300)
    ws.ended("t1")
    ws.ended("t1")  # idempotent
    assert ws.expected_tokens("d") == 300


def test_a_full_working_set_saturates_the_pool_for_the_spill_policy() -> None:
    p = SpillPolicy(saturated_waiting_share=0.25, room_waiting_share=0.05, kv_usage_high=0.95,
                    min_hold_s=0.0, clock=lambda: 0.0)
    full, roomy = PoolPressure(0.0, 0.1, working_set_full=True), PoolPressure(0.0, 0.1)
    assert p.saturated(full) and not p.has_room(full)
    assert p.pool_for("d", "A", lambda n: full if n == "A" else roomy, ["A", "B"]) == "B"
    assert "working sets" in p.transitions[-1].why


class CachingWorker(FakeWorker):
    """Reports a KV capacity of ``capacity`` tokens and ``cached`` prompt tokens per reply."""

    def __init__(self, name: str, capacity: int) -> None:
        super().__init__(name)
        self.capacity, self.cached, self.kv_usage = capacity, 0, 0.1

    def _stats(self) -> m.WorkerStats:
        return m.WorkerStats(worker=self.name, num_running=self.in_flight, num_waiting=0,
                             version=self.version, kv_cache_usage=self.kv_usage,
                             kv_capacity_tokens=self.capacity)

    async def generate(self, request: m.Generate, *, timeout_s=None) -> m.GenerateResult:
        r = await super().generate(request, timeout_s=timeout_s)
        return m.GenerateResult(**{**{f: getattr(r, f) for f in r.__struct_fields__},
                                   "num_cached_tokens": self.cached})


def held_proxy(capacity: int, prior: int) -> tuple[LLMProxy, CachingWorker]:
    w = CachingWorker("a", capacity)
    return LLMProxy({"A": ("h800", [w])}, {"d": "A"}, kv_working_set=(1.0, prior, {}, None)), w


SP = m.SamplingParams(max_tokens=4)


def test_a_worker_that_has_not_reported_counts_at_its_pools_mean_capacity() -> None:
    """Three workers, one whose stats carry no capacity yet: the pool is gated at 3 x the
    reported mean (250), not left ungated until that one reports; none reported, or every
    one 0: not gated."""
    a, b, c = CachingWorker("a", 200), CachingWorker("b", 300), CachingWorker("c", 999)
    proxy = LLMProxy({"A": ("h800", [a, b, c])}, {"d": "A"}, kv_working_set=(1.0, 50, {}, None))
    assert proxy._kv_capacity("A") is None
    a.last_stats, b.last_stats = a._stats(), b._stats()
    assert proxy._kv_capacity("A") == 750
    c.last_stats = c._stats()
    assert proxy._kv_capacity("A") == 1_499
    for w in (a, b, c):  # every worker reports an empty cache: nothing to gate on
        w.capacity = 0
        w.last_stats = w._stats()
    assert proxy._kv_capacity("A") is None


def prompt(n: int) -> array.array:
    return array.array("i", [5] * n)


@pytest.mark.looptime
async def test_the_proxy_holds_a_new_trajectory_from_the_first_and_counts_evictions(
        caplog) -> None:
    caplog.set_level(logging.WARNING, logger="rollart.controller.routing.workingset")
    proxy, w = held_proxy(capacity=1000, prior=800)
    ws = proxy.working_set
    assert ws is not None
    await proxy.generate("t1", "d", "r1", prompt(100), SP)
    # No evidence needed: the prior says one more trajectory would not fit.
    assert proxy.pool_pressure("A", "d").working_set_full
    new = asyncio.create_task(proxy.generate("t2", "d", "r2", prompt(100), SP))
    await asyncio.sleep(3.0)
    assert not new.done() and ws.num_waiting("A") == 1
    # A live trajectory's next turn never waits; one that finds most of the 103 tokens its
    # worker held recomputed is counted.
    w.cached = 10
    await proxy.generate("t1", "d", "r3", prompt(120), SP)
    assert proxy.num_prefix_evicted_turns == 1
    w.cached = 100
    await proxy.generate("t1", "d", "r4", prompt(130), SP)
    assert proxy.num_prefix_evicted_turns == 1
    proxy.release("t1")
    await asyncio.wait_for(new, 5.0)
    assert ws.num_waits == 1 and ws.wait_s == pytest.approx(3.0)
    # One WARNING line at the pool's first wait.
    lines = [r.getMessage() for r in caplog.records if "working-set hold" in r.getMessage()]
    assert lines == ["affinity: pool A: its live trajectories' expected KV footprints (800 "
                     "tokens) leave no room in its KV cache (1000 tokens) for a new one's (800); "
                     "new trajectories wait for room (working-set hold)"]


async def second_held_by_a_full_cache() -> tuple[LLMProxy, CachingWorker, asyncio.Task]:
    """A worker whose KV cache keeps one trajectory at the prior; ``t1`` live on it, ``t2``'s
    first turn held."""
    proxy, w = held_proxy(capacity=1000, prior=800)
    await proxy.generate("t1", "d", "r1", prompt(100), SP)
    new = asyncio.create_task(proxy.generate("t2", "d", "r2", prompt(100), SP))
    await asyncio.sleep(1.0)
    assert not new.done()
    return proxy, w, new


async def test_without_the_hold_nothing_waits_and_evictions_are_not_tracked() -> None:
    w = CachingWorker("a", 10)
    proxy = LLMProxy({"A": ("h800", [w])}, {"d": "A"})
    assert proxy.working_set is None
    for i in range(3):
        await proxy.generate(f"t{i}", "d", f"r{i}", prompt(100), SP)


def test_the_engine_logger_reads_the_kv_capacity_once_vllm_sized_it() -> None:
    from rollart.inference.engine import SchedulerCounts, _stats_logger_factory

    counts = SchedulerCounts()
    cls = _stats_logger_factory(counts)
    cls(NS(cache_config=NS(num_gpu_blocks=None, block_size=16))).log_engine_initialized()
    assert counts.kv_capacity_tokens is None
    cls(NS(cache_config=NS(num_gpu_blocks=512, block_size=16))).log_engine_initialized()
    assert counts.kv_capacity_tokens == 8192 and counts.prefix_caching
    assert counts.kv_block_tokens == 16
    # The engine turned its prefix cache off (whatever was asked): no cached-token reports.
    cls(NS(cache_config=NS(num_gpu_blocks=512, block_size=16,
                           enable_prefix_caching=False))).log_engine_initialized()
    assert not counts.prefix_caching


def test_a_simulated_pool_past_its_kv_keeps_its_prefixes_with_the_hold() -> None:
    """One simulated H800 engine offered more agentic trajectories than its KV cache keeps
    between turns: without the hold most prompt tokens are recomputed; with it new trajectories
    wait (counted), evictions are seen, and the prefix cache serves over twice the share."""
    from benchmarks.workloads import agentic, reasoning

    from rollart.config import AdaptiveAffinityConfig
    from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated

    base = SimScenario(
        pools=(SimPool("h800", "h800", 1, max_batch=128),),
        domains=(SimDomain(agentic(latency_mean_s=1.0, latency_std_s=1.0), "h800"),
                 SimDomain(reasoning(), "h800")),
        steps=3, batch_size=64, group_size=8, trainer_gpus=1, max_tokens_per_turn=16384,
        max_tokens_per_trajectory=32768)

    def hit_share(res) -> float:
        hits = sum(w["prefix_hit_tokens"] for w in res.workers.values())
        return hits / (hits + sum(w["prefill_tokens"] for w in res.workers.values()))

    static = run_simulated(base, 0)
    held = run_simulated(base.replace(adaptive_affinity=AdaptiveAffinityConfig(enabled=True)), 0)
    assert sum(s.get("num_kv_admission_waits", 0) for s in static.steps) == 0
    assert sum(s["num_kv_admission_waits"] for s in held.steps) > 0
    assert sum(s["num_prefix_evicted_turns"] for s in held.steps) > 0
    assert sum(s["kv_admission_wait_s"] for s in held.steps) > 0
    assert hit_share(static) < 0.2 and hit_share(held) > 2 * hit_share(static)


def test_a_pool_that_fits_the_real_footprints_but_not_the_worst_case_loses_nothing() -> None:
    """Trajectories of about 3,000 tokens under a 32,768-token bound on one simulated engine
    (``max_turns`` 8, about the turns they take): the worst case holds the first burst only
    until the first turns return (waits in the first step only, under a second each), and the
    run is as fast as without the hold."""
    from benchmarks.workloads import agentic

    from rollart.config import AdaptiveAffinityConfig
    from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated

    base = SimScenario(
        pools=(SimPool("h800", "h800", 1, max_batch=128),),
        domains=(SimDomain(agentic(prompt=1000, obs=300, latency_mean_s=3.0,
                                   latency_std_s=3.0), "h800"),),
        steps=3, batch_size=16, group_size=8, trainer_gpus=1, max_tokens_per_turn=16384,
        max_tokens_per_trajectory=32768)
    static = run_simulated(base, 0)
    held = run_simulated(base.replace(adaptive_affinity=AdaptiveAffinityConfig(enabled=True)), 0)
    waits = [s["num_kv_admission_waits"] for s in held.steps]
    assert waits[0] > 0 and not any(waits[1:])
    assert held.steps[0]["kv_admission_wait_s"] < waits[0] * 1.0
    total = [sum(s["step_time_s"] for s in r.steps) for r in (static, held)]
    assert total[1] == pytest.approx(total[0], rel=0.02)  # simulated seconds: deterministic


def test_the_spill_policy_judges_a_one_turn_domains_home_by_the_prompt_it_admits() -> None:
    """The spill check asks whether the new trajectory itself would fit at home: a one-turn
    domain's first turns (10-token prompts, 20-token responses, a 1,000-token trajectory cap)
    fill a 250-token pool 30 tokens at a time and stay home, with no spill and no return."""
    a, b = CachingWorker("a", 250), CachingWorker("b", 250)
    a.last_stats, b.last_stats = a._stats(), b._stats()
    spill = SpillPolicy(saturated_waiting_share=0.5, room_waiting_share=0.1,
                        kv_usage_high=0.95, min_hold_s=10.0, clock=lambda: 0.0)
    proxy = LLMProxy({"A": ("h800", [a]), "B": ("h800", [b])}, {"r": "A"}, spill=spill,
                     kv_working_set=(1.0, 1000, {"r": 1}, 20))
    for i in range(8):
        assert proxy.try_admit(f"t{i}", "r", 10)
        assert proxy.pool_of_trajectory(f"t{i}", "r").name == "A"
    assert proxy.working_set is not None and proxy.working_set.pool_tokens("A") == 240
    assert not spill.transitions
    # A ninth does not fit at home: it goes where there is room.
    assert proxy.try_admit("t8", "r", 10)
    assert proxy.pool_of_trajectory("t8", "r").name == "B"


def test_a_burst_of_one_turn_trajectories_that_fits_at_one_response_each_does_not_wait() -> None:
    """One simulated H800 engine, one reasoning domain: its first burst fits the KV cache at
    prompt plus one response (16,384 tokens) each, not at the 32,768-token trajectory cap. As
    a single-turn domain (``max_turns`` 1) nothing waits and the run is the static one; the
    same workload with its turn cap left to the run's (8) holds part of the burst."""
    from benchmarks.workloads import reasoning

    from rollart.config import AdaptiveAffinityConfig
    from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated, scenario_of
    from rollart.sim.workload import Dist, const

    one_turn = reasoning()
    assert one_turn.num_turns.kind == "const"  # declared single-turn: max_turns 1
    # Always one turn, but drawn: not known to be one-turn.
    undeclared = dataclasses.replace(one_turn, num_turns=Dist("uniform", 1, 0.5, 1, 1))

    def sim(spec):
        return SimScenario(pools=(SimPool("h800", "h800", 1, max_batch=128),),
                           domains=(SimDomain(spec, "h800"),), steps=3, batch_size=8,
                           group_size=8, trainer_gpus=1, max_tokens_per_turn=16384,
                           max_tokens_per_trajectory=32768)

    assert scenario_of(sim(one_turn), 0).domains[0].max_turns == 1
    assert scenario_of(sim(undeclared), 0).domains[0].max_turns is None
    for turns in (const(2), Dist("const", 1, 0, 2), Dist("uniform", 2, 0)):  # never one turn
        spec = dataclasses.replace(one_turn, num_turns=turns)
        assert scenario_of(sim(spec), 0).domains[0].max_turns is None, turns
    assert scenario_of(sim(dataclasses.replace(one_turn, num_turns=Dist("normal", 1, 0))),
                       0).domains[0].max_turns == 1
    on = AdaptiveAffinityConfig(enabled=True)
    static = run_simulated(sim(one_turn), 0)
    held = run_simulated(sim(one_turn).replace(adaptive_affinity=on), 0)
    loose = run_simulated(sim(undeclared).replace(adaptive_affinity=on), 0)
    assert sum(s["num_kv_admission_waits"] for s in held.steps) == 0
    assert [s["step_time_s"] for s in held.steps] == [s["step_time_s"] for s in static.steps]
    assert loose.steps[0]["num_kv_admission_waits"] > 0


@pytest.mark.looptime
async def test_a_first_turn_on_one_pool_wakes_the_waiters_of_another() -> None:
    """The domain's first turn returns on B: the refreshed projection shrinks A's sum too, and
    A's waiter starts without waiting for an event of its own pool."""
    ws = KVWorkingSet(lambda p: 1000, prior_tokens=1000, max_turns={"d": 4})
    await ws.admit("a1", "A", "d", 50, clock)
    waiting = asyncio.create_task(ws.admit("a2", "A", "d", 50, clock))
    await ws.admit("b1", "B", "d", 50, clock)
    await asyncio.sleep(1.0)
    assert not waiting.done() and ws.pool_tokens("A") == 1000
    ws.held("b1", 100)  # on B; its pool poked by the proxy, A by the refresh
    await asyncio.wait_for(waiting, 5.0)
    assert ws.pool_tokens("A") == 800


def test_a_trajectory_that_fills_the_cache_exactly_fits() -> None:
    ws = KVWorkingSet(lambda p: 1000, prior_tokens=500)
    ws._start("live", "A", "d", 10)
    assert ws.fits("A", "d", 10) and not ws.full("A")
    ws._start("second", "A", "d", 10)
    assert ws.full("A") and not ws.fits("A", "d", 0)


@pytest.mark.looptime
async def test_the_hold_is_logged_once_per_pool(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="rollart.controller.routing.workingset")
    ws = KVWorkingSet(lambda p: 100, prior_tokens=80)
    await ws.admit("live", "A", "d", 5, clock)
    first = asyncio.create_task(ws.admit("w1", "A", "d", 5, clock))
    second = asyncio.create_task(ws.admit("w2", "A", "d", 5, clock))
    await asyncio.sleep(1.0)
    assert not first.done() and not second.done()
    lines = [r.getMessage() for r in caplog.records if "working-set hold" in r.getMessage()]
    assert len(lines) == 1, lines
    for task in (first, second):
        task.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


def test_a_trajectory_is_charged_in_whole_kv_blocks_of_its_pool() -> None:
    """An engine holds a sequence's KV in whole blocks (vLLM's CPU backend: 128 tokens): five
    one-turn trajectories expected at 100 tokens each take 5 x 128 = 640 of a 512-token
    cache, so the fifth waits; token by token (block size not known) all five fit. A block
    size reported once trajectories are live charges them again."""
    block: dict[str, int | None] = {"A": 128, "B": None}
    ws = KVWorkingSet(lambda p: 512, prior_tokens=1000, max_turns={"r": 1},
                      max_tokens_per_turn=50, block_tokens=block.get)
    for pool in ("A", "B"):
        for i in range(4):
            assert ws.try_start(f"{pool}{i}", pool, "r", 50)
    assert ws.pool_tokens("A") == 512 and ws.pool_tokens("B") == 400
    assert not ws.fits("A", "r", 50) and ws.fits("B", "r", 50)
    block["B"] = 128  # B's workers reported their block size only now
    assert ws.pool_tokens("B") == 512 and not ws.fits("B", "r", 50)
    block["B"] = None
    assert ws.pool_tokens("B") == 400
    # A first turn ended at 129 tokens: every trajectory of the domain is expected at that
    # now, two blocks each.
    ws.held("A0", 129)
    assert ws.pool_tokens("A") == 4 * 256 and ws.pool_tokens("B") == 4 * 129
    ws.ended("A0")
    assert ws.pool_tokens("A") == 3 * 256


def test_a_first_turn_admitted_right_after_a_block_size_change_is_charged_at_it() -> None:
    """``try_start`` -> ``fits`` with nothing read in between: the live trajectory and the
    new one are both charged at the block size reported now (128 + 128 > 228)."""
    block: dict[str, int | None] = {"A": None}
    ws = KVWorkingSet(lambda p: 228, prior_tokens=1000, max_turns={"r": 1},
                      max_tokens_per_turn=50, block_tokens=block.get)
    assert ws.try_start("a", "A", "r", 50)
    block["A"] = 128
    assert not ws.try_start("b", "A", "r", 50)


async def test_the_proxy_charges_a_pool_in_its_workers_kv_blocks() -> None:
    """The largest block size the pool's workers report is the pool's; none reported: token
    by token."""
    v, w = BlockWorker("a", 500, block=None), BlockWorker("b", 500, block=None)
    proxy = LLMProxy({"A": ("h800", [v, w])}, {"d": "A"}, kv_working_set=(1.0, 300, {}, None))
    assert proxy._kv_block_tokens("A") is None
    await proxy.generate("t1", "d", "r1", prompt(100), SP)  # holds 103 tokens after its turn
    ws = proxy.working_set
    assert ws is not None and ws.pool_tokens("A") == 300
    w.block, v.block = 256, 16
    for worker in (w, v):
        worker.last_stats = worker._stats()
    assert proxy._kv_block_tokens("A") == 256 and ws.pool_tokens("A") == 512
    assert not ws.fits("A", "d", 10)  # 512 + 512 > 1000; token by token 300 + 300 fit


class BlockWorker(CachingWorker):
    """Reports its KV block size too."""

    def __init__(self, name: str, capacity: int, block: int | None) -> None:
        super().__init__(name, capacity)
        self.block = block

    def _stats(self) -> m.WorkerStats:
        return msgspec.structs.replace(super()._stats(), kv_block_tokens=self.block)


def test_fits_counts_the_new_trajectorys_own_prompt() -> None:
    ws = KVWorkingSet(lambda p: 1000, prior_tokens=100)
    ws._start("live", "A", "d", 100)
    assert ws.fits("A", "d", 10) and not ws.fits("A", "d", 5000)


@pytest.mark.looptime
async def test_a_wait_counts_with_its_seconds_when_it_ends() -> None:
    ws = KVWorkingSet(lambda p: 100, prior_tokens=80)
    await ws.admit("live", "A", "d", 5, clock)
    waiting = asyncio.create_task(ws.admit("w", "A", "d", 5, clock))
    await asyncio.sleep(4.0)
    assert (ws.num_waits, ws.wait_s) == (0, 0.0)  # still waiting: counted when it ends
    ws.ended("live")
    await asyncio.wait_for(waiting, 5.0)
    assert (ws.num_waits, ws.wait_s) == (1, pytest.approx(4.0))


@pytest.mark.looptime
async def test_a_waiter_starts_when_its_pools_capacity_becomes_unknown() -> None:
    proxy, w, new = await second_held_by_a_full_cache()
    w.capacity = None  # its next reply's stats no longer say: the pool is not gated
    await proxy.generate("t1", "d", "r3", prompt(110), SP)
    await asyncio.wait_for(new, 5.0)


def test_an_engine_without_a_prefix_cache_reports_no_cached_tokens() -> None:
    """Else every later turn would read as an eviction."""
    from benchmarks.workloads import agentic

    from rollart.config import AdaptiveAffinityConfig
    from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated

    sim = SimScenario(
        pools=(SimPool("h800", "h800", 1, max_batch=128),), prefix_cache=False,
        domains=(SimDomain(agentic(latency_mean_s=1.0, latency_std_s=1.0), "h800"),),
        steps=2, batch_size=16, group_size=8, trainer_gpus=1,
        adaptive_affinity=AdaptiveAffinityConfig(enabled=True))
    res = run_simulated(sim, 0)
    assert sum(s["num_prefix_evicted_turns"] for s in res.steps) == 0


def test_sync_mode_leaves_the_hold_off_and_refuses_it_when_set() -> None:
    from helpers.fakes import make_scenario
    from rollart.transport.errors import ConfigError

    sync = make_scenario(mode="sync", alpha=0, adaptive_affinity={"enabled": True})
    assert not sync.run.effective_kv_working_set
    assert make_scenario(adaptive_affinity={"enabled": True}).run.effective_kv_working_set
    with pytest.raises(ConfigError, match="run.adaptive_affinity.kv_working_set: mode 'sync'"):
        make_scenario(mode="sync", alpha=0,
                      adaptive_affinity={"enabled": True, "kv_working_set": True})


def test_the_hold_asked_for_without_online_affinity_is_refused() -> None:
    from helpers.fakes import make_scenario
    from rollart.transport.errors import ConfigError

    with pytest.raises(ConfigError, match="run.adaptive_affinity.kv_working_set: true has no "
                       "effect while run.adaptive_affinity.enabled is false"):
        make_scenario(adaptive_affinity={"kv_working_set": True})
    off = make_scenario(adaptive_affinity={"kv_working_set": False})
    assert not off.run.adaptive_affinity.enabled


def test_a_sync_run_with_online_affinity_does_not_deadlock_on_the_turn_barrier() -> None:
    """Every member of a sync batch waits for all at each turn: a held first turn would wait
    for trajectories that wait for it (each step then ran to ``trajectory_timeout_s``)."""
    from benchmarks.workloads import agentic

    from rollart.config import AdaptiveAffinityConfig
    from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated

    sim = SimScenario(
        pools=(SimPool("a", "h800", 1, max_batch=128), SimPool("b", "h800", 1, max_batch=128)),
        domains=(SimDomain(agentic(latency_mean_s=1.0, latency_std_s=1.0), "a"),),
        mode="sync", alpha=0, steps=3, batch_size=64, group_size=8, trainer_gpus=1,
        max_tokens_per_turn=16384, max_tokens_per_trajectory=32768,
        adaptive_affinity=AdaptiveAffinityConfig(enabled=True))
    res = run_simulated(sim, 0)
    assert all(not s["num_failed_by_reason"] for s in res.steps), res.steps
    assert sum(s["num_kv_admission_waits"] for s in res.steps) == 0


class FullWorker(FakeWorker):
    """Its KV cache holds 300 tokens, less than one trajectory at the prior."""

    def _stats(self) -> m.WorkerStats:
        return m.WorkerStats(worker=self.name, num_running=self.in_flight, num_waiting=0,
                             version=self.version, paused=not self._running.is_set(),
                             kv_cache_usage=0.99, kv_capacity_tokens=300)


async def test_an_agents_first_turn_waits_before_its_http_client_starts_its_clock() -> None:
    """The agent's client times out after ``generate_timeout_s``: a first completion held for
    KV room longer than that failed the trajectory (``agent_error``). The wait (about 8 s: the
    first step's trajectories' run) does not count towards ``run.trajectory_timeout_s`` (12 s)
    either: the agent's own 8 s fit, wait and run together (about 16 s) would not."""
    import msgspec
    from test_controller_modes import backends, run_steps

    from helpers.fakes import FakeEnvHost, FakeReward, make_scenario
    from rollart.controller import Cluster

    async def slow_agent(client, task) -> None:
        msgs = [{"role": "user", "content": task["prompt"]}]
        r = await client.chat.completions.create(model="m", messages=msgs)
        await asyncio.sleep(8.0)  # the agent's own work between two completions
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "again"}]
        await client.chat.completions.create(model="m", messages=msgs)

    sc = make_scenario(batch_size=2, group_size=2, generate_timeout_s=3.0,
                       trajectory_timeout_s=12.0, adaptive_affinity={"enabled": True})
    sc = msgspec.structs.replace(sc, domains=[d for d in sc.domains if d.name == "math"])
    workers = (FullWorker("w1"), FullWorker("w2"))
    for w in workers:  # as a real worker's client keeps them from the run's first stats call
        w.last_stats = w._stats()
    b = backends(FakeEnvHost(turns=2), workers=workers, reward=FakeReward(fn=lambda r, md: 1.0))
    cluster = Cluster.from_scenario(sc, backends=b)
    cluster.agent("math")(slow_agent)
    async with cluster:
        steps = await run_steps(cluster, 2, timeout_s=300)
    assert not any(st.metrics.num_failed_by_reason for st in steps)
    assert steps[0].metrics.num_kv_admission_waits >= 1
    assert steps[0].metrics.kv_admission_wait_s > 5.0
    # The second step trains the trajectories that waited: their wait and run together took
    # longer than run.trajectory_timeout_s.
    assert max(x.metadata["t_end"] - x.metadata["t_start"] for x in steps[1].samples) > 12.0


@pytest.mark.looptime
async def test_a_new_trajectory_that_would_wait_at_home_spills_to_a_pool_with_room() -> None:
    """Home's working sets below its capacity but with no room for one more of the domain's
    (200 of 250, 100 expected): it spills instead of waiting while the other pool is empty."""
    a, b = CachingWorker("a", 250), CachingWorker("b", 250)
    spill = SpillPolicy(saturated_waiting_share=0.5, room_waiting_share=0.1, kv_usage_high=0.95,
                        min_hold_s=0.0, clock=clock)
    proxy = LLMProxy({"A": ("h800", [a]), "B": ("h800", [b])}, {"d": "A"}, spill=spill,
                     kv_working_set=(1.0, 100, {}, None))
    await proxy.generate("t0", "d", "r0", prompt(10), SP)
    await proxy.generate("t0", "d", "r1", prompt(20), SP)
    await proxy.generate("t1", "d", "r2", prompt(10), SP)
    ws = proxy.working_set
    assert ws is not None and ws.pool_tokens("A") == 200 and not ws.full("A")
    await asyncio.wait_for(proxy.generate("t2", "d", "r3", prompt(10), SP), 5.0)
    assert proxy.served_by("t2") == "b" and ws.num_waits == 0


class _SlowAdmitProxy:
    """Fake proxy (unit test only): the hold keeps every first turn ``wait_s`` seconds."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s

    def try_admit(self, traj_id: str, domain: str, num_prompt_tokens: int = 0) -> bool:
        return False

    async def admit(self, traj_id: str, domain: str, num_prompt_tokens: int = 0) -> None:
        await asyncio.sleep(self.wait_s)  # virtual seconds (looptime): the hold's wait


def _timed_ctx(wait_s: float, timeout_s: float) -> NS:
    return NS(proxy=_SlowAdmitProxy(wait_s), clock=clock, activity={},
              run=NS(trajectory_timeout_s=timeout_s))


@pytest.mark.looptime
@pytest.mark.parametrize("own_s, fails", [(9.0, False), (11.0, True)])
async def test_the_wait_for_kv_room_does_not_count_towards_the_trajectory_timeout(
        own_s: float, fails: bool) -> None:
    """A first turn held 30 s under a 10 s ``run.trajectory_timeout_s``: a trajectory that
    then runs 9 s of its own finishes; one that runs 11 s still times out."""
    from rollart.controller.rollout.trajectory import (
        TrajectoryFailed,
        admit_first_turn,
        run_trajectory,
    )

    ctx = _timed_ctx(wait_s=30.0, timeout_s=10.0)

    async def body(ctx, traj_id, group_key, domain, seed, act):
        await admit_first_turn(ctx, act, traj_id, "agentic", 100)
        act.enter("generating turn 0", ctx.clock())
        await asyncio.sleep(own_s)  # virtual seconds: the trajectory's own run
        return "sample"

    run = run_trajectory(ctx, "g0/0", "g0", NS(name="agentic"), 0, body=body)
    if fails:
        with pytest.raises(TrajectoryFailed, match="generating turn 0") as info:
            await run
        assert info.value.reason == "trajectory_timeout"
    else:
        assert await run == "sample"
    assert not ctx.activity


def test_a_trajectory_cut_short_leaves_its_domains_mean_alone() -> None:
    """Finished at 1,000 tokens, one cut short at 200 (a cancelled redundant member, a failed
    turn): the domain's mean stays 1,000, not 600."""
    ws = KVWorkingSet(lambda p: 10_000, prior_tokens=4_000, max_turns={"d": 4})
    for tid in ("done", "cut"):
        ws._start(tid, "A", "d", 100)
    ws.held("done", 1_000)
    ws.held("cut", 200)
    ws.ended("cut", finished=False)
    ws.ended("done")
    ws._refresh()
    assert ws.expected_tokens("d") == pytest.approx(1_000.0)
    assert ws.pool_tokens("A") == 0.0 and ws.num_live("A") == 0


def test_the_domain_mean_follows_footprints_that_grow_over_the_run() -> None:
    """The mean is over the last ``mean_window`` finishes: after 6 finishes at 1,000 tokens
    then 4 at 3,000 with a window of 4, a domain is expected at 3,000 (the whole run's mean,
    1,800, would admit too many of its new trajectories); with 2 of the 4 in, 2,000."""
    ws = KVWorkingSet(lambda p: 1_000_000, prior_tokens=8_000, max_turns={"d": 4},
                      mean_window=4)
    n = 0

    def finish(tokens: int) -> None:
        nonlocal n
        n += 1
        ws._start(f"t{n}", "A", "d", 100)
        ws.held(f"t{n}", tokens)
        ws.ended(f"t{n}")

    for _ in range(6):
        finish(1_000)
    for _ in range(2):
        finish(3_000)
    ws._refresh()
    assert ws.expected_tokens("d") == pytest.approx(2_000.0)
    for _ in range(2):
        finish(3_000)
    ws._refresh()
    assert ws.expected_tokens("d") == pytest.approx(3_000.0)
    with pytest.raises(ValueError, match="mean_window"):
        KVWorkingSet(lambda p: 1, prior_tokens=1, mean_window=0)


async def test_a_first_turn_that_need_not_wait_leaves_the_deadline_alone() -> None:
    """No wait (the hold off, or room now): the deadline is not rescheduled (no timer handle
    per trajectory) and the proxy's waiting ``admit`` is not called."""
    from rollart.controller.rollout.trajectory import Activity, admit_first_turn

    class NoWaitProxy:  # fake (unit test only)
        def try_admit(self, traj_id: str, domain: str, num_prompt_tokens: int = 0) -> bool:
            return True

        async def admit(self, *args) -> None:
            raise AssertionError("admit would wait")

    act = Activity("g0", "env open", 0.0)
    async with asyncio.timeout(100.0) as deadline:
        when = deadline.when()
        act.deadline = deadline
        await admit_first_turn(NS(proxy=NoWaitProxy(), clock=clock), act, "t", "d", 10)
        assert deadline.when() == when and act.phase == "env open"


async def test_the_proxy_passes_a_cut_short_trajectory_on_to_the_working_set() -> None:
    """``LLMProxy.release(..., finished=False)``: the partial footprint stays out of the
    domain's mean; ``finished=True``: it is the mean."""
    proxy, _ = held_proxy(capacity=100_000, prior=50_000)
    ws = proxy.working_set
    assert ws is not None
    for tid, n in (("cut", 30), ("done", 300)):
        await proxy.generate(tid, "d", f"{tid}/t0", prompt(n), m.SamplingParams(max_tokens=4))
    held = ws._live["done"].tokens  # its prompt and the tokens the worker generated
    assert held > 300 > ws._live["cut"].tokens
    proxy.release("cut", finished=False)
    proxy.release("done")
    ws._refresh()
    assert ws.expected_tokens("d") == pytest.approx(held)
