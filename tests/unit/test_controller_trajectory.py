"""Trajectory coroutine: exact token bookkeeping, truncation, failures, cancellation."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from helpers.fakes import TOK, FakeEnvHost, FakeReward, FakeWorker, make_scenario
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.rollout.tokens import ChatTokens
from rollart.controller.rollout.trajectory import (
    TrajectoryContext,
    TrajectoryFailed,
    TrajectoryStale,
    run_trajectory,
)
from rollart.controller.routing.proxy import LLMProxy
from rollart.controller.routing.routers import EnvRouter, RewardRouter
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError


def make_ctx(worker: FakeWorker, env: FakeEnvHost, reward: FakeReward | None = None, **run):
    scenario = make_scenario(**run)
    proxy = LLMProxy({"p1": ("cpu", [worker]), "p2": ("cpu", [FakeWorker("w2")])},
                     {"game": "p1", "math": "p1"})
    buffer = SampleBuffer(alpha=scenario.run.alpha, batch_size=scenario.run.batch_size,
                          group_size=scenario.run.group_size)
    chat = ChatTokens(TOK)
    ctx = TrajectoryContext(
        run=scenario.run, proxy=proxy, envs=EnvRouter([env]),
        rewards=RewardRouter(reward or FakeReward()), chat={"game": chat, "math": chat},
        buffer=buffer, clock=lambda: 0.0, wait_for_weights=lambda v: asyncio.sleep(0),
    )
    domains = {d.name: d for d in scenario.domains}
    return ctx, buffer, domains


def chatml(*turns: tuple[str, str], gen: bool = True) -> str:
    text = "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns)
    return text + ("<|im_start|>assistant\n" if gen else "")


async def test_token_bookkeeping_is_exact() -> None:
    worker = FakeWorker("w1", lambda req: "ok")
    env = FakeEnvHost(turns=2)
    ctx, buffer, domains = make_ctx(worker, env)
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=7)

    prompt = TOK.encode(chatml(("user", "start 7")))
    gen = [*TOK.encode("ok"), TOK.eos_token_id]
    obs = TOK.encode("\n" + chatml(("user", "obs 1")))
    assert sample.token_ids.tolist() == prompt + gen + obs + gen
    assert sample.loss_mask.tolist() == [0] * len(prompt) + [1] * 3 + [0] * len(obs) + [1] * 3
    # Per generated token only (6 of them); the per-token form puts them in place.
    assert sample.behaviour_logprobs.tolist() == [-0.5] * 6
    assert sample.versions.tolist() == [0] * 6
    assert sample.full_behaviour_logprobs().tolist() == (
        [0.0] * len(prompt) + [-0.5] * 3 + [0.0] * len(obs) + [-0.5] * 3
    )
    assert sample.full_versions().tolist() == (
        [-1] * len(prompt) + [0] * 3 + [-1] * len(obs) + [0] * 3)
    # The same as tokenising the whole conversation (for this tokenizer), minus the final "\n".
    whole = chatml(("user", "start 7"), ("assistant", "ok"), ("user", "obs 1"), ("assistant", "ok"),
                   gen=False)
    assert sample.token_ids.tolist() == TOK.encode(whole)[:-1]
    # Turn 2's prompt is exactly the sequence so far: nothing was re-tokenised...
    assert worker.prompts[1] == prompt + gen + obs
    # ...and only the observation travelled: the worker held the prompt and its own tokens.
    second = worker.requests[1]
    assert second.prefix_len == len(prompt + gen) and second.trajectory_id == tid
    assert tb.view_i32(second.new_token_ids).tolist() == obs
    assert sample.reward == 2.0 and sample.num_turns == 2
    assert sample.finish_reason == "terminated"
    assert env.closed == env.opened  # session closed after success


async def test_engine_token_ids_are_kept_not_retokenised() -> None:
    # "<|pad|>" decodes to nothing: re-tokenising the action text would lose token id 0.
    worker = FakeWorker("w1", lambda req: "o<|pad|>k")
    ctx, buffer, domains = make_ctx(worker, FakeEnvHost(turns=1))
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    gen = sample.token_ids[-4:].tolist()
    assert gen == [16 + ord("o"), 0, 16 + ord("k"), TOK.eos_token_id]
    assert ctx.rewards.service.calls[0]["response"] == "ok"


async def test_truncation_comes_from_finish_reason_length() -> None:
    env = FakeEnvHost(turns=5)
    worker = FakeWorker("w1", lambda req: "x" * 40)
    ctx, buffer, domains = make_ctx(worker, env, max_tokens_per_turn=16)
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    assert sample.finish_reason == "length"
    assert sample.num_turns == 1 and env.steps_done == 1  # the env still judged the action
    assert sum(sample.loss_mask) == 16
    assert sample.token_ids[-1] != TOK.eos_token_id


async def test_stop_without_eos_closes_the_turn_with_an_unmasked_eos() -> None:
    worker = FakeWorker("w1", lambda req: "ok", add_eos=False)
    ctx, buffer, domains = make_ctx(worker, FakeEnvHost(turns=2))
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    mask = sample.loss_mask.tolist()
    first_gen_end = mask.index(0, mask.index(1))
    assert sample.token_ids[first_gen_end] == TOK.eos_token_id
    assert sample.loss_mask[first_gen_end] == 0
    assert sample.finish_reason == "terminated"


async def test_trajectory_token_budget() -> None:
    worker = FakeWorker("w1", lambda req: "ok")
    ctx, buffer, domains = make_ctx(worker, FakeEnvHost(turns=50), max_turns=50,
                                    max_tokens_per_trajectory=60)
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    assert sample.finish_reason == "max_tokens"
    assert len(sample.token_ids) <= 60
    assert all(r.sampling.max_tokens <= 60 - len(p)
               for r, p in zip(worker.requests, worker.prompts, strict=True))


async def test_prompt_longer_than_the_budget_fails_instead_of_an_empty_sample() -> None:
    ctx, buffer, domains = make_ctx(FakeWorker("w1"), FakeEnvHost(), max_tokens_per_turn=8,
                                    max_tokens_per_trajectory=10)
    (tid, *_) = buffer.try_start_group("g0")
    with pytest.raises(TrajectoryFailed) as info:
        await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    assert info.value.reason == "prompt_too_long"


async def test_max_turns() -> None:
    ctx, buffer, domains = make_ctx(FakeWorker("w1"), FakeEnvHost(turns=50), max_turns=3)
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    assert sample.finish_reason == "max_turns" and sample.num_turns == 3


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("env", "env_error"),
        ("reward", "reward_error"),
        ("generate", "generation_error"),
    ],
)
async def test_failures_have_reasons_and_no_reward(setup: str, reason: str) -> None:
    env = FakeEnvHost(turns=2, fail=lambda index, step: setup == "env")
    reward = FakeReward(fail=lambda md: setup == "reward")
    worker = FakeWorker(
        "w1", lambda req: RemoteError("engine_error", "boom") if setup == "generate" else "ok"
    )
    ctx, buffer, domains = make_ctx(worker, env, reward)
    (tid, *_) = buffer.try_start_group("g0")
    with pytest.raises(TrajectoryFailed) as info:
        await run_trajectory(ctx, tid, "g0", domains["math"], seed=3)
    assert info.value.reason == reason
    assert env.closed == env.opened  # the session is released on failure too
    if setup != "reward":
        assert reward.calls == []  # never scored


async def test_cancellation_aborts_generation_and_closes_session() -> None:
    worker = FakeWorker("w1", latency_s=30.0)
    env = FakeEnvHost(turns=2)
    ctx, buffer, domains = make_ctx(worker, env)
    (tid, *_) = buffer.try_start_group("g0")
    task = asyncio.create_task(run_trajectory(ctx, tid, "g0", domains["math"], seed=1))
    for _ in range(20):
        await asyncio.sleep(0)
    assert worker.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert worker.aborted == [f"{tid}/t0"]
    assert env.closed == env.opened and len(env.opened) == 1


async def test_stale_verdict_raises_restart_and_closes_session() -> None:
    env = FakeEnvHost(turns=3)
    ctx, _, domains = make_ctx(FakeWorker("w1"), env)
    ctx.buffer = _StaleBuffer()
    with pytest.raises(TrajectoryStale):
        await run_trajectory(ctx, "t", "g", domains["math"], seed=1)
    assert ctx.buffer.turns == 2 and env.closed == env.opened


class _StaleBuffer:
    """Says "restart" at the second turn (as a buffer at a newer version would)."""

    def __init__(self) -> None:
        self.turns = 0

    def begin_turn(self, tid, version):
        self.turns += 1
        return "continue" if self.turns == 1 else "restart"

    def record_tokens(self, tid, versions):
        pass


class HostClosingEnv(FakeEnvHost):
    """Closes a session on its host with the step that ends its episode (``closed=True``),
    as env hosts do; ``close_calls`` counts explicit closes it is still sent."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.close_calls = 0

    async def step(self, session_id, action, *, timeout_s=None):
        result = await super().step(session_id, action, timeout_s=timeout_s)
        if result.terminated:
            self.sessions.pop(session_id)
            result = msgspec.structs.replace(result, closed=True)
        return result

    async def close_session(self, session_id) -> None:
        self.close_calls += 1
        await super().close_session(session_id)


async def test_a_session_its_host_closed_is_not_closed_again() -> None:
    # Issue 11: the shielded close (a task, a timeout and a coroutine per trajectory) ran for
    # every trajectory, though most episodes end with the step that closed the session.
    env = HostClosingEnv(turns=2)
    ctx, buffer, domains = make_ctx(FakeWorker("w1", lambda req: "ok"), env)
    closes: list[str] = []
    router_close = ctx.envs.close_session

    async def counted(session_id: str) -> None:
        closes.append(session_id)
        await router_close(session_id)

    ctx.envs.close_session = counted
    (tid, *_) = buffer.try_start_group("g0")
    sample = await run_trajectory(ctx, tid, "g0", domains["math"], seed=7)
    assert sample.finish_reason == "terminated" and sample.num_turns == 2
    assert closes == [] and env.close_calls == 0 and not ctx.envs.is_open(env.opened[0])
    # a trajectory that ends with its session still open (max_turns) still closes it
    ctx2, buffer2, domains2 = make_ctx(FakeWorker("w1", lambda req: "ok"), env, max_turns=1)
    (tid2, *_) = buffer2.try_start_group("g1")
    sample2 = await run_trajectory(ctx2, tid2, "g1", domains2["math"], seed=8)
    assert sample2.finish_reason == "max_turns" and env.close_calls == 1
    assert env.closed == [env.opened[1]]


@pytest.mark.parametrize("fail_on_turn", [None, 1])
async def test_only_a_trajectory_that_ended_its_turns_reports_a_final_footprint(
        fail_on_turn: int | None) -> None:
    """The proxy is told whether the trajectory finished its turns: a second turn that fails
    leaves a partial footprint, which must not count in the KV working set's domain mean."""
    calls: list[m.Generate] = []

    def respond(req: m.Generate):
        calls.append(req)
        if len(calls) - 1 == fail_on_turn:
            return RemoteError("engine_error", "boom")
        return "ok"

    ctx, buffer, domains = make_ctx(FakeWorker("w1", respond), FakeEnvHost(turns=2))
    released: list[tuple[str, bool]] = []
    release = ctx.proxy.release
    ctx.proxy.release = lambda tid, *, finished=True: (  # type: ignore[method-assign]
        released.append((tid, finished)), release(tid, finished=finished))[-1]
    (tid, *_) = buffer.try_start_group("g0")
    if fail_on_turn is None:
        await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    else:
        with pytest.raises(TrajectoryFailed):
            await run_trajectory(ctx, tid, "g0", domains["math"], seed=1)
    assert released == [(tid, fail_on_turn is None)]
