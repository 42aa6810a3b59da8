"""The simulator's ablation knobs: dedicated reward GPUs (serialised, utilisation), the push
made at the pause point, the staleness-check override."""

from __future__ import annotations

import asyncio

import pytest

from rollart.sim.clock import run_virtual
from rollart.sim.env import SERVERLESS_REWARD_LATENCY, SimReward
from rollart.sim.harness import SimCluster, SimDomain, SimPool, SimScenario, run_simulated
from rollart.sim.workload import DomainSpec, const


def _scenario(env_s: float = 0.5, **kw) -> SimScenario:
    spec = DomainSpec("tiny", prompt_tokens=const(512), obs_tokens=const(16),
                      response_tokens=const(24), num_turns=const(2),
                      step_latency_s=const(env_s))
    base = dict(pools=(SimPool("h800", "h800", 2, max_batch=64),),
                domains=(SimDomain(spec, "h800"),), model="qwen3-8b", mode="rollart",
                steps=3, batch_size=16, group_size=4, trainer_gpus=1, env_hosts=1,
                max_tokens_per_turn=64, max_tokens_per_trajectory=2048)
    base.update(kw)
    return SimScenario(**base)


def test_dedicated_reward_gpu_serialises_calls_and_counts_busy_time() -> None:
    async def main(reward: SimReward) -> list[float]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def one(i: int) -> float:
            await reward.score("r", f"p{i}", "x")
            return loop.time() - t0

        return list(await asyncio.gather(*(one(i) for i in range(3))))

    dedicated = SimReward(max_concurrency=1, service_s=lambda p, r: 1.0)
    assert sorted(run_virtual(lambda: main(dedicated))) == pytest.approx([1.0, 2.0, 3.0])
    assert dedicated.busy_s == pytest.approx(3.0)
    serverless = SimReward(service_s=lambda p, r: 1.0)
    assert run_virtual(lambda: main(serverless)) == pytest.approx([1.0, 1.0, 1.0])


def test_serverless_latency_follows_the_paper_io() -> None:
    import random

    rng = random.Random(0)
    xs = [SERVERLESS_REWARD_LATENCY.sample(rng) for _ in range(20000)]
    assert 0.01 <= sum(xs) / len(xs) <= 0.02  # paper §7.5: mean 0.01-0.02 s
    assert max(xs) <= 2.1  # and at most ~2 s


def test_dedicated_reward_gpus_report_utilisation_and_slow_nothing_down_when_idle() -> None:
    res = run_simulated(_scenario(reward_gpus=1), seed=1)
    assert 0.0 < res.reward_utilisation < 1.0
    assert run_simulated(_scenario(), seed=1).reward_utilisation == 0.0


def test_push_at_pause_exposes_the_whole_push() -> None:
    # A ~9 s push against ~40 s of rollout and a fast trainer: overlapped, it hides behind the
    # rollout (step 2 onwards; step 1's batch was ready before any push).
    # at_batch (the paper's order): each step's weights go out at its pause, so a blocking
    # push shows whole in every step's exposed sync time
    slow = dict(link_bytes_per_s=2e9, shared_trainer_egress=False, env_s=20.0, trainer_gpus=8,
                steps=4, weight_apply="at_batch")
    over = run_simulated(_scenario(**slow), seed=2)
    blocking = run_simulated(_scenario(push_at_pause=True, **slow), seed=2)
    push = min(blocking.push_times_s)
    exposed = [s["weight_sync_exposed_s"] for s in blocking.steps[2:]]
    assert push > 5.0 and all(e >= push for e in exposed)
    assert all(s["weight_sync_exposed_s"] < 0.2 * push for s in over.steps[2:])


def test_check_override_is_validated_and_applied() -> None:
    async def build(sim: SimScenario) -> str:
        return SimCluster(sim, 0).controller.buffer.check

    assert run_virtual(lambda: build(_scenario(check="admission"))) == "admission"
    assert run_virtual(lambda: build(_scenario())) == "per_turn"
    with pytest.raises(ValueError, match="check"):
        run_virtual(lambda: build(_scenario(check="never")))
