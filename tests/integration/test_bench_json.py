"""A benchmark writes the JSON schema of issue 6, run_all collects it, report renders it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from benchmarks import env_tail, pd, report, run_all
from benchmarks.common import ci95, main_for, mean_rows, summarize, t975


def test_env_tail_quick_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "env_tail.json"
    main_for("env_tail", "", env_tail.run, ["--quick", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "env_tail" and data["simulated"] is True
    assert len(data["rows"]) == 4
    assert set(data["ratios"]) >= {"std 1s: trajectory-level vs batch", "std 10s: ideal"}
    assert set(data["ci95"]) == set(data["ratios"]) and data["meta"]["seeds"] == [0, 1, 2]
    for key, (low, high) in data["ci95"].items():
        assert low <= data["ratios"][key] <= high, key
    # More env-latency spread -> larger trajectory-level speedup (the paper's trend).
    speedups = [row["speedup"] for row in data["rows"]]
    assert speedups[0] < speedups[-1] and speedups[-1] > 1.2
    table = report.main([str(tmp_path)])
    assert "| env_tail | True | std 1s: trajectory-level vs batch |" in table
    # every benchmark run_all knows has a row, run or not
    assert "| ablations | | (not run) |" in table and "| env_tail-scenario | |" in table
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):  # a directory without benchmark JSON
        report.main([str(tmp_path / "empty")])
    # Rows are means over the seeds; the speedup compares rollout time, not step time.
    assert all(row["seeds"] == 3 for row in data["rows"])
    assert all(row["speedup"] == pytest.approx(row["batch_rollout_s"]
                                               / row["traj_level_rollout_s"], rel=0.1)
               for row in data["rows"])


def test_ci95_by_hand() -> None:
    # mean 2, sd 1, n 3: half width 4.303 * 1 / sqrt(3) = 2.48434
    mean, (low, high) = ci95([1.0, 2.0, 3.0])
    assert mean == 2.0 and low == pytest.approx(2 - 2.48434, rel=1e-5)
    assert high == pytest.approx(2 + 2.48434, rel=1e-5)
    assert t975(12) == 2.228 and t975(100) == 2.042
    ratios, intervals = summarize({"a": [1.0, 1.0, 1.0]})
    assert ratios == {"a": 1.0} and intervals == {"a": [1.0, 1.0]}
    rows = mean_rows([{"k": "x", "v": 1.0}, {"k": "x", "v": 3.0}, {"k": "y", "v": 5.0}], ("k",))
    assert rows == [{"k": "x", "v": 2.0, "seeds": 2}, {"k": "y", "v": 5.0, "seeds": 1}]


def test_pd_quick_json_has_every_ci(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    main_for("pd", "", pd.run, ["--quick", "--json", str(out)])
    data = json.loads(out.read_text())
    assert set(data["ci95"]) == set(data["ratios"]) and len(data["ratios"]) == 4
    # PD never loses to colocating both phases on the compute-weak H20.
    assert data["ci95"]["qwen3-32b: pd vs h20 colocated"][0] > 1.0


@pytest.mark.slow
def test_run_all_only_one(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run_all", "--quick", "--out",
                           str(tmp_path), "--only", "env_tail"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["env_tail"]["status"] == "ok"
    with pytest.raises(SystemExit):
        run_all.main(["--out", str(tmp_path), "--only", "nope"])


def test_modes_switches_a_real_scenario_to_every_mode() -> None:
    from benchmarks.modes import MODES, scenario_for_mode

    from rollart.config import load_scenario

    base = load_scenario(Path(__file__).resolve().parents[2] / "scenarios/quickstart.toml")
    got = {m: scenario_for_mode(base, m, seed=5, steps=3) for m in MODES}
    assert {m: (s.run.mode, s.run.alpha, s.run.steps, s.run.seed) for m, s in got.items()} == {
        "sync": ("sync", 0, 3, 5), "sync_plus": ("sync_plus", 0, 3, 5),
        "one_off": ("one_off", 1, 3, 5), "areal": ("areal", 1, 3, 5),
        "rollart": ("rollart", 1, 3, 5)}
    # Every mode that applies weights under in-flight trajectories pays re-prefill; sync and
    # sync_plus keep the scenario's.
    keep = base.run.reprefill
    assert {m: s.run.reprefill for m, s in got.items()} == {
        "sync": keep, "sync_plus": keep, "one_off": True, "areal": True, "rollart": True}
    off = msgspec.structs.replace(base, run=msgspec.structs.replace(base.run, reprefill=False))
    assert {m: scenario_for_mode(off, m, seed=5, steps=3).run.reprefill for m in MODES} == {
        "sync": False, "sync_plus": False, "one_off": True, "areal": True, "rollart": True}
    assert got["rollart"].pools == base.pools
    # rollart keeps the scenario's policy (the quickstart's: the default); the baselines run
    # the lazy one spelled out, as their papers describe them.
    r = got["rollart"].run
    assert (r.effective_weight_apply, r.effective_fresh_start, r.effective_hold_batch,
            r.admission, r.domain_mix) == ("eager", True, True, "capacity", "yield")
    for m in ("sync", "sync_plus", "one_off", "areal"):
        run = got[m].run
        assert (run.weight_apply, run.fresh_start, run.admission, run.domain_mix,
                run.hold_batch_for_groups) == ("at_batch", False, "greedy", "weight", False), m


def test_affinity_sweeps_equal_cost_splits() -> None:
    from benchmarks import affinity

    for quick, budget in ((True, 9), (False, 72)):
        layouts = affinity.layouts(quick)
        assert layouts["h800_only"] == (budget, 0) and layouts["h20_only"] == (0, 3 * budget)
        assert all(h800 + h20 / 3 == budget for h800, h20 in layouts.values())
        assert len(layouts) >= 4
    # The paper's own 64 H800 + 24 H20 split is in the full-size sweep.
    assert affinity.layouts(False)["64xh800+24xh20"] == (64, 24)
    mixed = affinity.scenario(6, 9, quick=True)
    assert {d.spec.name: d.pool for d in mixed.domains} == {"agentic": "h800",
                                                            "reasoning": "h20"}


def test_plan_regimes_keep_one_inventory_and_sweep_the_paper_layout() -> None:
    from benchmarks import plan as plan_bench

    from rollart.planner.inputs import read_inputs
    from rollart.planner.search import full_space

    sims = {name: plan_bench.regime(name, True) for name in plan_bench.REGIMES}
    assert sims["loaded"].batch_size == 8 * sims["trainer-bound"].batch_size
    for sim in sims.values():
        inputs = read_inputs(plan_bench.as_scenario(sim), model=plan_bench.MODEL,
                             profiles={d.spec.name: d.spec for d in sim.domains})
        assert inputs.gpus == {"h800": 6, "h20": 2}  # the same GPUs in every regime
        sweep = set(full_space(inputs))
        assert plan_bench.paper_candidate(sim) in sweep


def test_simulated_modes_pay_reprefill_like_for_like() -> None:
    from benchmarks.modes import MODES, ROLLART_LAZY, sim_for

    got = {m: sim_for("qwen3-32b", m, True) for m in (*MODES, ROLLART_LAZY)}
    assert {m: s.reprefill for m, s in got.items()} == {
        "sync": False, "sync_plus": False, "one_off": True, "areal": True, "rollart": True,
        ROLLART_LAZY: True}
    # Only AReaL runs without hardware affinity (one domain copy per pool).
    assert {m: len(s.domains) for m, s in got.items()} == {
        "sync": 2, "sync_plus": 2, "one_off": 2, "areal": 4, "rollart": 2,
        ROLLART_LAZY: 2}


def test_areal_runs_without_affinity_and_with_reprefill() -> None:
    from benchmarks.workloads import paper_cluster

    sim = paper_cluster("qwen3-8b", quick=True, mode="areal", affinity=False, reprefill=True)
    by_family: dict[str, dict[str, float]] = {}
    for d in sim.domains:
        by_family.setdefault(d.spec.name.rsplit("-", 1)[0], {})[d.pool] = d.weight
    # Both families reach both pools, in proportion to the pools' engine counts (8 : 4).
    assert by_family == {"agentic": {"h800": 8, "h20": 4}, "reasoning": {"h800": 8, "h20": 4}}
    assert sim.reprefill


def test_ablations_switch_off_exactly_one_feature_each() -> None:
    import dataclasses

    from benchmarks import ablations

    full = ablations.scenario("full", quick=True)
    assert (full.redundancy, full.check, full.reward_gpus, full.push_at_pause) == (
        2, None, 0, False)
    assert {d.spec.name: d.pool for d in full.domains} == {"agentic": "h800",
                                                          "reasoning": "h20"}
    assert all(d.spec.step_failure_prob == ablations.ENV_FAILURE for d in full.domains)
    expected = {"no_per_turn": {"check": "admission"}, "no_redundancy": {"redundancy": 0},
                "dedicated_reward": {"reward_gpus": 1}, "no_overlap_sync": {"push_at_pause": True}}
    for knob, change in expected.items():
        got = ablations.scenario(knob, quick=True)
        diff = {f.name: getattr(got, f.name) for f in dataclasses.fields(got)
                if getattr(got, f.name) != getattr(full, f.name)}
        assert diff == change, knob
    no_aff = ablations.scenario("no_affinity", quick=True)
    assert {d.pool for d in no_aff.domains if d.spec.name.startswith("agentic")} == {"h800",
                                                                                     "h20"}
    long = ablations.scenario("full", quick=True, workload="long_horizon")
    agentic = next(d.spec for d in long.domains if d.spec.name == "agentic")
    assert agentic.num_turns.mean == 30 and long.max_turns >= 30


def test_affinity_layouts_of_a_real_scenario_spend_its_own_budget() -> None:
    import msgspec
    from benchmarks import affinity

    from rollart.config import load_scenario, validate_scenario

    root = Path(__file__).resolve().parents[2]
    base = load_scenario(root / "scenarios/qwen3-8b-h800-h20.toml")  # 8 H800 + 8 H20
    got = affinity.scenario_layouts(base, affinity.DEFAULT_COSTS, None)
    workers = {k: {p.name: p.num_workers for p in s.pools} for k, s in got.items()}
    # Budget 8 + 8/3 H800 units: 10 H800 alone, 32 H20 alone; the scenario's own split is one.
    assert workers["h800_only"] == {"h800": 10} and workers["h20_only"] == {"h20": 32}
    assert workers["8xh800+8xh20"] == {"h800": 8, "h20": 8}
    assert workers["1xh800+29xh20"] == {"h800": 1, "h20": 29} and len(got) == 12
    for name, sc in got.items():
        validate_scenario(sc, name)
        pools = {p.name for p in sc.pools}
        assert {d.pool for d in sc.domains} <= pools
        if len(pools) == 2:  # mixed: every domain keeps its declared pool (affinity)
            assert [d.pool for d in sc.domains] == [d.pool for d in base.domains]
    # A CPU scenario: both pools cost 1; --splits picks the mixed layouts.
    cpu = load_scenario(root / "scenarios/cpu-two-pools.toml")
    got = affinity.scenario_layouts(cpu, affinity.DEFAULT_COSTS, [1])
    assert sorted(got) == ["1xgame+1xreasoning", "game_only", "reasoning_only"]
    assert [(p.name, p.num_workers) for p in got["game_only"].pools] == [("game", 2)]
    assert {d.pool for d in got["game_only"].domains} == {"game"}
    with pytest.raises(ValueError, match="no mixed split"):
        affinity.scenario_layouts(cpu, affinity.DEFAULT_COSTS, [2])
    fixed = msgspec.structs.replace(cpu, pools=[msgspec.structs.replace(
        cpu.pools[0], addresses=["tcp://10.0.0.1:5555"]), cpu.pools[1]])
    with pytest.raises(ValueError, match="addresses"):
        affinity.scenario_layouts(fixed, affinity.DEFAULT_COSTS, None)
    with pytest.raises(ValueError, match="exactly two pools"):
        affinity.scenario_layouts(got["game_only"], affinity.DEFAULT_COSTS, None)
    with pytest.raises(SystemExit):  # a bad --cost is refused before any cluster starts
        affinity.main(["--scenario", str(root / "scenarios/cpu-two-pools.toml"),
                       "--cost", "cpu=0"])


def test_env_tail_injects_latency_into_the_local_env_hosts_of_a_real_scenario() -> None:
    import msgspec
    from benchmarks import env_tail

    from rollart.config import load_scenario

    root = Path(__file__).resolve().parents[2]
    base = load_scenario(root / "scenarios/cpu-two-pools.toml")
    remote = msgspec.structs.replace(base.env_hosts[0], name="far", address="tcp://10.0.0.2:7")
    two = msgspec.structs.replace(base, env_hosts=[base.env_hosts[0], remote])
    for mode in ("sync", "sync_plus"):
        sc, skipped = env_tail.with_env_latency(two, mode=mode, std_s=5.0, mean_s=10.0,
                                                seed=4, steps=2)
        assert (sc.run.mode, sc.run.alpha, sc.run.seed, sc.run.steps) == (mode, 0, 4, 2)
        (lat,) = sc.env_hosts[0].latency.values()
        assert (lat.distribution, lat.mean_s, lat.std_s, lat.seed) == ("normal", 10.0, 5.0, 4)
        assert sc.env_hosts[1].latency == {} and skipped == ["far"]
    with pytest.raises(ValueError, match="no env host"):
        env_tail.with_env_latency(msgspec.structs.replace(base, env_hosts=[remote]),
                                  mode="sync", std_s=1.0, mean_s=10.0, seed=0, steps=2)


def test_scenario_runs_of_run_all_parse_and_bad_sizes_fail_before_any_cluster() -> None:
    from benchmarks import affinity, env_tail, on_scenario

    root = Path(__file__).resolve().parents[2]
    for name, (module, args) in run_all.SCENARIO_RUNS.items():
        assert name == f"{module}-scenario" and (root / args[args.index("--scenario") + 1]
                                                 ).is_file()
    cpu = str(root / "scenarios/cpu-two-pools.toml")
    with pytest.raises(SystemExit):  # one step leaves nothing after the warm-up
        env_tail.main(["--scenario", cpu, "--steps", "1"])
    with pytest.raises(SystemExit) as no_split:  # exit 2 with the message, no traceback
        affinity.main(["--scenario", cpu, "--splits", "2"])
    assert no_split.value.code == 2
    for bad in (["--stds", "1", "-1"], ["--stds", "nan"], ["--env-mean-s", "-3"]):
        with pytest.raises(SystemExit) as bad_latency:  # before any cluster starts
            env_tail.main(["--scenario", cpu, *bad])
        assert bad_latency.value.code == 2
    with pytest.raises(ValueError, match="at least 2 steps"):
        on_scenario.mean_after_first([{"step_time_s": 1.0}], "step_time_s")
    assert on_scenario.mean_after_first([{"t": 9.0}, {"t": 1.0}, {"t": 3.0}], "t") == 2.0


def test_reduced_size_is_full_steps_on_the_quick_cluster() -> None:
    from benchmarks import affinity, common, weight_sync  # noqa: F401
    from benchmarks.common import SIZE, parse_args, seeds_for, small

    try:
        parse_args("affinity", "", ["--reduced"])
        assert small(False) and not SIZE.models and seeds_for(False, 4) == [4, 5, 6]
        # The quick cluster's budget, with the reduced split sweep and full-size steps.
        assert affinity.layouts(False)["2xh800+21xh20"] == (2, 21)
        assert affinity.scenario(2, 21, quick=False).steps == 11
        assert affinity.scenario(2, 21, quick=False).batch_size == 64
        parse_args("modes", "", ["--seeds", "2", "--models", "qwen3-8b"])
        assert not small(False) and seeds_for(False, 0) == [0, 1] and SIZE.models == ("qwen3-8b",)
        with pytest.raises(SystemExit):
            parse_args("modes", "", ["--quick", "--reduced"])
    finally:
        parse_args("x", "", [])
    assert not small(False) and seeds_for(False, 0) == [0, 1, 2, 3, 4]


def test_modes_reports_rollart_with_the_default_and_the_lazy_policy() -> None:
    from benchmarks.modes import MODES, ROLLART_LAZY, _add_ratios, sim_for
    from benchmarks.staleness_waste import POLICIES

    from rollart.sim.harness import POLICY_FIELDS, scenario_of

    default = sim_for("qwen3-32b", "rollart", True)
    lazy = sim_for("qwen3-32b", ROLLART_LAZY, True)
    # rollart sets no policy field: RunConfig's default, the waste-free policy
    assert default.mode == "rollart" and all(getattr(default, f) is None for f in POLICY_FIELDS)
    run = scenario_of(default, 0).run
    assert (run.effective_weight_apply, run.effective_fresh_start, run.effective_hold_batch,
            run.admission, run.domain_mix) == ("eager", True, True, "capacity", "yield")
    assert lazy.mode == "rollart"
    assert {k: getattr(lazy, k) for k in POLICIES["lazy"]} == POLICIES["lazy"]
    assert lazy.replace(**{k: None for k in POLICIES["lazy"]}) == default
    # every baseline runs the lazy policy spelled out
    for mode in MODES:
        if mode != "rollart":
            sim = sim_for("qwen3-32b", mode, True)
            assert {k: getattr(sim, k) for k in POLICIES["lazy"]} == POLICIES["lazy"], mode
    samples: dict[str, list[float]] = {}
    _add_ratios(samples, "m", {"sync": 4.0, "sync_plus": 3.0, "one_off": 2.0, "areal": 2.0,
                               "rollart": 2.0, ROLLART_LAZY: 1.0})
    assert samples["m: rollart vs sync_plus"] == [1.5]
    assert samples[f"m: {ROLLART_LAZY} vs sync_plus"] == [3.0]


def test_a_wide_rows_table_prints_one_line_per_figure() -> None:
    import io

    from benchmarks.common import TRANSPOSE_ABOVE_COLUMNS, emit
    from rich.console import Console

    figures = {f"figure_{i}_with_a_long_name": float(i) for i in range(TRANSPOSE_ABOVE_COLUMNS + 8)}
    res = {"benchmark": "wide", "simulated": False, "ratios": {}, "meta": {},
           "rows": [{"n": 1000, **figures, "ci95": [1441.3388621013132, 2661.1667062023957]},
                    {"n": 10000, **figures, "only_here": 7}]}
    out = io.StringIO()
    emit(res, None, Console(file=out, width=80))  # not a terminal: 80 columns
    lines = out.getvalue().splitlines()
    assert any("n=1000" in line and "n=10000" in line for line in lines)
    for i in range(TRANSPOSE_ABOVE_COLUMNS + 8):  # every figure whole on its own line
        (line,) = [ln for ln in lines if f"figure_{i}_with_a_long_name " in ln]
        assert line.count(f"{float(i):.4g}") >= 2
    (only,) = [ln for ln in lines if "only_here" in ln]
    assert "7" in only
    (ci,) = [ln for ln in lines if "ci95" in ln]
    assert "[1441, 2661]" in ci  # an interval's numbers at 4 significant digits


def test_a_bad_scenario_file_exits_2_with_its_message_and_no_traceback(tmp_path: Path,
                                                                        capsys) -> None:
    from benchmarks import modes

    with pytest.raises(SystemExit) as missing:
        modes.main(["--scenario", str(tmp_path / "nope.toml"), "--quick"])
    assert missing.value.code == 2
    assert "nope.toml: cannot read scenario" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nbatch_size = 0\n")
    with pytest.raises(SystemExit) as invalid:
        modes.main(["--scenario", str(bad), "--quick"])
    assert invalid.value.code == 2
    assert "run.batch_size" in capsys.readouterr().err


def test_seeds_reach_the_simulated_run_of_a_benchmark_with_scenario_support() -> None:
    # --seeds was parsed (and dropped) by the --scenario front end: simulated runs used 5
    from benchmarks import on_scenario

    got: list[list[str]] = []
    on_scenario.scenario_main("x", ["--quick", "--seeds", "4"], lambda rest: got.append(rest)
                              or {}, lambda *a, **k: {})
    on_scenario.scenario_main("x", ["--quick"], lambda rest: got.append(rest) or {},
                              lambda *a, **k: {})
    assert got == [["--quick", "--seeds", "4"], ["--quick"]]


def test_staleness_runs_alpha_1_and_6_again_with_the_lazy_policy(monkeypatch) -> None:
    from types import SimpleNamespace

    from benchmarks import staleness
    from benchmarks.staleness_waste import POLICIES

    seen = []

    def fake_run_simulated(sim, seed, warmup=0):  # FakeRun: step time from alpha and policy
        lazy = sim.weight_apply == POLICIES["lazy"]["weight_apply"]
        seen.append((sim.mode, sim.alpha, lazy))
        step = 100.0 / sim.alpha * (2.0 if lazy else 1.0)
        # each row also reports its regime (benchmarks.modes.regime_of): step figures after
        # the first, engine counters and generated tokens
        figures = {"staleness_max": sim.alpha, "step_time_s": step, "rollout_time_s": step,
                   "trainer_idle_s": 0.0, "trained_tokens": 1.0}
        return SimpleNamespace(step_time_s=step, steps=[figures, figures],
                               total_time_s=2 * step, workers={},
                               buffer={"restarted_stale": 0, "wasted_tokens": {},
                                       "generated_tokens": 1})

    monkeypatch.setattr(staleness, "run_simulated", fake_run_simulated)
    res = staleness.run(True, 0)
    assert sorted(set(seen)) == [("rollart", 1, False), ("rollart", 1, True),
                                 ("rollart", 2, False), ("rollart", 6, False),
                                 ("rollart", 6, True), ("sync_plus", 1, False)]
    assert res["ratios"]["alpha 6 vs alpha 1 (lazy policy)"] == pytest.approx(6.0)
    assert res["ratios"]["alpha 1: default vs lazy policy"] == pytest.approx(2.0)
    assert set(res["ci95"]) == set(res["ratios"])


def test_token_path_keeps_intervals_in_ci95_not_among_its_ratios() -> None:
    from benchmarks import token_path

    res = token_path.run(True, 0)
    assert not any("ci95" in key for key in res["ratios"])
    before_after = [k for k in res["ratios"] if k.endswith("before/after")]
    assert before_after
    for key in before_after:
        lo, hi = res["ci95"][key]
        assert lo <= res["ratios"][key] <= hi, key


def test_a_size_option_a_benchmark_does_not_use_is_refused() -> None:
    from benchmarks import common

    for name, argv in (("pd", ["--models", "qwen3-8b"]), ("token_path", ["--seeds", "3"]),
                       ("pd", ["--reduced"]), ("staleness_waste", ["--models", "qwen3-8b"])):
        with pytest.raises(SystemExit):
            common.parse_args(name, "", argv)
    assert common.parse_args("modes", "", ["--models", "qwen3-8b", "--seeds", "3"]).seeds == 3
    assert common.parse_args("pd", "", ["--seeds", "4"]).seeds == 4
    common.parse_args("pd", "", [])  # leave SIZE as the other tests expect it


def test_adaptive_affinity_spills_under_load_and_the_drift_moves_the_mix() -> None:
    from benchmarks import affinity

    from rollart.sim.harness import run_simulated

    base = affinity.scenario(6, 9, quick=True)
    drift = affinity._drifting(base)
    lo, hi = affinity.DRIFT
    assert {d.spec.name: d.weight for d in drift.domains} == {"agentic": lo,
                                                              "reasoning": 1 - lo}
    assert drift.weight_changes == ((drift.steps // 3, "agentic", hi),
                                    (drift.steps // 3, "reasoning", 1 - hi))
    # At load x8 an H800 pool of 4 engines (of 19) saturates while the H20s have room: agentic
    # trajectories spill to the H20s. (With the paper's 6 + 9 split and the measured H20 decode
    # speed the H20s are busy too, and whether any start finds room there depends on the seed.)
    small = affinity.scenario(4, 15, quick=True)
    loaded = small.replace(batch_size=small.batch_size * 8,
                           adaptive_affinity=affinity._adaptive_config())
    res = run_simulated(loaded, 0)
    moves = [mv for st in res.steps for mv in st["affinity_moves"]]
    assert any(mv.startswith("agentic: h800 -> h20") for mv in moves), moves
    assert sum(st["num_spilled_by_domain"].get("agentic", 0) for st in res.steps) > 0


def _tiny_paper_cluster(monkeypatch) -> None:
    """``benchmarks.modes`` on a tiny cluster: one engine per pool, batch 8, group 4."""
    import dataclasses

    from benchmarks import modes
    from benchmarks.workloads import paper_cluster

    def tiny(model: str, **kw):
        sim = paper_cluster("qwen3-8b", **{**kw, "quick": True})
        return sim.replace(pools=tuple(dataclasses.replace(p, num_workers=1) for p in sim.pools),
                           batch_size=8, group_size=4, trainer_gpus=2, steps=3)

    monkeypatch.setattr(modes, "paper_cluster", tiny)


def test_modes_reports_regime_and_rollart_stale_share(tmp_path: Path, monkeypatch) -> None:
    from benchmarks import modes

    _tiny_paper_cluster(monkeypatch)
    out = tmp_path / "modes.json"
    try:
        modes.main(["--quick", "--seeds", "2", "--json", str(out)])
    finally:
        from benchmarks.common import parse_args

        parse_args("x", "", [])
    data = json.loads(out.read_text())
    ratios, ci = data["ratios"], data["ci95"]
    for key in ("qwen3-32b: sync_plus rollout share", "qwen3-32b: rollart stale share",
                "qwen3-32b: rollart vs sync_plus", "qwen3-32b: rollart vs one_off",
                "qwen3-32b: rollart vs areal", "qwen3-32b: rollart vs sync_plus per trained token",
                "qwen3-32b: rollart_lazy stale share"):
        assert ratios[key] is not None and len(ci[key]) == 2, key
    assert 0 < ratios["qwen3-32b: sync_plus rollout share"] < 1  # no overlap in sync_plus
    assert 0 <= ratios["qwen3-32b: rollart stale share"] < 1
    for row in data["rows"]:
        assert {"rollout_share", "trainer_idle_share", "util_h800", "util_h20",
                "prefix_hit_share", "stale_waste_share", "trained_tokens"} <= set(row), row
        assert 0 < row["util_h800"] <= 1 and 0 <= row["prefix_hit_share"] <= 1
    # the per-step stale share of the rollart row is the ratio's mean over seeds
    (rollart,) = [r for r in data["rows"] if r["mode"] == "rollart"]
    assert rollart["stale_waste_share"] == pytest.approx(
        ratios["qwen3-32b: rollart stale share"], abs=1e-3)


def test_modes_regime_sweep_prints_a_row_per_regime(tmp_path: Path, monkeypatch,
                                                    capsys) -> None:
    from benchmarks import modes

    _tiny_paper_cluster(monkeypatch)
    assert len(modes.regime_grid(False)) == 18 and len(modes.regime_grid(True)) == 6
    assert modes.regime_grid(False, "axes") == modes.regime_grid(True)
    assert modes.regime_grid(True, "full") == modes.regime_grid(False)
    sim = modes.regime_sim(modes.sim_for("qwen3-8b", "rollart", True), 4, 8, False)
    base = modes.sim_for("qwen3-8b", "rollart", True)
    assert (sim.trainer_gpus, sim.gpus_per_node, sim.batch_size, sim.prefix_cache) == (
        base.trainer_gpus * 4, base.gpus_per_node * 4, base.batch_size * 8, False)
    grid = [(1, 1, True), (2, 1, False)]
    monkeypatch.setattr(modes, "regime_grid", lambda quick, chosen=None: grid)
    out = tmp_path / "regime.json"
    try:
        modes.main(["--regime", "--quick", "--seeds", "2", "--json", str(out)])
    finally:
        from benchmarks.common import parse_args

        parse_args("x", "", [])
    data = json.loads(out.read_text())
    labels = [modes.regime_label(*g) for g in grid]
    assert [row["name"] for row in data["rows"]] == labels
    printed = capsys.readouterr().out
    for label in labels:
        for base in modes.REGIME_BASES:
            for per in ("", " per trained token"):
                key = f"{label}: rollart vs {base}{per}"
                low, high = data["ci95"][key]
                assert low <= data["ratios"][key] <= high, key
        row = data["rows"][labels.index(label)]
        assert row["vs one_off per trained token"].count("[") == 1
        assert label.split(",")[0] in printed
    # the cache-off regime serves no prompt token from the prefix cache
    assert data["rows"][1]["rollart prefix_hit_share"] == 0
    assert data["rows"][0]["rollart prefix_hit_share"] > 0
    with pytest.raises(SystemExit):
        modes.main(["--regime", "--scenario", "x.toml"])
