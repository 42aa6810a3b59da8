"""The staleness_waste benchmark's statistics and policy wiring (the simulation itself is
exercised by ``python -m benchmarks.staleness_waste --quick``)."""

from __future__ import annotations

import math

import msgspec
import pytest
from benchmarks.staleness_waste import (
    LONG,
    LONG_ALPHA,
    apply_policy,
    mean_ci,
    measure,
    regimes,
)

from rollart.sim.harness import scenario_of


def test_mean_ci_is_the_95_percent_t_interval() -> None:
    m, half = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert mean_ci([5.0, float("nan")])[0] == 5.0 and math.isnan(mean_ci([5.0])[1])
    assert all(math.isnan(x) for x in mean_ci([]))


def _policy(run) -> tuple:
    return (run.effective_weight_apply, run.effective_fresh_start, run.effective_hold_batch,
            run.admission, run.domain_mix)


def test_lazy_spells_the_previous_policy_and_default_sets_nothing() -> None:
    sims = regimes(quick=True)
    assert set(sims) == {"rollout_bound", "trainer_bound", "long_horizon"}
    lazy = scenario_of(apply_policy(sims["long_horizon"], "lazy"), 0)
    default = scenario_of(apply_policy(sims["long_horizon"], "default"), 0)
    assert _policy(lazy.run) == ("at_batch", False, False, "greedy", "weight")
    assert all(d.alpha is None for d in lazy.domains)
    # the default column is RunConfig's default: no policy field written
    assert (default.run.weight_apply, default.run.fresh_start,
            default.run.hold_batch_for_groups) == (None, None, None)
    assert _policy(default.run) == ("eager", True, True, "capacity", "yield")
    assert default.run.alpha == 1
    assert {d.name: d.alpha for d in default.domains} == {"reasoning": None, LONG: LONG_ALPHA}


def test_no_hold_is_the_default_without_holding_batches_for_groups() -> None:
    sims = regimes(quick=True)
    default = scenario_of(apply_policy(sims["long_horizon"], "default"), 0)
    no_hold = scenario_of(apply_policy(sims["long_horizon"], "no_hold"), 0)
    assert default.run.effective_hold_batch and not no_hold.run.effective_hold_batch
    assert msgspec.structs.replace(no_hold.run, hold_batch_for_groups=None) == default.run
    assert no_hold.domains == default.domains


def test_seeds_option_sets_the_number_of_seeds(monkeypatch) -> None:
    import benchmarks.staleness_waste as sw
    from benchmarks.common import parse_args

    ran: list[int] = []

    def fake_measure(sim, seed, warmup):
        ran.append(seed)
        return {"step_time_s": 10.0, "trained_tokens": 100.0, "stale_waste_share": 0.0,
                "waste_share": 0.0,
                "waste_by_reason": {}, "accounted": 1.0, "long_span_steps": float("nan"),
                "share_vs_configured": {"d": 1.0}, "length_bias": {"d": 0.0},
                "trained_len": {"d": 1.0}, "finished_len": {"d": 1.0}}

    monkeypatch.setattr(sw, "measure", fake_measure)
    try:
        parse_args("staleness_waste", "", ["--quick", "--seeds", "6"])
        res = sw.run(True, 0)
        assert sorted(set(ran)) == [0, 1, 2, 3, 4, 5]
        assert res["meta"]["seeds"] == [0, 1, 2, 3, 4, 5]
        parse_args("staleness_waste", "", ["--quick"])
        ran.clear()
        sw.run(True, 0)
        assert sorted(set(ran)) == [0, 1, 2]  # the quick default is unchanged
    finally:
        parse_args("x", "", [])


def test_step_time_is_also_compared_per_trained_token(monkeypatch) -> None:
    # The default's steps may train other work than lazy's (longer batches, another domain
    # mix): here 1.2x the step time for 2x the tokens, i.e. 0.6x the time per token.
    import benchmarks.staleness_waste as sw
    from benchmarks.common import parse_args

    def fake_measure(sim, seed, warmup):
        lazy = sim.weight_apply == "at_batch"
        return {"step_time_s": 10.0 if lazy else 12.0,
                "trained_tokens": 100.0 if lazy else 200.0, "stale_waste_share": 0.0,
                "waste_share": 0.0, "waste_by_reason": {}, "accounted": 1.0,
                "long_span_steps": float("nan"), "share_vs_configured": {"d": 1.0},
                "length_bias": {"d": 0.0}, "trained_len": {"d": 1.0},
                "finished_len": {"d": 1.0}}

    monkeypatch.setattr(sw, "measure", fake_measure)
    try:
        parse_args("staleness_waste", "", ["--quick"])
        ratios = sw.run(True, 0)["ratios"]
    finally:
        parse_args("x", "", [])
    for regime in ("rollout_bound", "trainer_bound", "long_horizon"):
        assert ratios[f"{regime}: step time default vs lazy"] == pytest.approx(1.2)
        assert ratios[f"{regime}: step time per trained token default vs lazy"] == (
            pytest.approx(0.6))


@pytest.mark.parametrize("regime", ["rollout_bound", "trainer_bound"])
def test_default_policy_wastes_no_group_whose_straggler_outlives_a_short_hold(regime) -> None:
    # Seed 1 of both regimes (virtual clock: deterministic) draws reasoning groups with one
    # member near max_tokens_per_turn, still generating 70-150 s after the batch it must
    # join was ready. A hold bounded at 60 s let that batch go and the whole group, 7-8
    # finished members too, went stale (0.185 and 0.234 of generated tokens); the default
    # bound waits for it.
    out = measure(apply_policy(regimes(quick=True)[regime], "default"), 1, 2)
    assert out["stale_waste_share"] <= 0.05, out["waste_by_reason"]
    assert out["accounted"] == pytest.approx(1.0)
