"""Controller + modes over fake backends: ordering of each mode, stragglers, overlap,
staleness, redundancy, failures and fatal errors. Timing tests run on looptime's virtual clock
(``@pytest.mark.looptime``), so "100 s" of env latency costs no wall time."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from helpers.fakes import (
    LAZY_POLICY,
    FakeEnvHost,
    FakeReward,
    FakeTrainer,
    FakeWorker,
    make_scenario,
)
from rollart.controller import Backends, Cluster
from rollart.controller.controller import ControllerStalledError
from rollart.controller.routing.proxy import PoolExhaustedError
from rollart.launcher.progress import waste_summary
from rollart.transport.errors import RollartError


def backends(env: FakeEnvHost, trainer: FakeTrainer | None = None,
             workers: tuple[FakeWorker, FakeWorker] | None = None,
             reward: FakeReward | None = None) -> Backends:
    w1, w2 = workers or (FakeWorker("w1"), FakeWorker("w2"))
    from helpers.fakes import TOK

    return Backends(pools={"p1": [w1], "p2": [w2]}, trainer=trainer or FakeTrainer(),
                    tokenizer=TOK, env_hosts=[env], reward_service=reward or FakeReward())


async def run_steps(cluster: Cluster, n: int, timeout_s: float = 1000.0):
    out = []

    async def go():
        async for step in cluster.train(steps=n):
            out.append(step)

    await asyncio.wait_for(go(), timeout_s)
    return out


@pytest.mark.looptime
async def test_rollart_mode_trains_whole_groups_and_syncs_weights() -> None:
    # The first two groups are fast, later ones slow: batch 2 is ready well after the push.
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0 if i < 4 else 10.0)
    trainer = FakeTrainer(train_s=2.0, push_s=0.5)
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2))) as c:
        steps = await run_steps(c, 3)
    assert [s.metrics.policy_version for s in steps] == [1, 2, 3]
    for s in steps:
        assert s.metrics.num_samples == 4 and len(s.samples) == 4
        groups = {x.group_key for x in s.samples}
        assert len(groups) == 2  # whole groups only
        assert s.metrics.staleness_max <= 1
        assert set(s.metrics.reward_mean_by_domain) <= {"game", "math"}
    ids = [x.sample_id for s in steps for x in s.samples]
    assert len(ids) == len(set(ids))  # never trained twice
    # Paper §6.2: the version trained at step k is applied at step k+1 (before its training).
    assert [v for v, _ in w1.applied] == [1, 2] == [v for v, _ in w2.applied]
    assert trainer.pushed[:2] == [1, 2]  # the push of 3 overlaps rollout; close cancels it
    m2 = steps[1].metrics
    assert m2.weight_sync_total_s >= 0.5  # the 0.5 s push of version 1...
    assert m2.weight_sync_exposed_s < 0.5  # ...ran during rollout: only the apply is exposed
    assert env.closed and set(env.closed) == set(env.opened) - set(env.sessions)


@pytest.mark.looptime
async def test_straggler_env_does_not_hold_a_trajectory_level_batch() -> None:
    """Issue acceptance: injected env latency; one straggler env (session 0, 100 s per step)
    is still stepping when the trajectory-level run finishes its batch."""
    env = FakeEnvHost(turns=2, latency=lambda i, s: 100.0 if i == 0 else 1.0)
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env)) as c:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        (step,) = await run_steps(c, 1)
        elapsed = loop.time() - t0
        straggler = env.sessions.get("s0")
        assert straggler is not None and straggler.steps == 0  # still in its first step
        assert "s0" not in env.closed
    assert elapsed < 10.0 and step.metrics.num_samples == 4
    assert all(x.metadata["seed"] != straggler.seed or x.sample_id for x in step.samples)
    assert "s0" in env.closed  # cleaned up when the cluster closed


@pytest.mark.looptime
async def test_sync_mode_batch_barrier_waits_for_the_straggler_at_every_turn() -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 100.0 if i == 0 else 1.0)
    scenario = make_scenario(mode="sync", alpha=0, batch_size=4, group_size=2)
    asked: dict[str, list[float]] = {"0": [], "1": []}

    def respond(req):
        asked[req.request_id.rsplit("/t", 1)[1]].append(asyncio.get_running_loop().time())
        return "ok"

    w1, w2 = FakeWorker("w1", respond), FakeWorker("w2", respond)
    async with Cluster.from_scenario(scenario, backends=backends(env, None, (w1, w2))) as c:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        (step,) = await run_steps(c, 1)
        elapsed = loop.time() - t0
    # Batch rollout: every turn waits for the slowest env step (2 turns x 100 s).
    assert elapsed >= 200.0 and step.metrics.num_samples == 4
    first, second = asked["0"][:4], asked["1"][:4]
    assert max(first) - min(first) < 1e-6  # turn 0 of all 4 trajectories together
    assert min(second) >= t0 + 100.0  # turn 1 only after the straggler's first step
    assert max(second) - min(second) < 1e-6


@pytest.mark.looptime
async def test_sync_plus_is_trajectory_level_but_does_not_overlap_training() -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 100.0 if i == 0 else 1.0)
    trainer = FakeTrainer(train_s=50.0)
    done_at: list[float] = []

    def respond(req):
        done_at.append(asyncio.get_running_loop().time())
        return "ok"

    w1, w2 = FakeWorker("w1", respond), FakeWorker("w2", respond)
    scenario = make_scenario(mode="sync_plus", alpha=0, batch_size=4, group_size=2,
                             redundancy=1)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2))) as c:
        steps = await run_steps(c, 2)
    # Trajectory level + redundancy: the straggler member is cancelled, no 200 s barrier.
    assert steps[0].metrics.step_time_s < 100.0
    assert steps[0].metrics.num_aborted >= 1
    # No generation completes while the trainer trains (generation is paused).
    for t0, t1 in trainer.train_spans:
        assert not any(t0 < t < t1 for t in done_at)
    assert steps[1].metrics.policy_version == 2
    assert steps[1].metrics.weight_sync_exposed_s == steps[1].metrics.weight_sync_total_s


@pytest.mark.looptime
async def test_one_off_overlaps_rollout_of_the_next_batch_with_training() -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 5.0)
    trainer = FakeTrainer(train_s=50.0)
    gen_at: list[float] = []

    def respond(req):
        gen_at.append(asyncio.get_running_loop().time())
        return "ok"

    scenario = make_scenario(mode="one_off", alpha=1, batch_size=4, group_size=2)
    w1, w2 = FakeWorker("w1", respond), FakeWorker("w2", respond)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2))) as c:
        in_flight = []
        async for step in c.train(steps=3):
            in_flight.append(c.controller.buffer.stats().groups_in_flight)
            versions = {v for x in step.samples for v in x.versions if v >= 0}
            assert len(versions) == 1  # batch level: one weight version per batch
    t0, t1 = trainer.train_spans[0]
    assert any(t0 < t < t1 for t in gen_at)  # rollout of step 2 during training of step 1
    assert max(in_flight) <= 2  # at most one batch (2 groups) in flight
    # Step 2 trains on data generated by version 0 while the trainer is at 1: one step off.
    assert trainer.batches[1][0].versions[-1] == 0


@pytest.mark.looptime
@pytest.mark.parametrize("mode", ["areal", "rollart"])
async def test_areal_keeps_stale_samples_that_rollart_drops(mode) -> None:
    env = FakeEnvHost(turns=3, latency=lambda i, s: 5.0)
    trainer = FakeTrainer(train_s=20.0)
    # the lazy policy: greedy admission fills the (alpha + 1) x batch bound, and samples go
    # stale (the default policy starts no group its batches cannot take)
    scenario = make_scenario(mode=mode, alpha=1, batch_size=4, group_size=2, **LAZY_POLICY)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer)) as c:
        await run_steps(c, 1)
        buf = c.controller.buffer
        assert buf.stats().groups_in_flight == 4  # (alpha + 1) x batch either way
        steps = await run_steps(c, 3)
        stats = buf.stats()
    worst = max(s.metrics.staleness_max for s in steps)
    if mode == "areal":
        # AReaL: staleness only through admission capacity; nothing is dropped as stale and
        # the metrics report the staleness it really trained at, beyond alpha here.
        assert buf.staleness_control == "areal" and buf.check == "admission"
        assert worst > 1 and "stale" not in stats.dropped and stats.restarted_stale == 0
    else:
        assert buf.staleness_control == "bound" and worst <= 1


@pytest.mark.looptime
async def test_long_trajectories_are_restarted_when_they_would_exceed_alpha() -> None:
    # 6 turns of 10 s each while the trainer steps every ~few seconds: tokens get too old.
    env = FakeEnvHost(turns=6, latency=lambda i, s: 10.0 if i % 4 == 0 else 0.5)
    trainer = FakeTrainer(train_s=1.0)
    # the lazy policy: trajectories started on old weights and no hold, so some go stale
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2, max_turns=8,
                             max_tokens_per_trajectory=1024, **LAZY_POLICY)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer)) as c:
        steps = await run_steps(c, 6)
    assert sum(s.metrics.num_aborted for s in steps) >= 1
    for s in steps:
        v = s.metrics.policy_version - 1  # the trainer version the batch was taken at
        for x in s.samples:
            assert min(t for t in x.versions if t >= 0) >= v - 1  # alpha = 1, always


@pytest.mark.looptime
async def test_failures_are_counted_by_reason_retried_and_never_scored() -> None:
    env = FakeEnvHost(turns=2, fail=lambda i, s: i % 3 == 0)
    reward = FakeReward()
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env, reward=reward)) as c:
        steps = await run_steps(c, 2)
    failed = sum(s.metrics.num_failed_by_reason.get("env_error", 0) for s in steps)
    assert failed >= 1 and sum(s.metrics.num_retries for s in steps) >= 1
    failed_sessions = {f"s{i}" for i in range(0, len(env.opened), 3)}
    scored = {call["metadata"]["session"] for call in reward.calls}
    assert scored and not scored & failed_sessions  # failures are never scored
    assert all(x.reward in (0.0, 1.0, 2.0) for s in steps for x in s.samples)
    assert failed_sessions <= set(env.closed)  # failures released their sessions


@pytest.mark.looptime
async def test_every_trajectory_failing_is_fatal_not_a_hang() -> None:
    env = FakeEnvHost(turns=2, fail=lambda i, s: True)
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env)) as c:
        with pytest.raises(ControllerStalledError, match="failures in a row") as err:
            await run_steps(c, 1)
    # The last reasons, each once with its count: a misconfigured env fails every
    # trajectory the same way, and the run's last line must not repeat it five times.
    assert "; last 5: " in str(err.value)
    reasons = str(err.value).split("; last 5: ", 1)[1]
    assert sum(int(part.split("x ", 1)[0]) if part[0].isdigit() else 1
               for part in reasons.split("; ")) == 5


def test_last_failures_names_each_reason_once_with_its_count() -> None:
    from rollart.controller.rollout.tasks import last_failures

    assert last_failures(["env_error: a", "env_error: a", "env_error: b", "env_error: a"]) == (
        "3x 'env_error: a'; 'env_error: b'")
    assert last_failures(["x"]) == "'x'"


@pytest.mark.looptime
async def test_losing_every_worker_of_a_pool_is_fatal() -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0)
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env, None, (w1, w2))) as c:
        await run_steps(c, 1)
        w2.kill()
        with pytest.raises(PoolExhaustedError, match="pool 'p2'"):
            await run_steps(c, 5)


@pytest.mark.looptime
async def test_redundancy_cancels_stragglers_and_reports_waste_and_length_bias() -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 50.0 if i % 3 == 2 else 1.0)
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2, redundancy=1)
    async with Cluster.from_scenario(scenario, backends=backends(env, None, (w1, w2))) as c:
        steps = await run_steps(c, 2)
    m = steps[0].metrics
    assert m.num_aborted >= 1 and m.wasted_tokens >= 1
    assert m.response_len_kept_mean > 0 and m.response_len_all_mean > 0
    assert w1.aborted or w2.aborted or m.wasted_tokens  # cancelled generation / tokens thrown away


@pytest.mark.looptime
async def test_driver_local_reward_and_runtime_affinity() -> None:
    env = FakeEnvHost(turns=1, latency=lambda i, s: 1.0)
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    cluster = Cluster.from_scenario(scenario, backends=backends(env, None, (w1, w2)))
    calls = []

    @cluster.reward("env_return")  # overrides the built-in for this test
    def env_return(prompt, response, reference, metadata):
        calls.append(response)
        return 0.5, {"why": "test"}

    async with cluster as c:
        await run_steps(c, 1)
        c.set_affinity("math", "p1")
        n2 = len(w2.requests)
        await run_steps(c, 2)
        await asyncio.sleep(0)
    assert calls
    assert len(w2.requests) - n2 <= 4  # only turns already routed before the change
    with pytest.raises(Exception, match="unknown pool"):
        cluster.set_affinity("math", "nope")


@pytest.mark.looptime
async def test_snapshot_resume_keeps_held_samples_and_group_seeds() -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0 if i % 2 else 3.0)
    trainer = FakeTrainer(train_s=5.0)
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    # the lazy policy: greedy admission leaves samples held in the buffer at the checkpoint
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2,
                             **LAZY_POLICY)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2))) as c:
        first = await run_steps(c, 2)
        snap = msgspec.json.decode(msgspec.json.encode(c.snapshot()))  # JSON round trip
    held = {s["sample"]["sample_id"] for g in snap["buffer"]["groups"] for s in g["slots"]
            if s is not None and s["state"] == "held"}
    assert held and snap["step"] == 2
    # A new controller over the same backends continues; the workers serve version 1, the
    # trainer is at 2: the start pushes and applies 2 before any turn.
    assert w1.version == 1 and trainer.version == 2
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2)),
                                     resume=snap) as c2:
        steps = await run_steps(c2, 2)
    assert steps[0].step == 3 and w1.applied[1] == (2, False)
    trained = {x.sample_id for s in steps for x in s.samples}
    assert held <= trained  # nothing completed before the snapshot was lost
    # The run's token totals add up across the resume (summary.json sums the steps' rows):
    # the held samples' tokens are trained after it, the running slots' wasted ("resume").
    lost = sum(s.get("num_tokens", 0) for g in snap["buffer"]["groups"] for s in g["slots"]
               if s is not None and s["state"] == "running")
    assert steps[0].metrics.wasted_tokens_by_reason.get("resume", 0) == lost
    rows = [msgspec.to_builtins(s.metrics) for s in (*first, *steps)]
    totals = waste_summary(rows, {"math": 1.0})
    assert totals["generated_tokens"] == (totals["trained_tokens"] + totals["wasted_tokens"]
                                          + totals["in_flight_tokens"])
    assert all(r["trained_tokens"] > 0 for r in rows)
    # what finished between the last step and the checkpoint is counted, once
    assert all(d["trained"] <= d["finished"] for d in totals["domains"].values())
    # A scenario edited since the snapshot is refused by name, not silently overridden.
    edited = make_scenario(mode="rollart", alpha=2, batch_size=4, group_size=2,
                           abort_stale=True, **LAZY_POLICY)
    with pytest.raises(RollartError) as info:
        async with Cluster.from_scenario(edited, backends=backends(env, trainer, (w1, w2)),
                                         resume=snap):
            pass
    assert "run.alpha (checkpoint 1, scenario 2), run.abort_stale (checkpoint False, " \
        "scenario True)" in str(info.value)


@pytest.mark.looptime
async def test_unbiased_selection_waits_for_the_deadline_then_keeps_group_size() -> None:
    env = FakeEnvHost(turns=1, latency=lambda i, s: [1.0, 2.0, 500.0][i % 3])
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2, redundancy=1,
                             selection="unbiased", selection_deadline_s=10.0)
    async with Cluster.from_scenario(scenario, backends=backends(env)) as c:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        (step,) = await run_steps(c, 1)
        elapsed = loop.time() - t0
    # Group members finish at ~1 s and ~2 s; the third (500 s) is cancelled at the deadline,
    # which runs 10 s after the group_size-th finisher.
    assert 10.0 <= elapsed < 100.0
    assert step.metrics.num_aborted >= 1


class FakeCollectiveTrainer(FakeTrainer):
    """A trainer whose push writes into the serving models (NCCL / gloo broadcast): records
    whether every worker was paused when each push ran."""

    push_needs_pause = True

    def __init__(self, workers: tuple[FakeWorker, FakeWorker], **kw) -> None:
        super().__init__(**kw)
        self.fake_workers = workers
        self.paused_at_push: list[bool] = []

    async def push_weights(self, version, workers) -> None:
        self.paused_at_push.append(all(not w._running.is_set() for w in self.fake_workers))
        await super().push_weights(version, workers)


@pytest.mark.looptime
@pytest.mark.parametrize("mode,alpha", [("rollart", 1), ("sync", 0), ("areal", 1)])
async def test_a_collective_push_runs_only_while_every_worker_is_paused(mode, alpha) -> None:
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0)
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    trainer = FakeCollectiveTrainer((w1, w2), train_s=2.0, push_s=0.5)
    scenario = make_scenario(mode=mode, alpha=alpha, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2))) as c:
        steps = await run_steps(c, 3)
    assert [s.metrics.policy_version for s in steps] == [1, 2, 3]
    assert trainer.pushed and all(trainer.paused_at_push), trainer.paused_at_push
    assert [v for v, _ in w1.applied] == trainer.pushed == [v for v, _ in w2.applied]
    if mode != "sync":
        # Nothing was pushed in the background: the whole push is exposed.
        assert steps[1].metrics.weight_sync_exposed_s >= 0.5


@pytest.mark.looptime
async def test_the_first_steps_weight_sync_includes_a_resumed_runs_alignment() -> None:
    # A resumed trainer at version 2; the workers restarted from the base weights (version 0).
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1.0)
    trainer = FakeTrainer(train_s=1.0, push_s=3.0)
    trainer._version = 2
    w1, w2 = FakeWorker("w1"), FakeWorker("w2")
    scenario = make_scenario(mode="rollart", alpha=1, batch_size=4, group_size=2)
    async with Cluster.from_scenario(scenario, backends=backends(env, trainer, (w1, w2))) as c:
        steps = await run_steps(c, 2)
    assert [v for v, _ in w1.applied][:1] == [2]  # aligned before the first turn
    assert steps[0].metrics.weight_sync_total_s >= 3.0  # the 3 s alignment push is reported
    assert steps[0].metrics.weight_sync_exposed_s >= 3.0  # (nothing else to sync at step 1)
