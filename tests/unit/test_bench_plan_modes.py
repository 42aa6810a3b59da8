"""``python -m benchmarks.plan --modes``: the planner benchmark for the baseline modes."""

from __future__ import annotations

import argparse
import types

import pytest
from benchmarks import plan as plan_bench

from rollart.planner.inputs import read_inputs
from rollart.planner.search import full_space, sim_of, space


@pytest.mark.parametrize("mode", ["one_off", "areal", "sync_plus"])
def test_a_baseline_regime_sweeps_its_paper_layout_under_its_own_policy(mode):
    sim = plan_bench.regime("rollout-bound", True, mode)
    inputs = read_inputs(plan_bench.as_scenario(sim), model=plan_bench.MODEL,
                         profiles={d.spec.name: d.spec for d in sim.domains})
    assert inputs.gpus == {"h800": 6, "h20": 2}  # the rollart regime's GPUs
    sweep = set(full_space(inputs))
    paper = plan_bench.paper_candidate(sim)
    assert paper in sweep
    assert paper.alpha == {"one_off": 1, "areal": 1, "sync_plus": 0}[mode]
    # what the planner simulates is the mode with the baselines' (lazy) policy throughout
    got = sim_of(inputs, paper, 3)
    assert got.mode == mode and got.reprefill == (mode != "sync_plus")
    assert (got.weight_apply, got.fresh_start, got.hold_batch_for_groups, got.admission) == (
        "at_batch", False, False, "greedy")


def test_modes_option_parses_and_refuses_unknown_modes():
    assert plan_bench._modes("one_off, areal,one_off") == ("one_off", "areal")
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown mode\(s\) \['ppo'\]"):
        plan_bench._modes("rollart,ppo")


def test_ratios_are_named_per_mode(monkeypatch):
    """The wiring of ``run``: one ratio of each kind per (mode, regime), rollart's under the
    names it always had. The planner and the runs are stood in for (fast, not simulated)."""

    def fake_plan(sc, *, model, profiles, **kw):
        # like with like: the sweep runs static, so the plan must not turn online affinity on
        assert kw["try_online_affinity"] is False
        inputs = read_inputs(sc, model=model, profiles=profiles)
        first, _ = space(inputs)
        best = types.SimpleNamespace(candidate=first[-1])
        return types.SimpleNamespace(inputs=inputs, best=best, log=types.SimpleNamespace(runs=1, cpu_s=1.0, wall_s=1.0))

    def fake_run(sim, seed, warmup, cap):
        t = 100.0 + 10 * sim.trainer_gpus + seed
        step = {"step_time_s": t, "trainer_idle_s": t / 2}
        return types.SimpleNamespace(step_time_s=t, steps=[step] * 5)

    monkeypatch.setattr(plan_bench, "plan", fake_plan)
    monkeypatch.setattr(plan_bench, "run_capped", fake_run)
    monkeypatch.setattr(plan_bench, "_MODES", [("rollart", "sync_plus")])
    res = plan_bench.run(True, 0)
    names = set(res["ratios"])
    for regime in plan_bench.REGIMES:
        assert f"plan vs exhaustive best: {regime}" in names
        assert f"plan vs paper layout: {regime}, sync_plus" in names
        assert f"plan vs sweep's in-sample minimum: {regime}" in names
    assert len(names) == 2 * 3 * len(plan_bench.REGIMES)
    assert {r["mode"] for r in res["rows"]} == {"rollart", "sync_plus"}


def test_the_sweeps_best_is_chosen_on_the_planners_seeds_and_scored_on_the_evaluation_seeds(
        monkeypatch):
    """A layout that is fastest only on the evaluation seeds (noise the sweep would otherwise
    select on) is the in-sample minimum, not the exhaustive best; the exhaustive best is the
    fastest on the planner's seeds. The planner and the runs are stood in for (fast)."""
    chosen: dict[str, object] = {}

    def fake_plan(sc, *, model, profiles, seeds, **kw):
        inputs = read_inputs(sc, model=model, profiles=profiles)
        layouts = full_space(inputs)
        chosen.update(inputs=inputs, plan=layouts[0], search_best=layouts[1],
                      eval_best=layouts[2], seeds=seeds)
        best = types.SimpleNamespace(candidate=layouts[0])
        return types.SimpleNamespace(inputs=inputs, best=best, log=types.SimpleNamespace(runs=1, cpu_s=1.0, wall_s=1.0))

    def fake_run(sim, seed, warmup, cap):
        c = next(c for c in full_space(chosen["inputs"])
                 if sim_of(chosen["inputs"], c, plan_bench.RUNGS[-1][0]) == sim)
        on_search = seed in chosen["seeds"]
        t = 100.0
        if c == chosen["search_best"]:
            t = 80.0 if on_search else 90.0
        elif c == chosen["eval_best"]:
            t = 120.0 if on_search else 60.0
        step = {"step_time_s": t, "trainer_idle_s": t / 2}
        return types.SimpleNamespace(step_time_s=t, steps=[step] * 5)

    monkeypatch.setattr(plan_bench, "plan", fake_plan)
    monkeypatch.setattr(plan_bench, "run_capped", fake_run)
    monkeypatch.setattr(plan_bench, "REGIMES", ("rollout-bound",))
    res = plan_bench.run(True, 0)
    assert res["ratios"]["plan vs exhaustive best: rollout-bound"] == pytest.approx(0.9)
    assert res["ratios"]["plan vs sweep's in-sample minimum: rollout-bound"] == \
        pytest.approx(0.6)
    rows = {r["layout"]: r for r in res["rows"]}
    assert rows["exhaustive best"]["step_time_s_planner_seeds"] == pytest.approx(80.0)
    assert rows["exhaustive best"]["step_time_s"] == pytest.approx(90.0)
