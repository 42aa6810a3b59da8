"""Controller staleness policies over fake backends: eager (staggered) weight apply, yield-
corrected domain mix, paced admission, waste by reason in the step metrics, and the config
rules of these options. Timing runs on looptime's virtual clock."""

from __future__ import annotations

import msgspec
import pytest
from test_controller_modes import backends, run_steps

from helpers.fakes import FakeEnvHost, FakeTrainer, FakeWorker, make_scenario
from rollart.config import validate_scenario
from rollart.controller import Cluster
from rollart.controller.buffer.sample import DomainCounts
from rollart.controller.rollout.pacing import Pacer
from rollart.controller.routing.proxy import LLMProxy
from rollart.transport.errors import ConfigError


@pytest.mark.looptime
@pytest.mark.parametrize("apply", ["at_batch", "eager"])
async def test_eager_apply_reaches_the_workers_before_the_next_batch(apply) -> None:
    # Groups 0-1 are fast (batch 1 at t~2), groups 2-3 slow (10 s per env step): their second
    # turn runs at t~10, after version 1 was trained (t~4) and pushed (t~4.5).
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0 if i < 4 else 10.0)
    trainer = FakeTrainer(train_s=2.0, push_s=0.5)
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2,
                             weight_apply=apply)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2))) as c:
        steps = await run_steps(c, 3)
    newest = max(max(s.versions) for s in steps[1].samples)
    # at_batch: version 1 reaches the workers only once batch 2 is taken, so batch 2 holds
    # version-0 tokens only; eager: the slow groups' second turns are already of version 1.
    assert newest == (1 if apply == "eager" else 0)
    assert [v for v, _ in w1.applied] == [1, 2] == [v for v, _ in w2.applied]
    for s in steps:
        assert s.metrics.staleness_max <= 1


class _WatchingWorker(FakeWorker):
    """Records, at each apply, whether its pool mate was still generating (not paused)."""

    mate: FakeWorker
    mate_running_at_apply: list[bool]

    async def apply_weights(self, version: int, *, reprefill: bool = False):
        self.mate_running_at_apply.append(self.mate._running.is_set())
        return await super().apply_weights(version, reprefill=reprefill)


@pytest.mark.parametrize(("waves", "mate_running"), [(2, [True, True]), (1, [False, False])])
async def test_staggered_apply_never_pauses_a_whole_pool(waves, mate_running) -> None:
    a, b = _WatchingWorker("a"), _WatchingWorker("b")
    a.mate, b.mate = b, a
    a.mate_running_at_apply, b.mate_running_at_apply = [], []
    proxy = LLMProxy({"p": ("cpu", [a, b])}, {"d": "p"})
    await proxy.apply_in_waves(1, waves)
    assert a.mate_running_at_apply + b.mate_running_at_apply == mate_running
    assert (proxy.version, a.version, b.version) == (1, 1, 1)
    assert a._running.is_set() and b._running.is_set()  # every wave resumed
    with pytest.raises(ValueError, match="waves must be >= 1, got 0"):
        await proxy.apply_in_waves(2, 0)


async def test_yield_mix_starts_less_productive_domains_more_often() -> None:
    env = FakeEnvHost(turns=1)
    scenario = make_scenario(domain_mix="yield", group_size=2)
    cluster = Cluster.from_scenario(scenario, backends=backends(env))
    async with cluster:
        ctl = cluster.controller
        assert ctl is not None
        assert ctl.domain_weights() == [1.0, 1.0]  # no history: the configured weights
        await ctl.close()  # stop admission so the counters below stay as set
        counts = ctl.buffer.domain_counts()
        counts.clear()
        in_flight = ctl.buffer.groups_in_flight_by_domain()
        # game: 10 groups resolved, 20 samples trained (all); math: 10 resolved, 4 trained.
        counts["game"] = DomainCounts(groups_started=10 + in_flight.get("game", 0), trained=20)
        counts["math"] = DomainCounts(groups_started=10 + in_flight.get("math", 0), trained=4)
        # yield = (trained + G) / (G * resolved + G): game 22/22, math 6/22.
        assert ctl.domain_weights() == pytest.approx([1.0, 22 / 6])
        # A domain that trains nothing is boosted at most MAX_YIELD_BOOST (4) times, not
        # (G * resolved + G) / G = 11 times.
        counts["math"] = DomainCounts(groups_started=10 + in_flight.get("math", 0), trained=0)
        assert ctl.domain_weights() == pytest.approx([1.0, 4.0])


@pytest.mark.looptime
async def test_step_metrics_attribute_waste_to_reasons_and_domains() -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 30.0 if i % 3 == 2 else 1.0)
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2, redundancy=1)
    async with Cluster.from_scenario(scenario, backends=backends(env)) as c:
        steps = await run_steps(c, 3)
        stats = c.controller.buffer.stats()
    for s in steps:
        m = s.metrics
        assert m.wasted_tokens == sum(m.wasted_tokens_by_reason.values())
        assert sum(d.trained for d in m.by_domain.values()) == m.num_samples == 4
        assert sum(d.trained_tokens for d in m.by_domain.values()) == m.trained_tokens
        assert m.trained_tokens == sum(x.num_generated for x in s.samples)
        for name, d in m.by_domain.items():
            assert sum(d.wasted_tokens.values()) <= d.generated_tokens, name
    assert any(s.metrics.wasted_tokens_by_reason.get("redundancy") for s in steps)
    # Over the run, every token generated is trained, wasted once, or still in flight.
    generated = sum(s.metrics.buffer_generated_tokens for s in steps)
    wasted = sum(s.metrics.wasted_tokens for s in steps)
    trained = sum(s.metrics.trained_tokens for s in steps)
    assert generated == trained + wasted + steps[-1].metrics.in_flight_tokens
    assert stats.generated_tokens == stats.trained_tokens + sum(stats.wasted_tokens.values()) \
        + stats.in_flight_tokens
    # Closing the run cancels the running members: their tokens are wasted as "shutdown" (or
    # "retired", the held samples of groups that can then no longer fill); the identity holds.
    final = c.controller.buffer.stats()
    assert final.running == 0
    assert final.generated_tokens == final.trained_tokens + sum(final.wasted_tokens.values()) \
        + final.in_flight_tokens
    assert set(final.wasted_tokens) <= {"stale", "redundancy", "failed", "unselected",
                                        "retired", "shutdown"}


@pytest.mark.looptime
async def test_paced_admission_and_fresh_start_keep_training_strictly() -> None:
    env = FakeEnvHost(turns=3, latency=lambda i, s: 1.0 + (i % 5))
    trainer = FakeTrainer(train_s=2.0, push_s=1.0)
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2,
                             weight_apply="eager", fresh_start=True, admission="paced",
                             abort_stale=True, domain_mix="yield")
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer)) as c:
        steps = await run_steps(c, 6)
    assert [s.metrics.policy_version for s in steps] == [1, 2, 3, 4, 5, 6]
    for s in steps:
        version = s.metrics.policy_version - 1  # the batch trained at this version
        for x in s.samples:
            assert min(x.versions) >= version - 1  # the generated tokens' versions


# ---------------------------------------------------------------------------------- pacer
def test_pacer_holds_a_group_back_only_when_the_next_apply_would_save_it() -> None:
    p = Pacer(group_size=2, window=8)
    assert not p.should_wait("d", 0.0, 0, 1)  # nothing measured yet: start
    p.on_batch(0.0, 0)
    p.on_batch(10.0, 1)  # period 10 s per version
    for dur in (2.0, 4.0, 6.0, 8.0):
        p.on_finished("d", dur)
    assert p.period_s() == 10.0
    # median of the max of 2 members: the 0.5 ** 0.5 = 0.707 quantile of [2, 4, 6, 8] -> 6
    assert p.group_time_s("d") == 6.0
    p.on_apply(11.0)
    # serving 1, alpha 1: deadline = batch at version 2, expected at 10 + 10 = 20 s.
    assert not p.should_wait("d", 11.0, 1, 1)  # 11 + 6 <= 20: start now
    # at 15 s: 21 > 20 misses; the next apply (21 s) + 6 = 27 <= 30: wait for it
    assert p.should_wait("d", 15.0, 1, 1)
    # a larger bound (alpha 2: deadline 30 s) makes it fit now
    assert not p.should_wait("d", 15.0, 1, 2)
    # lagging workers (serving 0): deadline 10 s; the next apply (21 s) + 6 > 20: waiting
    # would not save it either, so start (only a larger bound could)
    assert not p.should_wait("d", 15.0, 0, 1)
    with pytest.raises(ValueError, match="group_size >= 1 and window >= 2"):
        Pacer(group_size=0)


# ---------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("run", "domain_alpha", "message"),
    [
        ({"fresh_start": True, "weight_apply": "at_batch"}, None,
         "run.fresh_start: needs weight_apply = 'eager'"),
        ({"mode": "sync", "alpha": 0, "fresh_start": True, "weight_apply": "eager"}, None,
         "run.fresh_start: needs weight_apply = 'eager' in an overlap mode"),
        ({"alpha": 2}, 1, "domains[0].alpha: 1: a per-domain bound needs mode 'areal' or "
         "'rollart' (got 'rollart') and must be >= run.alpha 2"),
        ({"mode": "one_off"}, 3, "domains[0].alpha: 3: a per-domain bound needs mode"),
    ],
)
def test_staleness_options_are_validated(run, domain_alpha, message) -> None:
    scenario = make_scenario()
    scenario = msgspec.structs.replace(
        scenario, run=msgspec.structs.replace(scenario.run, **run),
        domains=[msgspec.structs.replace(scenario.domains[0], alpha=domain_alpha),
                 *scenario.domains[1:]])
    with pytest.raises(ConfigError) as info:
        validate_scenario(scenario, "s.toml")
    assert str(info.value).startswith(f"s.toml: {message}")


def test_unknown_or_out_of_range_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="apply_waves"):
        make_scenario(apply_waves=0)
    with pytest.raises(ConfigError, match="weight_apply"):
        make_scenario(weight_apply="later")


@pytest.mark.looptime
@pytest.mark.parametrize("admission", ["greedy", "capacity"])
async def test_capacity_admission_stops_generating_batches_that_cannot_be_trained(
        admission) -> None:
    # Trainer-bound: rollout fills every slot long before the 20 s update ends.
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0)
    trainer = FakeTrainer(train_s=20.0, push_s=0.5)
    # the hold off: admission alone decides what goes stale here
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2,
                             weight_apply="eager", fresh_start=True, admission=admission,
                             hold_batch_for_groups=False)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer)) as c:
        steps = await run_steps(c, 5)
    stale = sum(s.metrics.wasted_tokens_by_reason.get("stale", 0) for s in steps)
    # greedy: 2 batches in flight, 1 trained per step, the other goes stale at the next bump
    assert (stale == 0) == (admission == "capacity"), stale
