"""``SimReward`` seeds its per-call generator only when a draw needs it (a constant latency and
no failure injection draw nothing), with the same rewards; ``Dist.draws`` says which is which."""

from __future__ import annotations

import asyncio
import random

import pytest

from rollart.sim.env import SimReward
from rollart.sim.workload import Dist, const, counter_rng, seeded_rng
from rollart.transport.errors import RewardError


def test_dist_draws_and_sample_without_a_generator() -> None:
    assert not const(2.0).draws and not Dist("normal", 1.0, 0.0).draws
    assert Dist("lognormal", 1.0, 0.5).draws
    assert Dist("const", 5.0, 0.0, 0.0, 3.0).sample(None) == 3.0  # still clipped
    with pytest.raises(ValueError, match="needs a random generator"):
        Dist("uniform", 1.0, 0.5).sample(None)


@pytest.mark.parametrize("factory", [seeded_rng, counter_rng])
def test_one_seeding_per_call_when_nothing_is_drawn_same_rewards(factory) -> None:
    made: list[tuple] = []

    def counting(*parts: object) -> random.Random:
        made.append(parts)
        return factory(*parts)

    reward = SimReward(seed=4, rng=counting)
    pairs = [(f"p{i}", f"r{i}") for i in range(20)]
    got = [asyncio.run(reward.score("sim", p, r)).reward for p, r in pairs]
    assert got == [float(factory(4, p, r).random() < 0.5) for p, r in pairs]
    assert made == [(4, p, r) for p, r in pairs]  # the reward's own draw only


def test_failures_and_latency_still_draw_from_the_call_generator() -> None:
    reward = SimReward(failure_prob=1.0, rng=counter_rng)
    with pytest.raises(RewardError, match="injected failure"):
        asyncio.run(reward.score("sim", "p", "r"))
    made: list[tuple] = []

    def counting(*parts: object) -> random.Random:
        made.append(parts)
        return counter_rng(*parts)

    jittered = SimReward(latency_s=Dist("uniform", 1e-4, 1e-5), rng=counting)
    asyncio.run(jittered.score("sim", "p", "r"))
    assert made == [(0, "sim", "p", "r", 0), (0, "p", "r")]
