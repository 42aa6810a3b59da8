"""Latency / failure injection: validation, determinism, distribution moments."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from rollart.envhost.latency import LatencyConfig, LatencyModel, select_latency


def draws(config: LatencyConfig, n: int = 4000) -> np.ndarray:
    model = LatencyModel(config)
    return np.array([model.draw(f"s{i % 50}", i // 50)[0] for i in range(n)])


def test_draws_are_pure_functions_of_seed_session_step():
    cfg = LatencyConfig(distribution="normal", mean_s=10.0, std_s=3.0, failure_rate=0.3, seed=7)
    a, b = LatencyModel(cfg), LatencyModel(cfg)
    seq = [a.draw("host-1", k) for k in range(20)]
    # same arguments in another order / another model instance give the same values
    assert [b.draw("host-1", k) for k in reversed(range(20))][::-1] == seq
    assert [a.draw("host-2", k) for k in range(20)] != seq
    other_seed = LatencyModel(msgspec.structs.replace(cfg, seed=8))
    assert [other_seed.draw("host-1", k) for k in range(20)] != seq


@pytest.mark.parametrize(
    ("config", "mean", "std"),
    [
        (LatencyConfig(distribution="normal", mean_s=10.0, std_s=1.0), 10.0, 1.0),
        (LatencyConfig(distribution="lognormal", mean_s=10.0, std_s=10.0), 10.0, 10.0),
        (LatencyConfig(distribution="exponential", mean_s=2.0), 2.0, 2.0),
    ],
)
def test_distribution_moments(config, mean, std):
    x = draws(config)
    # 4000 draws: standard error of the mean = std / 63; allow ~5 standard errors
    assert abs(x.mean() - mean) < 5 * std / math.sqrt(len(x))
    assert abs(x.std() - std) < 0.2 * std


def test_clipping_to_min_and_max():
    x = draws(LatencyConfig(distribution="normal", mean_s=0.5, std_s=2.0, min_s=0.1, max_s=1.0))
    assert x.min() == pytest.approx(0.1) and x.max() == pytest.approx(1.0)
    assert (x >= 0.1).all() and (x <= 1.0).all()


def test_none_has_no_delay_but_can_fail():
    model = LatencyModel(LatencyConfig(failure_rate=0.25, seed=1))
    results = [model.draw("s", k) for k in range(4000)]
    assert all(delay == 0.0 for delay, _ in results)
    rate = sum(fail for _, fail in results) / len(results)
    assert abs(rate - 0.25) < 0.03
    assert not any(LatencyModel(LatencyConfig()).draw("s", k)[1] for k in range(200))


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"distribution": "gamma"}, "Invalid enum value 'gamma'"),
        ({"distribution": "normal", "mean_s": -1.0}, "Expected `float` >= 0.0"),
        ({"failure_rate": 1.5}, "<= 1.0"),
        ({"min_s": 5.0, "max_s": 1.0}, "min_s"),
        ({"mean_s": 1.0}, "distribution 'none' takes no mean_s"),
        ({"distribution": "lognormal"}, "needs mean_s > 0"),
        ({"distribution": "exponential", "mean_s": 1.0, "std_s": 1.0}, "leave std_s at 0"),
        ({"distribution": "normal", "mean": 3.0}, "unknown field `mean`"),
    ],
)
def test_invalid_configs_rejected(raw, fragment):
    with pytest.raises(msgspec.ValidationError, match=fragment):
        msgspec.convert(raw, LatencyConfig)


def test_select_latency_precedence():
    exact = LatencyConfig(distribution="exponential", mean_s=1.0)
    family = LatencyConfig(distribution="normal", mean_s=2.0, std_s=1.0)
    default = LatencyConfig(failure_rate=0.1)
    table = {"game:Sokoban-v0-easy": exact, "game": family, "*": default}
    assert select_latency(table, "game:Sokoban-v0-easy") is exact
    assert select_latency(table, "game:Wordle-v0-easy") is family
    assert select_latency(table, "rg:countdown") is default
    assert select_latency({"game": family}, "rg:countdown") is None
