"""Fault injection into envs and rewards over the controller's fakes (issue #13, rewards and
envs). Each case: the run continues, the failure is counted by reason, no sample is lost or
trained twice, and no failure is scored (a failed trajectory never becomes a sample).

In-process env / reward cases run in real time (their calls run on threads, which a virtual
clock cannot wait for); the others run on looptime's virtual clock."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import numpy as np
import pytest
from test_controller_modes import run_steps

from helpers.fakes import TOK, FakeEnvHost, FakeReward, FakeTrainer, FakeWorker, _toml
from rollart import InvalidActionError
from rollart.config import Scenario, parse_scenario
from rollart.controller import Backends, Cluster
from rollart.transport.errors import EnvError, RewardTooLargeError


def scenario(env: str = "count", reward: str = "fake", reward_url: str = "service",
             domain: dict[str, Any] | None = None, **run: Any) -> Scenario:
    """One pool, one domain; ``domain`` adds domain fields, ``run`` [run] fields."""
    base = {"mode": "rollart", "alpha": 1, "batch_size": 4, "group_size": 2, "max_turns": 4,
            "max_tokens_per_turn": 16, "max_tokens_per_trajectory": 512, "seed": 1, **run}
    retry = base.pop("retry", None)
    lines = ["[run]"] + [f"{k} = {_toml(v)}" for k, v in base.items()]
    if retry:
        lines += ["[run.retry]"] + [f"{k} = {_toml(v)}" for k, v in retry.items()]
    lines += ['[[pools]]\nname = "p1"\nhardware = "cpu"',
              f'[[domains]]\nname = "d"\nenv = "{env}"\npool = "p1"\nreward = "{reward}"\n'
              f'reward_url = "{reward_url}"']
    for k, v in (domain or {}).items():
        lines.append(f"{k} = {v if isinstance(v, str) and v.startswith('{') else _toml(v)}")
    return parse_scenario("\n".join(lines), "faults.toml")


def backends(env: Any = None, reward: Any = None, worker: FakeWorker | None = None) -> Backends:
    return Backends(pools={"p1": [worker or FakeWorker("w1")]}, trainer=FakeTrainer(),
                    tokenizer=TOK, env_hosts=[env or FakeEnvHost(turns=2)],
                    reward_service=reward or FakeReward())


def check_batches(steps: list, batch_size: int = 4) -> None:
    """Every step trained a full batch; no sample twice; every reward came from a scorer."""
    ids = [s.sample_id for st in steps for s in st.samples]
    assert all(len(st.samples) == batch_size for st in steps)
    assert len(ids) == len(set(ids))


async def run_past_failure(cluster: Cluster, max_steps: int = 100_000) -> list:
    """Train until a failure was counted, then one more step (the run went on after it)."""
    steps: list = []
    async with asyncio.timeout(120):
        while True:
            async for st in cluster.train(steps=1):
                steps.append(st)
            assert cluster.controller is not None
            if cluster.controller.buffer.stats().failed or len(steps) >= max_steps:
                break
        async for st in cluster.train(steps=1):
            steps.append(st)
    return steps


def failed(steps: list) -> dict[str, int]:
    out: dict[str, int] = {}
    for st in steps:
        for k, v in st.metrics.num_failed_by_reason.items():
            out[k] = out.get(k, 0) + v
    return out


# ---------------------------------------------------------------------- in-process envs, rewards
class CountEnv:
    """In-process env: ``turns`` steps, reward 1 per "ok"; records the thread of each call and
    its options. ``hang_first``: the first session's first step blocks until ``release``."""

    threads: list[str] = []
    made: list[dict] = []

    def __init__(self, turns: int = 2, hang: threading.Event | None = None) -> None:
        CountEnv.made.append({"turns": turns})
        self.turns, self.steps, self.hang = turns, 0, hang

    def reset(self, seed: int):
        CountEnv.threads.append(threading.current_thread().name)
        return f"start {seed}", {}

    def step(self, action: str):
        CountEnv.threads.append(threading.current_thread().name)
        if self.hang is not None and not self.hang.is_set():
            self.hang.wait(300)
        self.steps += 1
        return f"obs {self.steps}", 1.0 if action == "ok" else 0.0, self.steps >= self.turns, \
            False, {}


async def test_in_process_env_gets_its_options_and_runs_off_the_loop() -> None:
    CountEnv.threads, CountEnv.made = [], []
    sc = scenario(env="local_count", reward="env_return", reward_url="local",
                  domain={"env_options": "{ turns = 3 }"})
    cluster = Cluster.from_scenario(sc, backends=backends())
    cluster.register_env("local_count", CountEnv)
    async with cluster as c:
        steps = await run_steps(c, 2, timeout_s=120)
    check_batches(steps)
    assert CountEnv.made and all(opts == {"turns": 3} for opts in CountEnv.made)
    assert all(s.num_turns == 3 and s.reward == 3.0 for st in steps for s in st.samples)
    loop_thread = threading.current_thread().name
    assert CountEnv.threads and loop_thread not in CountEnv.threads
    assert all(t.startswith("rollart-local") for t in CountEnv.threads)


async def test_a_slow_sync_local_reward_does_not_block_the_loop() -> None:
    entered, release, outcomes, threads = threading.Event(), threading.Event(), [], []

    def slow_reward(prompt, response, reference, metadata):
        threads.append(threading.current_thread().name)
        entered.set()
        # Released by a coroutine on the event loop: were this call on the loop, nothing could
        # release it and the wait would time out (False).
        outcomes.append(release.wait(30))
        return float(metadata["env_return"])

    async def releaser() -> None:
        while True:
            if entered.is_set():
                release.set()
            await asyncio.sleep(0.01)

    cluster = Cluster.from_scenario(scenario(reward="slow", reward_url="local"),
                                    backends=backends())
    cluster.register_reward("slow", slow_reward)
    task = asyncio.create_task(releaser())
    try:
        async with cluster as c:
            steps = await run_steps(c, 1, timeout_s=120)
    finally:
        task.cancel()
    check_batches(steps)
    assert outcomes and all(outcomes)
    assert threading.current_thread().name not in threads


async def test_hung_in_process_env_times_out_and_the_run_goes_on() -> None:
    CountEnv.threads, CountEnv.made = [], []
    hang = threading.Event()
    first = []

    def factory(turns: int = 2) -> CountEnv:
        first.append(True)
        return CountEnv(turns, hang if len(first) == 1 else None)

    # The instant fake trainer trains hundreds of steps while the env hangs 10 s: the hung
    # member's siblings go stale and are replaced far more than max_group_attempts allows by
    # default, which would drop its group (cancelling it) before its timeout is seen.
    sc = scenario(env="local_count", reward="env_return", reward_url="local", env_timeout_s=10.0,
                  max_group_attempts=1_000_000)
    cluster = Cluster.from_scenario(sc, backends=backends())
    cluster.register_env("local_count", factory)
    try:
        async with cluster as c:
            steps = await run_past_failure(c)
    finally:
        hang.set()
    check_batches(steps)
    assert failed(steps) == {"env_timeout": 1}
    assert all(s.reward == 2.0 for st in steps for s in st.samples)


async def test_hung_local_reward_times_out_and_the_run_goes_on() -> None:
    hang, calls = threading.Event(), []

    def reward(prompt, response, reference, metadata):
        calls.append(1)
        if len(calls) == 1:
            hang.wait(300)
        return float(metadata["env_return"])

    # Generous: only the hung call may reach the deadline, also on a loaded machine where
    # a thread waits long for the GIL (0.5 s failed once beside the integration suite).
    # (max_group_attempts: see test_hung_in_process_env_times_out_and_the_run_goes_on)
    sc = scenario(reward="r", reward_url="local", local_reward_timeout_s=10.0,
                  max_group_attempts=1_000_000)
    cluster = Cluster.from_scenario(sc, backends=backends())
    cluster.register_reward("r", reward)
    try:
        async with cluster as c:
            steps = await run_past_failure(c)
    finally:
        hang.set()
    check_batches(steps)
    assert failed(steps) == {"reward_error": 1}


# ---------------------------------------------------------------------- deadlines, watchdog
@pytest.mark.looptime
async def test_trajectory_wall_clock_deadline() -> None:
    # Session 0 takes 10,000 s per step; every env call is within env_timeout_s = 1e6.
    env = FakeEnvHost(turns=2, latency=lambda i, s: 10_000.0 if i == 0 else 1.0)
    # (max_group_attempts: see test_hung_in_process_env_times_out_and_the_run_goes_on)
    sc = scenario(trajectory_timeout_s=100.0, env_timeout_s=1e6, max_group_attempts=1_000_000)
    async with Cluster.from_scenario(sc, backends=backends(env)) as c:
        steps = await run_past_failure(c)
    check_batches(steps)
    assert failed(steps) == {"trajectory_timeout": 1}
    assert "s0" in env.closed  # its env session was closed


@pytest.mark.looptime
async def test_stall_watchdog_names_what_the_batch_waits_on(caplog) -> None:
    env = FakeEnvHost(turns=1, latency=lambda i, s: 100.0)
    sc = scenario(stall_log_s=30.0, env_timeout_s=1e6)
    caplog.set_level(logging.WARNING, logger="rollart.controller.observe.stall")
    async with Cluster.from_scenario(sc, backends=backends(env)) as c:
        steps = await run_steps(c, 1)
    check_batches(steps)
    reports = [r.getMessage() for r in caplog.records if "no batch for" in r.getMessage()]
    # logged under the watchdog's own module, which log configurations can key on
    assert {r.name for r in caplog.records if "no batch for" in r.getMessage()} == {
        "rollart.controller.observe.stall"}
    assert len(reports) >= 3  # at ~30, 60 and 90 s, then the batch came at ~100 s
    first = reports[0]
    assert "no batch for 30 s at version 0: 0/4 samples ready" in first
    assert "group g0 (d): 0/2 kept" in first
    assert "env step 0 for 30 s" in first


# ---------------------------------------------------------------------- invalid actions
class InvalidOnceEnv(FakeEnvHost):
    """Like FakeEnvHost, but step 0 of even sessions is rejected as an invalid action (as an
    env host replies: ``EnvError("invalid_action")``, the session stays open)."""

    async def step(self, session_id, action, *, timeout_s=None):
        s = self.sessions[session_id]
        if s.index % 2 == 0 and s.steps == 0 and not getattr(s, "rejected", False):
            self.rejected = getattr(self, "rejected", 0) + 1
            s.steps = -1  # one extra step: the rejected one did not count
            raise EnvError("invalid_action", "step 0: broken tool-call JSON at char 3")
        if s.steps < 0:
            s.steps = 0
        return await super().step(session_id, action, timeout_s=timeout_s)


@pytest.mark.looptime
async def test_invalid_action_observe_is_trained_on_with_the_error_as_observation() -> None:
    env, worker = InvalidOnceEnv(turns=2), FakeWorker("w1")
    async with Cluster.from_scenario(scenario(), backends=backends(env, worker=worker)) as c:
        steps = await run_steps(c, 2)
    check_batches(steps)
    assert failed(steps) == {}
    assert sum(st.metrics.num_invalid_actions for st in steps) >= 2
    invalid = [s for st in steps for s in st.samples if s.metadata["num_invalid_actions"]]
    assert invalid and all(s.num_turns == 3 for s in invalid)  # the rejected turn + 2
    # The model saw the env's message as the next observation.
    assert any("broken tool-call JSON" in TOK.decode(p) for p in worker.prompts)


@pytest.mark.looptime
async def test_invalid_action_penalty_ends_with_the_configured_reward() -> None:
    env, reward = InvalidOnceEnv(turns=2), FakeReward()
    sc = scenario(domain={"invalid_action": "penalty", "invalid_action_penalty": -0.5})
    async with Cluster.from_scenario(sc, backends=backends(env, reward)) as c:
        steps = await run_steps(c, 2)
    check_batches(steps)
    assert failed(steps) == {}
    penalised = [s for st in steps for s in st.samples if s.finish_reason == "invalid_action"]
    assert penalised and all(s.reward == -0.5 for s in penalised)
    assert all(s.reward == 2.0 for st in steps for s in st.samples
               if s.finish_reason != "invalid_action")
    # The reward function never scored a penalised trajectory.
    assert reward.calls
    assert all(c["metadata"]["finish_reason"] != "invalid_action" for c in reward.calls)


@pytest.mark.looptime
async def test_invalid_action_fail_is_a_counted_retried_failure() -> None:
    env = InvalidOnceEnv(turns=2)
    sc = scenario(domain={"invalid_action": "fail"})
    async with Cluster.from_scenario(sc, backends=backends(env)) as c:
        steps = await run_past_failure(c)
    check_batches(steps)
    assert failed(steps).get("invalid_action", 0) >= 1
    assert sum(st.metrics.num_retries for st in steps) >= 1


# ---------------------------------------------------------------------- group budget, cancels
class FailSeedEnv(FakeEnvHost):
    """Every step of the first group's seed fails (an always-failing prompt)."""

    bad_seed: int | None = None

    async def step(self, session_id, action, *, timeout_s=None):
        s = self.sessions[session_id]
        if self.bad_seed is None:
            self.bad_seed = s.seed
        if s.seed == self.bad_seed:
            raise EnvError("env_error", f"seed {s.seed} always fails")
        return await super().step(session_id, action, timeout_s=timeout_s)


@pytest.mark.looptime
async def test_failure_budget_drops_an_always_failing_group(caplog) -> None:
    env = FailSeedEnv(turns=1, latency=lambda i, s: 1.0)
    sc = scenario(retry={"max_attempts": 100, "max_failures_per_group": 3})
    caplog.set_level(logging.WARNING, logger="rollart.controller.rollout.tasks")
    async with Cluster.from_scenario(sc, backends=backends(env)) as c:
        steps = await run_past_failure(c)
    check_batches(steps)
    dropped = {}
    for st in steps:
        for k, v in st.metrics.groups_dropped_by_reason.items():
            dropped[k] = dropped.get(k, 0) + v
    assert dropped == {"failure_budget": 1}
    assert failed(steps) == {"env_error": 3}
    assert any("group g0 dropped: 3 failures" in r.getMessage()
               and r.name == "rollart.controller.rollout.tasks" for r in caplog.records)
    assert all(s.group_key != "g0" for st in steps for s in st.samples)


class CancelOnceEnv(FakeEnvHost):
    """Session 0's first step raises CancelledError from inside env code."""

    async def step(self, session_id, action, *, timeout_s=None):
        s = self.sessions[session_id]
        if s.index == 0 and s.steps == 0:
            raise asyncio.CancelledError()
        return await super().step(session_id, action, timeout_s=timeout_s)


@pytest.mark.looptime
async def test_unrequested_cancelled_error_is_a_counted_retried_failure(caplog) -> None:
    env = CancelOnceEnv(turns=2)
    caplog.set_level(logging.WARNING, logger="rollart.controller.rollout.tasks")
    async with Cluster.from_scenario(scenario(), backends=backends(env)) as c:
        steps = await run_past_failure(c)
    check_batches(steps)
    assert failed(steps) == {"unrequested_cancel": 1}
    assert sum(st.metrics.num_retries for st in steps) == 1
    assert all(st.metrics.groups_dropped_by_reason == {} for st in steps)
    # The retried slot completed: group g0 was trained, not retired.
    assert any(s.group_key == "g0" for st in steps for s in st.samples)
    assert any("CancelledError raised inside it" in r.getMessage() for r in caplog.records)


async def test_unrequested_cancel_in_in_process_code_is_an_env_error() -> None:
    def factory() -> Any:
        class Env(CountEnv):
            def step(self, action):
                if not made:
                    made.append(1)
                    raise asyncio.CancelledError()
                return super().step(action)
        return Env()

    made: list[int] = []
    sc = scenario(env="local_count", reward="env_return", reward_url="local")
    cluster = Cluster.from_scenario(sc, backends=backends())
    cluster.register_env("local_count", factory)
    async with cluster as c:
        steps = await run_past_failure(c)
    check_batches(steps)
    assert failed(steps) == {"env_error": 1}


@pytest.mark.looptime
async def test_oversized_reward_reply_is_its_own_failure_reason() -> None:
    calls = []

    class FakeBigReward(FakeReward):
        async def score(self, name, prompt, response, reference=None, metadata=None):
            calls.append(1)
            if len(calls) == 1:
                raise RewardTooLargeError("reward 'fake': reply body exceeds max_reply_bytes", 200)
            return await super().score(name, prompt, response, reference, metadata)

    async with Cluster.from_scenario(scenario(), backends=backends(reward=FakeBigReward())) as c:
        steps = await run_past_failure(c)
    check_batches(steps)
    assert failed(steps) == {"reward_too_large": 1}


async def test_in_process_env_raising_invalid_action_is_observed_not_failed() -> None:
    class Env(CountEnv):
        def step(self, action):
            if self.steps == 0 and not getattr(self, "rejected", False):
                self.rejected = True
                raise InvalidActionError("expected JSON, got 'ok'")
            return super().step(action)

    worker = FakeWorker("w1")
    sc = scenario(env="local_count", reward="env_return", reward_url="local")
    cluster = Cluster.from_scenario(sc, backends=backends(worker=worker))
    cluster.register_env("local_count", Env)
    async with cluster as c:
        steps = await run_steps(c, 1, timeout_s=120)
    check_batches(steps)
    assert failed(steps) == {}
    assert all(s.metadata["num_invalid_actions"] == 1 and s.num_turns == 3
               for st in steps for s in st.samples)
    assert any("expected JSON, got 'ok'" in TOK.decode(p) for p in worker.prompts)


async def test_oversized_local_reward_details_fail_the_trajectory() -> None:
    calls: list[int] = []

    def reward(prompt, response, reference, metadata):
        calls.append(1)
        blob = "x" * (1 << 20) if len(calls) == 1 else ""
        return float(metadata["env_return"]), {"blob": blob}

    cluster = Cluster.from_scenario(scenario(reward="r", reward_url="local"), backends=backends())
    cluster.register_reward("r", reward)
    async with cluster as c:
        steps = await run_past_failure(c)
    check_batches(steps)
    assert failed(steps) == {"reward_too_large": 1}
    assert all(len(s.metadata["reward_details"]["blob"]) == 0 for st in steps for s in st.samples)


@pytest.mark.parametrize("bad", [(1.0, {}, 3), (1.0, "details"), None])
async def test_a_local_reward_returning_garbage_fails_the_trajectory_not_the_run(bad) -> None:
    calls: list[int] = []

    def reward(prompt, response, reference, metadata):
        calls.append(1)
        if len(calls) == 1:
            return bad
        # what the reward service accepts is accepted in-process too
        return [np.float32(metadata["env_return"]), None]

    cluster = Cluster.from_scenario(scenario(reward="r", reward_url="local"), backends=backends())
    cluster.register_reward("r", reward)
    async with cluster as c:
        steps = await run_past_failure(c)
    check_batches(steps)
    assert failed(steps) == {"reward_error": 1}


@pytest.mark.parametrize("bad", [("obs", float("nan"), True, False, {}), ("obs", 1.0), "obs"])
async def test_an_in_process_env_breaking_the_contract_fails_its_session_not_the_run(bad) -> None:
    lock, done = threading.Lock(), []

    def first(kind: str) -> bool:  # the first reset (bad reset) or step (bad step) only
        with lock:
            if done or kind != ("reset" if isinstance(bad, str) else "step"):
                return False
            done.append(kind)
            return True

    class BadOnce(CountEnv):
        def reset(self, seed: int):
            return bad if first("reset") else super().reset(seed)

        def step(self, action: str):
            return bad if first("step") else super().step(action)

    cluster = Cluster.from_scenario(scenario(env="bad"), backends=backends())
    cluster.register_env("bad", BadOnce)
    async with cluster as c:
        steps = await run_past_failure(c)
    check_batches(steps)
    assert failed(steps) == {"env_error": 1}


@pytest.mark.looptime
async def test_group_out_of_attempts_is_dropped_with_a_reason_and_a_warning(caplog) -> None:
    env = FailSeedEnv(turns=1, latency=lambda i, s: 1.0)
    sc = scenario(retry={"max_attempts": 2})
    caplog.set_level(logging.WARNING, logger="rollart.controller.rollout.tasks")
    async with Cluster.from_scenario(sc, backends=backends(env)) as c:
        steps = await run_past_failure(c)
        steps += await run_steps(c, 2)
        assert c.controller is not None
        # The failure that ended the group leaves no counter behind for it.
        assert "g0" not in c.controller.tasks.counted_groups()
    check_batches(steps)
    dropped: dict[str, int] = {}
    for st in steps:
        for k, v in st.metrics.groups_dropped_by_reason.items():
            dropped[k] = dropped.get(k, 0) + v
    assert dropped == {"attempts_exhausted": 1}
    assert any("group g0 dropped: a member failed run.retry.max_attempts = 2 times"
               in r.getMessage() for r in caplog.records)
    assert all(s.group_key != "g0" for st in steps for s in st.samples)


# ------------------------------------------------------------------ prefix resends (issue 11)
@pytest.mark.looptime
async def test_step_metrics_count_turns_resent_whole_after_a_prefix_miss() -> None:
    # A worker whose prefix store holds nothing (max_prefix_tokens=1: no prompt fits) refuses
    # every later turn with prefix_unknown; each is sent again whole, and the step says so.
    forgetful = FakeWorker("w1", max_prefix_tokens=1)
    async with Cluster.from_scenario(scenario(), backends=backends(worker=forgetful)) as c:
        steps = await run_steps(c, 2)
    check_batches(steps)
    assert failed(steps) == {}
    resends = sum(st.metrics.num_prefix_resends for st in steps)
    assert resends > 0
    # every refused turn is counted once, in the step it happened in (turns still running at
    # the end of the last step were refused after it)
    assert resends <= len(forgetful.prefix_misses)
    assert all(r.prefix_len == 0 for r in forgetful.requests)

    holding = FakeWorker("w1")
    async with Cluster.from_scenario(scenario(), backends=backends(worker=holding)) as c:
        steps = await run_steps(c, 2)
    assert sum(st.metrics.num_prefix_resends for st in steps) == 0 == len(holding.prefix_misses)


class PeakWorker(FakeWorker):
    """FakeWorker that records the most requests it ever had at once."""

    peak = 0

    async def generate(self, request, *, timeout_s=None):
        self.peak = max(self.peak, self.in_flight + 1)
        return await super().generate(request, timeout_s=timeout_s)


@pytest.mark.looptime
async def test_a_run_sends_each_worker_at_most_its_send_window() -> None:
    # run.max_generate_in_flight reaches the proxy; the rest wait, and the step says how many.
    worker = PeakWorker("w1", latency_s=0.5)
    async with Cluster.from_scenario(scenario(max_generate_in_flight=2),
                                     backends=backends(worker=worker)) as c:
        steps = await run_steps(c, 2)
    check_batches(steps)
    assert failed(steps) == {}
    assert worker.peak == 2
    assert sum(st.metrics.num_window_waits for st in steps) > 0


async def test_trajectories_shut_down_before_their_first_step_leave_the_buffer() -> None:
    # close() cancels a trajectory task that has not run yet: run_one's handler never runs,
    # so the done callback must tell the buffer (it kept counting it as running).
    from helpers.fakes import make_scenario
    from rollart.controller.controller import Controller
    from rollart.controller.routing.proxy import LLMProxy
    from rollart.controller.routing.routers import EnvRouter, RewardRouter

    sc = make_scenario(alpha=1, batch_size=4, group_size=2)

    def controller(env: FakeEnvHost) -> Controller:
        proxy = LLMProxy({"p1": ("cpu", [FakeWorker("w1")]), "p2": ("cpu", [FakeWorker("w2")])},
                         {"game": "p1", "math": "p2"})
        return Controller(sc, proxy=proxy, envs=EnvRouter([env]),
                          rewards=RewardRouter(service=FakeReward()), trainer=FakeTrainer(),
                          tokenizer=TOK)

    ctl = controller(FakeEnvHost(turns=2))
    await ctl.start()
    for _ in range(100):  # until admission has launched tasks that have not run yet
        if ctl.num_running:
            break
        await asyncio.sleep(0)
    assert ctl.num_running > 0 and ctl.buffer.stats().running == ctl.num_running
    await ctl.close()
    stats = ctl.buffer.stats()
    assert stats.running == 0 and ctl.num_running == 0
    assert stats.generated_tokens == stats.trained_tokens + sum(stats.wasted_tokens.values()) \
        + stats.in_flight_tokens
    # every trajectory ended once: the shutdown path added no late (duplicate) buffer call
    assert stats.late_calls == 0

    # trajectories cancelled mid-flight (their handler ran) are not cancelled a second time
    env = FakeEnvHost(turns=2, latency=lambda i, s: 1000.0)
    ctl = controller(env)
    await ctl.start()
    for _ in range(10_000):  # until every admitted trajectory waits in its first env step
        if ctl.num_running and env.steps_started >= ctl.num_running:
            break
        await asyncio.sleep(0)
    assert env.steps_started >= ctl.num_running > 0
    await ctl.close()
    stats = ctl.buffer.stats()
    assert stats.running == 0 and stats.late_calls == 0


class SlowCloseEnvHost(FakeEnvHost):
    """A host whose session close takes ``close_s`` seconds; counts closes in progress."""

    def __init__(self, close_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.close_s, self.closing = close_s, 0
        self.close_started = asyncio.Event()

    async def close_session(self, session_id) -> None:
        self.closing += 1
        self.close_started.set()
        try:
            await asyncio.sleep(self.close_s)
            await super().close_session(session_id)
        finally:
            self.closing -= 1


@pytest.mark.looptime
async def test_close_waits_for_env_sessions_still_closing() -> None:
    # A trajectory cancelled by close() while it closes its env session (here: it failed its
    # step) ends at once, its shielded close going on. close() must wait for that close: its
    # owner closes the env clients next, and a close cut off there logged a "closing env
    # session ... failed: client closed" warning per session (test_run_faults saw them).
    from helpers.fakes import make_scenario
    from rollart.controller.controller import Controller
    from rollart.controller.routing.proxy import LLMProxy
    from rollart.controller.routing.routers import EnvRouter, RewardRouter

    env = SlowCloseEnvHost(5.0, turns=2, fail=lambda i, s: True)
    proxy = LLMProxy({"p1": ("cpu", [FakeWorker("w1")]), "p2": ("cpu", [FakeWorker("w2")])},
                     {"game": "p1", "math": "p2"})
    ctl = Controller(make_scenario(alpha=1, batch_size=4, group_size=2), proxy=proxy,
                     envs=EnvRouter([env]), rewards=RewardRouter(service=FakeReward()),
                     trainer=FakeTrainer(), tokenizer=TOK)
    # (and stop_soon, which the launcher calls on a fatal process exit, quiets the proxy's
    # removal of dead workers: test_proxy's ..._is_not_reported_again)
    assert not proxy.stopping
    ctl.stop_soon()
    assert proxy.stopping
    await ctl.start()
    await asyncio.wait_for(env.close_started.wait(), 60)
    assert env.closing
    await ctl.close()
    assert env.closing == 0 and env.closed
    assert set(env.closed) == set(env.opened)
