"""The controller's per-group state and batch polling do not grow with the run: completed
groups are forgotten with the buffer's, and the buffer is only scanned for a batch when one
can have become ready (a sample kept, the version advanced)."""

from __future__ import annotations

import asyncio

import msgspec
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


def backends(env: FakeEnvHost, trainer: FakeTrainer | None = None) -> Backends:
    return Backends(pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]},
                    trainer=trainer or FakeTrainer(), tokenizer=TOK, env_hosts=[env],
                    reward_service=FakeReward())


async def run_steps(cluster: Cluster, n: int) -> list:
    out = []
    async with asyncio.timeout(1000):
        async for step in cluster.train(steps=n):
            out.append(step)
    return out


@pytest.mark.looptime
@pytest.mark.parametrize("selection,redundancy", [("first", 0), ("first", 1), ("unbiased", 1)])
async def test_after_many_steps_only_groups_in_flight_are_held(selection, redundancy) -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: [1.0, 2.0, 7.0][i % 3])
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2,
                             redundancy=redundancy, selection=selection,
                             selection_deadline_s=3.0)
    async with Cluster.from_scenario(scenario, backends=backends(env)) as c:
        steps = await run_steps(c, 8)
        ctrl = c.controller
        assert ctrl is not None
        started = ctrl.groups.started
        # 8 steps of 2 groups each: far more groups than can be in flight at once.
        assert started >= 16 > ctrl.buffer.max_groups
        assert len(ctrl.groups) == ctrl.buffer.groups_in_flight <= ctrl.buffer.max_groups
        assert ctrl.tasks.finishing_groups <= set(ctrl.groups)
        # A snapshot still finds every held group's domain and seed.
        snap = msgspec.json.decode(msgspec.json.encode(c.snapshot()))
        assert set(snap["groups"]) == {g["key"] for g in snap["buffer"]["groups"]}
    assert [s.metrics.policy_version for s in steps] == list(range(1, 9))


@pytest.mark.looptime
async def test_a_resumed_controller_forgets_restored_groups_too() -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0 if i % 2 else 3.0)
    trainer = FakeTrainer(train_s=5.0)
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer)) as c:
        await run_steps(c, 2)
        snap = msgspec.json.decode(msgspec.json.encode(c.snapshot()))
    restored = set(snap["groups"])
    assert restored
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer),
                                     resume=snap) as c2:
        await run_steps(c2, 6)
        ctrl = c2.controller
        assert ctrl is not None
        assert len(ctrl.groups) == ctrl.buffer.groups_in_flight
        assert not restored & set(ctrl.groups)  # trained (or dropped) long ago


@pytest.mark.looptime
async def test_take_batch_runs_only_when_a_batch_can_have_become_ready() -> None:
    # Every other session fails its first step and is retried: each failure ends a task and
    # wakes the training loop, at its own time, without making a batch any nearer.
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0 + 0.37 * (i % 7),
                      fail=lambda i, s: i % 2 == 0 and s == 0)
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env)) as c:
        await c.start()
        ctrl = c.controller
        assert ctrl is not None
        calls = []
        take = ctrl.buffer.take_batch

        def counting_take_batch():
            calls.append(ctrl.buffer.num_kept)
            return take()

        ctrl.buffer.take_batch = counting_take_batch  # type: ignore[method-assign]
        steps = await run_steps(c, 4)
        kept, failed = ctrl.buffer.num_kept, sum(ctrl.buffer.stats().failed.values())
    assert len(steps) == 4 and failed >= 8
    # At most one scan per kept sample and one per version (plus the first), however many
    # trajectories ended in between.
    assert len(calls) <= kept + 4 + 1


def test_buffer_reports_forgotten_groups_and_counts_in_o1() -> None:
    from test_buffer import run

    from rollart.controller.buffer.core import SampleBuffer

    forgotten: list[str] = []
    buf = SampleBuffer(alpha=0, batch_size=2, group_size=2, redundancy=1,
                       on_forget=forgotten.append)
    a = buf.try_start_group("a")
    b = buf.try_start_group("b")
    assert a is not None and b is None  # max_groups = 1
    assert buf.groups_in_flight == 1 and buf.num_kept == 0
    run(buf, a[0], [0])
    surplus = run(buf, a[1], [0])
    assert buf.num_kept == 2 and surplus == [a[2]]
    assert len(buf.take_batch() or []) == 2
    assert forgotten == [] and buf.groups_in_flight == 1  # a straggler is still live
    buf.cancel(a[2])
    assert forgotten == ["a"] and buf.groups_in_flight == 0
    buf.advance_version()
    # Restored buffers report too; a retired group is forgotten once its members are gone.
    c = buf.try_start_group("c")
    assert c is not None
    restored = SampleBuffer.restore(buf.snapshot(), on_forget=forgotten.append)
    ids = restored.drain_restarts()
    for tid in ids:
        restored.cancel(tid)
    assert forgotten == ["a", "c"] and restored.groups_in_flight == 0
