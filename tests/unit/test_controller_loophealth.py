"""Event-loop lag monitor and garbage-collection helpers (``rollart.controller.observe.loophealth``),
and the lag reported in a controller step's metrics. These run on the real event loop: the
monitor measures real lateness (only lower bounds are asserted, never upper timing bounds)."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from helpers.fakes import (
    TOK,
    FakeEnvHost,
    FakeReward,
    FakeTrainer,
    FakeWorker,
    make_scenario,
)
from rollart.controller import Backends, Cluster
from rollart.controller.observe.loophealth import (
    GcPauses,
    LagStats,
    LoopLagMonitor,
    freeze_startup_objects,
    tune_gc,
)


def busy(seconds: float) -> None:
    """Hold the thread (and so the event loop) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_lag_monitor_reports_a_blocked_loop() -> None:
    interval, block = 0.01, 0.3
    mon = LoopLagMonitor(interval_s=interval)
    mon.start()
    await asyncio.sleep(0)  # the probe is now asleep
    busy(block)
    # Not a race: the probe's timer is overdue, ours is due later, and the loop runs due
    # timers in deadline order, so the probe has recorded its wake-up when this returns.
    await asyncio.sleep(2 * interval)
    stats = mon.take()
    await mon.stop()
    # A loop held for `block` wakes the probe at least `block - interval` late.
    assert stats.count >= 1
    assert stats.max_ms >= (block - interval) * 1e3
    assert stats.max_ms >= stats.p99_ms >= stats.p50_ms >= 0.0
    assert mon.take().count == 0  # take() clears the window


def test_lag_stats_quantiles_and_bad_arguments() -> None:
    st = LagStats([float(x) for x in range(1, 101)])
    assert (st.count, st.p50_ms, st.p99_ms, st.max_ms) == (100, 50.0, 99.0, 100.0)
    empty = LagStats([])
    assert (empty.count, empty.p99_ms, empty.max_ms) == (0, 0.0, 0.0)
    with pytest.raises(ValueError, match="interval_s"):
        LoopLagMonitor(interval_s=0)
    with pytest.raises(ValueError, match="max_samples"):
        LoopLagMonitor(max_samples=0)


def test_gc_pauses_time_each_collection_and_gc_policy_applies() -> None:
    old = gc.get_threshold()
    try:
        tune_gc((12345, 7, 3))
        assert gc.get_threshold() == (12345, 7, 3)
        with GcPauses() as pauses:
            gc.collect()
            gc.collect(0)
        assert pauses.count[2] >= 1 and pauses.count[0] >= 1
        assert pauses.total_s >= pauses.max_s > 0.0
        # the collector's own CPU time is recorded per generation beside the wall-clock pause
        assert pauses.cpu_seconds[2] > 0.0 and len(pauses.cpu_seconds) == 3
        gc.collect()
        assert pauses.count[2] >= 1  # removed: later collections are not counted
        pauses.reset()
        assert pauses.cpu_seconds == [0.0, 0.0, 0.0] and pauses.count == [0, 0, 0]
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*old)


async def test_step_metrics_carry_the_loop_lag_p99_and_max() -> None:
    block = 0.2
    blocked: list[bool] = []

    def reward(response: str, md: dict) -> float:
        if not blocked:  # the first scoring holds the loop once
            blocked.append(True)
            busy(block)
        return float(md["env_return"])

    backends = Backends(
        pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]}, trainer=FakeTrainer(),
        tokenizer=TOK, env_hosts=[FakeEnvHost(turns=2)], reward_service=FakeReward(reward),
        loop_lag=LoopLagMonitor(interval_s=0.005))
    cluster = Cluster.from_scenario(make_scenario(mode="rollart", alpha=1, batch_size=4,
                                                  group_size=2), backends=backends)
    steps = []
    async with cluster as c:
        async with asyncio.timeout(120):
            async for step in c.train(steps=3):
                steps.append(step.metrics)
    assert blocked
    assert all(s.loop_lag_p99_ms is not None and s.loop_lag_max_ms is not None for s in steps)
    assert all(s.loop_lag_max_ms >= s.loop_lag_p99_ms >= 0.0 for s in steps)
    assert max(s.loop_lag_max_ms for s in steps) >= (block - 0.005) * 1e3


async def test_without_a_monitor_the_lag_is_not_reported() -> None:
    backends = Backends(
        pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]}, trainer=FakeTrainer(),
        tokenizer=TOK, env_hosts=[FakeEnvHost(turns=1)], reward_service=FakeReward())
    cluster = Cluster.from_scenario(make_scenario(batch_size=4, group_size=2), backends=backends)
    async with cluster as c:
        async with asyncio.timeout(120):
            async for step in c.train(steps=1):
                assert step.metrics.loop_lag_p99_ms is None
