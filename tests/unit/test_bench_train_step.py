"""``benchmarks.train_step`` on a model small enough for the unit tests: both paths time the
real ``train_step``, agree on the loss, and the ratio comes with its interval."""

from __future__ import annotations

import math

import pytest
from benchmarks import train_step as bench

from rollart.models.tiny import TinyModelSpec


def test_measure_times_both_paths_on_the_same_batch() -> None:
    spec = TinyModelSpec(seed=0, hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64)
    row, ratios, wall = bench._measure(spec, num_samples=2, num_tokens=12, repeats=3, seed=0)
    assert len(ratios) == len(wall) == 3 and all(r > 0 for r in ratios + wall)
    assert row["lean_cpu_s"] > 0 and row["recompute_cpu_s"] > 0
    assert row["tokens_per_step"] == 24 and row["microbatches"] == 1
    assert row["loss_lean"] == pytest.approx(row["loss_recompute"], rel=1e-5, abs=1e-7)


def test_log_interval_is_the_geometric_mean_with_a_t_interval() -> None:
    mean, lo, hi = bench._log_interval([0.5, 2.0])
    assert mean == pytest.approx(1.0)
    # logs -ln2, ln2: sd = sqrt(2) ln 2, half = 12.706 x sd / sqrt(2) = 12.706 ln 2
    assert lo == pytest.approx(math.exp(-12.706 * math.log(2)))
    assert hi == pytest.approx(math.exp(12.706 * math.log(2)))
    one = bench._log_interval([0.8])
    assert one[0] == pytest.approx(0.8) and math.isnan(one[1]) and math.isnan(one[2])
