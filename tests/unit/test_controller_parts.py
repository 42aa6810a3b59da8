"""The controller's parts through their public surface: the step count and trajectory
context the driver reads, the admitted groups' table and its checkpoint part, the stall
watchdog's report, the trajectory tasks' supervision of background tasks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import msgspec
import pytest
from test_controller_modes import backends, run_steps
from test_worker_output import make_controller

from helpers.fakes import FakeEnvHost, FakeTrainer, FakeWorker, make_scenario
from rollart.controller import Cluster
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.observe.stall import StallWatchdog
from rollart.controller.rollout.admitted import AdmittedGroups
from rollart.controller.rollout.trajectory import Activity
from rollart.transport.errors import RollartError


@pytest.mark.looptime
async def test_step_index_counts_steps_across_a_resume_and_the_context_is_the_trajectories(
) -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0)
    trainer = FakeTrainer()
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2))) as c:
        assert c.controller is not None and c.controller.step_index == 0
        await run_steps(c, 2)
        ctl = c.controller
        assert ctl.step_index == 2
        ctx = ctl.trajectory_context
        # the context every trajectory ran with: it counted their tokens
        assert ctx is not None and ctx.barrier is None and ctx.buffer is ctl.buffer
        assert ctx.generated_tokens >= sum(s.num_generated for s in ctl.last_batch) > 0
        snap = msgspec.json.decode(msgspec.json.encode(c.snapshot()))
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2)),
                                     resume=snap) as c2:
        assert c2.controller is not None and c2.controller.step_index == 2
        steps = await run_steps(c2, 1)
        assert c2.controller.step_index == steps[0].step == 3


async def test_trajectory_context_is_none_until_start_and_sync_mode_has_its_barrier() -> None:
    ctl, _, _ = make_controller([FakeWorker("m")], mode="sync", alpha=0)
    try:
        assert ctl.trajectory_context is None and ctl.barrier is None
        await ctl.start()
        ctx = ctl.trajectory_context
        assert ctx is not None and ctx.barrier is not None and ctl.barrier is ctx.barrier
        assert ctx.chat is ctl.chats and set(ctl.chats) == set(ctl.domains)
    finally:
        await ctl.close()


def test_admitted_groups_name_count_forget_and_round_trip_their_checkpoint_part() -> None:
    domains = {d.name: d for d in make_scenario().domains}
    math, game = domains["math"], domains["game"]
    groups = AdmittedGroups(domains)
    assert groups.next_key == "g0" and groups.started == 0
    groups.add("g0", math, 7)
    groups.add("g1", game, 9)
    assert groups.next_key == "g2" and groups.started == 2
    assert groups["g1"].domain is game and groups["g1"].seed == 9
    groups.forget("g0")
    groups.forget("nope")  # unknown keys are ignored
    assert list(groups) == ["g1"] and len(groups) == 1 and groups.started == 2
    part = groups.snapshot({"g1"})
    assert part == {"groups": {"g1": ["game", 9]}, "group_seq": 2}
    again = AdmittedGroups(domains)
    again.restore(part["groups"], part["group_seq"])
    assert dict(again) == dict(groups) and again.next_key == "g2"
    with pytest.raises(RollartError, match="group 'g5' of unknown domain 'chess'"):
        AdmittedGroups(domains).restore({"g5": ["chess", 1]}, 6)


class _Running:
    def __init__(self, activity: Mapping[str, Activity]) -> None:
        self._activity = activity

    @property
    def num_running(self) -> int:
        return len(self._activity)

    def activity(self) -> Mapping[str, Activity]:
        return self._activity


def test_stall_report_names_each_open_group_and_what_its_members_do() -> None:
    sc = make_scenario(batch_size=4, group_size=2)
    buf = SampleBuffer(alpha=1, batch_size=4, group_size=2)
    ids = buf.try_start_group("g0", "math")
    assert ids is not None
    a, b = ids
    watchdog = StallWatchdog(sc.run, buf, _Running({a: Activity("g0", "env step 1", 10.0)}),
                             clock=lambda: 40.0)
    report = watchdog.report(35.0)
    assert report.splitlines() == [
        "no batch for 35 s at version 0: 0/4 samples ready, 1 group(s) collecting, "
        "1 trajectories running",
        f"  group g0 (math): 0/2 kept; {a} env step 1 for 30 s; {b} not started"]


async def test_a_background_task_that_raises_is_fatal_for_the_next_step(caplog) -> None:
    ctl, _, _ = make_controller([FakeWorker("m")])
    caplog.set_level(logging.ERROR, logger="rollart.controller.rollout.tasks")
    try:
        await ctl.start()

        async def broken() -> None:
            raise ValueError("a bug")

        task = ctl.tasks.spawn(broken(), "broken")
        await asyncio.gather(task, return_exceptions=True)
        with pytest.raises(ValueError, match="a bug"):
            await ctl.step()
        assert any(r.name == "rollart.controller.rollout.tasks"
                   and "fatal error in broken: ValueError: a bug" in r.getMessage()
                   for r in caplog.records)
    finally:
        await ctl.close()
    assert ctl.num_running == 0 and ctl.tasks.closed
