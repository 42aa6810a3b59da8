"""The staleness_waste benchmark's statistics and policy wiring (the simulation itself is
exercised by ``python -m benchmarks.staleness_waste --quick``)."""

from __future__ import annotations

import math

import msgspec
import pytest
from benchmarks.staleness_waste import LONG, LONG_ALPHA, apply_policy, mean_ci, regimes

from rollart.sim.harness import scenario_of


def test_mean_ci_is_the_95_percent_t_interval() -> None:
    m, half = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert mean_ci([5.0, float("nan")])[0] == 5.0 and math.isnan(mean_ci([5.0])[1])
    assert all(math.isnan(x) for x in mean_ci([]))


def test_only_the_new_policy_changes_the_staleness_options() -> None:
    sims = regimes(quick=True)
    assert set(sims) == {"rollout_bound", "trainer_bound", "long_horizon"}
    today = scenario_of(apply_policy(sims["long_horizon"], "today"), 0)
    new = scenario_of(apply_policy(sims["long_horizon"], "new"), 0)
    assert (today.run.weight_apply, today.run.admission, today.run.domain_mix) == (
        "at_batch", "greedy", "weight")
    assert not today.run.fresh_start and all(d.alpha is None for d in today.domains)
    assert (new.run.weight_apply, new.run.admission, new.run.domain_mix) == (
        "eager", "capacity", "yield")
    assert new.run.fresh_start and new.run.alpha == 1
    assert {d.name: d.alpha for d in new.domains} == {"reasoning": None, LONG: LONG_ALPHA}


def test_new_hold_is_the_new_policy_holding_batches_for_groups() -> None:
    sims = regimes(quick=True)
    new = scenario_of(apply_policy(sims["long_horizon"], "new"), 0)
    hold = scenario_of(apply_policy(sims["long_horizon"], "new_hold"), 0)
    assert not new.run.hold_batch_for_groups and hold.run.hold_batch_for_groups
    assert msgspec.structs.replace(hold.run, hold_batch_for_groups=False) == new.run
    assert hold.domains == new.domains
