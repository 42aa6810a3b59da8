"""``run.hold_batch_for_groups``: a ready batch waits for an open group it would make stale
(``SampleBuffer(hold_for_groups=True)``), at most ``run.hold_batch_max_s`` (``StepRunner``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollart.config import RunConfig
from rollart.controller.buffer.core import Sample, SampleBuffer
from rollart.controller.modes import MODES
from rollart.controller.rollout.tasks import Signal
from rollart.controller.snapshot import restore_buffer
from rollart.controller.training.step import StepRunner
from rollart.transport.errors import ConfigError


def sample(tid: str, key: str, versions: list[int]) -> Sample:
    n = len(versions)
    return Sample(sample_id=tid, group_key=key, token_ids=[1] + [2] * n,
                  loss_mask=[0] + [1] * n, behaviour_logprobs=[0.0] + [-0.5] * n,
                  versions=[-1, *versions], reward=1.0)


def start(buf: SampleBuffer, key: str) -> str:
    ids = buf.try_start_group(key)
    assert ids is not None and len(ids) == 1
    return ids[0]


def turn(buf: SampleBuffer, tid: str) -> None:
    assert buf.begin_turn(tid, buf.version) == "continue"
    buf.record_tokens(tid, [buf.version])


def complete(buf: SampleBuffer, tid: str, versions: list[int]) -> None:
    buf.complete(tid, sample(tid, buf.group_of(tid), versions))


def at_risk(hold: bool) -> tuple[SampleBuffer, str]:
    """alpha 1, one-sample batches, at version 1: group ``a`` is still running with a token of
    version 0 (stale at version 2) and group ``c`` is complete. Returns the buffer and ``a``'s
    trajectory id."""
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, hold_for_groups=hold)
    a = start(buf, "a")
    turn(buf, a)  # version 0: a batch now would not make it stale
    b = start(buf, "b")
    turn(buf, b)
    complete(buf, b, [0])
    assert [s.group_key for s in buf.take_batch() or []] == ["b"] and not buf.holding
    buf.advance_version()
    c = start(buf, "c")
    turn(buf, c)
    complete(buf, c, [1])
    return buf, a


def test_a_ready_batch_is_held_while_a_group_would_go_stale_then_takes_it() -> None:
    buf, a = at_risk(hold=True)
    assert buf.holds_batch({"c"})
    assert buf.take_batch() is None and buf.holding
    turn(buf, a)
    assert buf.take_batch() is None and buf.holding  # still running
    complete(buf, a, [0, 1])
    batch = buf.take_batch()
    assert [s.sample_id for s in batch or []] == [a] and not buf.holding
    buf.advance_version()
    assert buf.stats().wasted_tokens.get("stale", 0) == 0


def test_released_hold_trains_the_batch_and_the_group_goes_stale_as_without_it() -> None:
    buf, a = at_risk(hold=True)
    assert buf.take_batch() is None and buf.holding
    assert [s.group_key for s in buf.take_batch(hold=False) or []] == ["c"]
    assert not buf.holding
    buf.advance_version()
    assert buf.begin_turn(a, buf.version) == "restart"
    assert buf.restart_trajectory(a) is not None
    assert buf.stats().wasted_tokens["stale"] == 1


def test_off_by_default_the_batch_goes_at_once() -> None:
    buf, a = at_risk(hold=False)
    assert SampleBuffer(alpha=1, batch_size=1, group_size=1).hold_for_groups is False
    assert [s.group_key for s in buf.take_batch() or []] == ["c"] and not buf.holding


def test_a_group_without_tokens_or_at_alpha_headroom_is_not_waited_for() -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, hold_for_groups=True)
    start(buf, "a")  # no token yet
    b = start(buf, "b")
    turn(buf, b)
    assert not buf.holds_batch(set())  # b's token (version 0) is fine at version 1
    complete(buf, b, [0])
    assert buf.take_batch() is not None and not buf.holding


@pytest.mark.parametrize(("kwargs"), [dict(check="admission"),
                                      dict(staleness_control="areal")])
def test_hold_needs_the_per_turn_check_and_the_strict_bound(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="hold_for_groups needs check 'per_turn'"):
        SampleBuffer(alpha=1, batch_size=1, group_size=1, hold_for_groups=True, **kwargs)


def test_the_setting_is_not_in_a_snapshot_and_a_resumed_run_takes_the_scenarios() -> None:
    buf, a = at_risk(hold=True)
    snap = buf.snapshot()
    assert "hold_for_groups" not in snap["config"]  # the pinned checkpoint layout is unchanged
    restored = SampleBuffer.restore(snap)
    assert restored.hold_for_groups is False and restored.held_sample_ids() == buf.held_sample_ids()
    for hold in (True, False):
        scenario = SampleBuffer(alpha=1, batch_size=1, group_size=1, hold_for_groups=hold)
        got = restore_buffer({"format": 1, "buffer": snap}, scenario_buffer=scenario,
                             buffer_class=SampleBuffer, seed=0, trainer_version=1,
                             on_forget=lambda key: None, on_drop=None)
        assert got.hold_for_groups is hold
        (a2,) = got.drain_restarts()  # a's running slot restarts; a lagging worker serves it
        assert got.begin_turn(a2, 0) == "continue"
        got.record_tokens(a2, [0])
        assert (got.take_batch() is None) is hold


class FakeTasks:
    """What ``StepRunner._get_batch`` uses of ``TrajectoryTasks``."""

    def __init__(self) -> None:
        self.changed = Signal()
        self.num_running = 1

    def raise_if_fatal(self) -> None:
        pass

    def launch_restarts(self) -> None:
        pass


class FakeAdmission:
    def can_admit(self) -> bool:
        return True


def runner(buf: SampleBuffer, max_s: float, clock: Any = None) -> tuple[StepRunner, FakeTasks]:
    run = RunConfig(hold_batch_for_groups=True, hold_batch_max_s=max_s)
    tasks = FakeTasks()
    loop = asyncio.get_running_loop()
    unused: Any = None
    return StepRunner(run, MODES["rollart"], buffer=buf, proxy=unused, trainer=unused,
                      tasks=tasks, admission=FakeAdmission(),  # type: ignore[arg-type]
                      sync=unused, counters=unused, clock=clock or loop.time), tasks


@pytest.mark.looptime
async def test_step_waits_for_the_group_and_takes_it_when_it_completes() -> None:
    buf, a = at_risk(hold=True)
    steps, tasks = runner(buf, max_s=60.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def finish_a() -> None:
        await asyncio.sleep(5.0)  # virtual time: the group's last turn
        turn(buf, a)
        complete(buf, a, [0, 1])
        tasks.changed.notify()

    finisher = asyncio.create_task(finish_a())
    batch = await steps._get_batch()
    await finisher
    assert [s.sample_id for s in batch] == [a]
    assert loop.time() - t0 == pytest.approx(5.0, abs=0.5)


@pytest.mark.looptime
async def test_step_holds_a_batch_at_most_hold_batch_max_s() -> None:
    buf, a = at_risk(hold=True)
    steps, tasks = runner(buf, max_s=30.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def noise() -> None:  # outcomes of other trajectories wake the step meanwhile
        for _ in range(10):
            await asyncio.sleep(1.0)
            tasks.changed.notify()

    waker = asyncio.create_task(noise())
    batch = await steps._get_batch()  # group a hangs: never completes
    await waker
    assert [s.group_key for s in batch] == ["c"]
    assert loop.time() - t0 == pytest.approx(30.0, abs=0.5)
    buf.advance_version()
    assert buf.begin_turn(a, buf.version) == "restart"  # stale as without the option


@pytest.mark.looptime
@pytest.mark.timeout(120)
async def test_a_hold_bound_the_clock_reads_as_not_quite_passed_still_releases_it() -> None:
    """Held from t = 0.1 s for at most 0.2 s: when the timer fires the loop's clock reads 0.3,
    and 0.3 - 0.1 < 0.2 in floating point while 0.1 + 0.2 - 0.3 is 5.6e-17 s. Re-reading the
    clock must not make the step wait again on a timer the loop runs at once (virtual time
    then never advances: the run hangs)."""
    buf, a = at_risk(hold=True)
    steps, tasks = runner(buf, max_s=0.2)
    loop = asyncio.get_running_loop()
    await asyncio.sleep(0.1 - loop.time())
    batch = await steps._get_batch()  # group a hangs: never completes
    assert [s.group_key for s in batch] == ["c"]
    assert loop.time() == pytest.approx(0.3)


def test_a_group_on_its_last_batch_is_taken_before_one_whose_bound_leaves_it_more() -> None:
    """Per-group alpha: ``long`` (alpha 3) and ``short`` (alpha 1) both hold version-0 tokens
    at version 1; ``long`` was admitted first, so oldest-token-then-admission order alone
    would take it and let ``short`` go stale at version 2."""
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1)
    x = start(buf, "x")
    turn(buf, x)
    complete(buf, x, [0])
    assert buf.take_batch() is not None
    ids = {}
    for key, alpha in (("long", 3), ("short", 1)):
        got = buf.try_start_group(key, "d", alpha)
        assert got is not None
        ids[key] = got[0]
        assert buf.begin_turn(got[0], 0) == "continue"  # a worker still serving version 0
        buf.record_tokens(got[0], [0])
    buf.advance_version()
    for key in ("long", "short"):
        complete(buf, ids[key], [0])
    assert [s.group_key for s in buf.take_batch() or []] == ["short"]
    buf.advance_version()
    assert [s.group_key for s in buf.take_batch() or []] == ["long"]
    assert buf.stats().wasted_tokens.get("stale", 0) == 0


def crowded_last_batch(hold: bool) -> tuple[SampleBuffer, dict[str, str]]:
    """alpha 2, two one-sample groups per batch, at version 1: ``a``, ``b``, ``c`` and ``d``
    hold version-0 tokens (their last batch is the one at version 2), ``a`` and the younger
    ``y`` (version 1) are complete, the rest still run. A batch of ``a`` and ``y`` now leaves
    three groups for the two places of the batch at version 2. Returns the trajectory ids."""
    buf = SampleBuffer(alpha=2, batch_size=2, group_size=1, hold_for_groups=hold)
    for key in ("x0", "x1"):
        tid = start(buf, key)
        turn(buf, tid)
        complete(buf, tid, [0])
    assert buf.take_batch() is not None
    ids = {key: start(buf, key) for key in "abcd"}
    for tid in ids.values():
        turn(buf, tid)  # version 0
    buf.advance_version()
    ids["y"] = start(buf, "y")
    turn(buf, ids["y"])  # version 1
    for key in "ay":
        complete(buf, ids[key], [buf.version - (key == "a")])
    return buf, ids


def test_a_batch_waits_to_take_a_group_that_the_next_batch_has_no_place_for() -> None:
    buf, ids = crowded_last_batch(hold=True)
    assert buf.holds_batch({"a", "y"}, ["a", "y"])
    assert not buf.holds_batch({"a", "y"}, ["a"])  # no younger group in the batch
    assert buf.take_batch() is None and buf.holding
    complete(buf, ids["b"], [0])
    assert sorted(s.group_key for s in buf.take_batch() or []) == ["a", "b"]
    assert not buf.holding
    buf.advance_version()
    for key in "cd":
        complete(buf, ids[key], [0])
    assert sorted(s.group_key for s in buf.take_batch() or []) == ["c", "d"]
    buf.advance_version()
    assert [s.group_key for s in buf.take_batch() or []] == []  # y alone: no batch yet
    assert buf.group_complete("y")
    assert buf.stats().wasted_tokens.get("stale", 0) == 0


def test_without_the_wait_the_group_left_out_goes_stale() -> None:
    buf, ids = crowded_last_batch(hold=False)
    assert sorted(s.group_key for s in buf.take_batch() or []) == ["a", "y"]
    buf.advance_version()
    for key in "bcd":
        complete(buf, ids[key], [0])
    assert sorted(s.group_key for s in buf.take_batch() or []) == ["b", "c"]
    buf.advance_version()
    assert buf.stats().wasted_tokens["stale"] == 1  # d's version-0 token
