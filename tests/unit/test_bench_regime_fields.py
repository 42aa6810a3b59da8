"""``affinity`` and ``staleness`` rows report the regime each run ran in (as ``modes`` does):
rollout share, trainer idle share, engine utilisation per pool, prefix-hit share, stale share."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

REGIME_KEYS = {"rollout_share", "trainer_idle_share", "prefix_hit_share", "stale_waste_share",
               "trained_tokens"}


def fake_run(sim, seed, warmup=0):
    """A finished run with known figures: 3 steps of 10 s, 6 s of rollout and 2 s of trainer
    idle each, every engine busy half the 30 s run, 1 prefix-hit token per 3 prefilled ones,
    1 stale token per 10 generated."""
    step = {"step_time_s": 10.0, "rollout_time_s": 6.0, "trainer_idle_s": 2.0,
            "trained_tokens": 100.0, "staleness_max": sim.alpha}
    workers = {f"{p.name}-{i}": {"busy_s": 15.0, "prefix_hit_tokens": 1, "prefill_tokens": 3}
               for p in sim.pools for i in range(p.num_workers)}
    return SimpleNamespace(step_time_s=10.0, steps=[dict(step) for _ in range(3)],
                           total_time_s=30.0, workers=workers,
                           buffer={"restarted_stale": 0, "generated_tokens": 10,
                                   "wasted_tokens": {"stale": 1}})


def _taking(step_s: float, sim, seed, warmup=0):
    """``fake_run`` with every step taking ``step_s``."""
    res = fake_run(sim, seed, warmup)
    for st in res.steps:
        st["step_time_s"] = step_s
    res.step_time_s = step_s
    return res


def _check_regime(row: dict, pools: set[str]) -> None:
    assert REGIME_KEYS <= set(row), row
    assert row["rollout_share"] == pytest.approx(0.6)
    assert row["trainer_idle_share"] == pytest.approx(0.2)
    assert row["prefix_hit_share"] == pytest.approx(0.25)
    assert row["stale_waste_share"] == pytest.approx(0.1)
    for pool in pools:
        assert row[f"util_{pool}"] == pytest.approx(0.5)


def test_affinity_rows_report_the_regime(monkeypatch) -> None:
    from benchmarks import affinity

    monkeypatch.setattr(affinity, "run_simulated", fake_run)
    res = affinity.run(True, 0)
    by_layout = {row["layout"]: row for row in res["rows"]}
    _check_regime(by_layout["h800_only"], {"h800"})
    _check_regime(by_layout["h20_only"], {"h20"})
    mixed = [k for k in by_layout if k not in ("h800_only", "h20_only")]
    assert mixed
    for layout in mixed:
        _check_regime(by_layout[layout], {"h800", "h20"})


def test_affinity_adaptive_rows_report_the_regime(monkeypatch) -> None:
    from benchmarks import affinity

    monkeypatch.setattr(affinity, "run_simulated", fake_run)
    res = affinity.run_adaptive(True, 0)
    runs = [row for row in res["rows"]
            if not row["layout"].startswith(("best static", "chosen with online affinity"))]
    assert runs
    for row in runs:
        _check_regime(row, set())
        # online affinity's counts only on its own runs: a static run counts no evictions
        assert ("prefix_evicted_turns" in row) == row["layout"].startswith("adaptive on"), row


def test_staleness_rows_report_the_regime(monkeypatch) -> None:
    from benchmarks import staleness

    monkeypatch.setattr(staleness, "run_simulated", fake_run)
    res = staleness.run(True, 0)
    assert res["rows"]
    for row in res["rows"]:
        _check_regime(row, {"h800", "h20"})
    # the alpha 0 row is sync_plus: its rollout share is the paper's Sync+ rollout share
    assert any(row["alpha"] == 0 and row["mode"] == "sync_plus" for row in res["rows"])


def test_affinity_adaptive_chooses_its_layout_on_its_own_seeds(monkeypatch) -> None:
    """The adaptive arm runs on the layout that was fastest with online affinity on the choice
    seeds (1000+), not on the evaluation seeds, and is scored on the evaluation seeds against
    the fastest static layout there."""
    from benchmarks import affinity

    def layout_of(sim) -> str:
        counts = {p.hardware: p.num_workers for p in sim.pools}
        return f"{counts.get('h800', 0)}+{counts.get('h20', 0)}"

    def timed_run(sim, seed, warmup=0):
        adaptive = sim.adaptive_affinity is not None and sim.adaptive_affinity.enabled
        held_out = seed >= 1000
        # h800_only is fastest static; with online affinity 6+9 wins on the choice seeds
        # only, and h20_only wins on the evaluation seeds only: neither may leak.
        t = {"9+0": 10.0, "0+27": 20.0, "6+9": 12.0, "4+15": 14.0}.get(layout_of(sim), 30.0)
        if adaptive:
            t *= {"6+9": 0.5 if held_out else 0.9, "0+27": 1.0 if held_out else 0.1}.get(
                layout_of(sim), 0.95)
        res = fake_run(sim, seed, warmup)
        res.step_time_s = t
        return res

    monkeypatch.setattr(affinity, "run_simulated", timed_run)
    res = affinity.run_adaptive(True, 0)
    assert "chosen: load x1: 6xh800+9xh20" in res["meta"]["notes"]
    assert res["ratios"]["adaptive vs best static at load x1"] == pytest.approx(10.0 / 10.8, abs=1e-4)
    assert res["ratios"]["adaptive vs static on its layout (6xh800+9xh20) at load x1"] == \
        pytest.approx(12.0 / 10.8, abs=1e-4)


def test_affinity_adaptive_whole_run_ratio_counts_the_first_step(monkeypatch) -> None:
    """The step mean leaves the first step out; the whole-run ratio keeps it: a hold that
    shortens the first burst (30 s -> 20 s) and lengthens the second step reads 0.91 by the
    step mean and 1.19 over the whole run."""
    from benchmarks import affinity

    def timed_run(sim, seed, warmup=0):
        adaptive = sim.adaptive_affinity is not None and sim.adaptive_affinity.enabled
        h800_only = all(p.hardware == "h800" for p in sim.pools)
        steps = ([20.0, 12.0, 10.0] if adaptive else [30.0, 10.0, 10.0]) if h800_only else \
            [40.0, 40.0, 40.0]
        res = fake_run(sim, seed, warmup)
        for st, t in zip(res.steps, steps, strict=True):
            st["step_time_s"] = t
        res.step_time_s = sum(steps[1:]) / 2
        return res

    monkeypatch.setattr(affinity, "run_simulated", timed_run)
    ratios = affinity.run_adaptive(True, 0)["ratios"]
    assert ratios["adaptive vs best static at load x8"] == pytest.approx(20 / 22, abs=1e-4)
    assert ratios["adaptive vs best static at load x8 (whole run)"] == pytest.approx(
        50 / 42, abs=1e-4)
    assert ratios["adaptive vs best static under drift (whole run)"] == pytest.approx(
        50 / 42, abs=1e-4)


def test_affinity_adaptive_per_trained_token_ratio_counts_the_work(monkeypatch) -> None:
    """A hold that fills each step with short trajectories reads faster by the step mean
    (10 s against h800_only's 12 s: 1.2) but trains 75 tokens a step. Per trained token the
    best static layout is another one (h20_only: 13 s for 200 tokens), chosen again by that
    measure: 0.065 / 0.1333 = 0.4875. The first step (1 token) counts in neither."""
    from benchmarks import affinity

    def timed_run(sim, seed, warmup=0):
        adaptive = sim.adaptive_affinity is not None and sim.adaptive_affinity.enabled
        hw = {p.hardware for p in sim.pools}
        if hw == {"h800"}:
            t, tokens = (10.0, 75.0) if adaptive else (12.0, 100.0)
        elif hw == {"h20"}:
            t, tokens = (14.0, 200.0) if adaptive else (13.0, 200.0)
        else:
            t, tokens = 40.0, 100.0
        res = fake_run(sim, seed, warmup)
        for st in res.steps:
            st["step_time_s"], st["trained_tokens"] = t, tokens
        res.steps[0]["trained_tokens"] = 1.0
        res.step_time_s = t
        return res

    monkeypatch.setattr(affinity, "run_simulated", timed_run)
    ratios = affinity.run_adaptive(True, 0)["ratios"]
    assert ratios["adaptive vs best static at load x8"] == pytest.approx(1.2, abs=1e-4)
    assert ratios["adaptive vs best static at load x8 (per trained token)"] == pytest.approx(
        0.4875, abs=1e-4)
    assert ratios["adaptive vs best static under drift (per trained token)"] == pytest.approx(
        0.4875, abs=1e-4)


def test_affinity_replan_bound_weighs_each_drift_phases_best_layout(monkeypatch) -> None:
    """Run alone on each phase's mix (at the drift's load), h800_only takes 10 s then 20 s a
    step, h20_only 40 s then 10 s, the H800-only pool with a trainer of 6 GPUs 50 s then 5 s;
    every other layout 30 s. The drifting run's step mean has 1 step before the drift and 4
    after: the best single layout (trainer 6) averages (50 + 4 x 5) / 5 = 14 s, switching to
    each phase's best (10 + 4 x 5) / 5 = 6 s: 2.333. (Swapped weights read 1.333, equal ones
    2.0; the trainer or the load left out, 1.6.)"""
    from benchmarks import affinity

    base = affinity.scenario(9, 0, True)

    def timed_run(sim, seed, warmup=0):
        share = next(d.weight for d in sim.domains if d.spec.name == "agentic")
        other = next(d.weight for d in sim.domains if d.spec.name == "reasoning")
        hw = frozenset(p.hardware for p in sim.pools)
        t = 30.0
        if (not sim.weight_changes and share in affinity.DRIFT and other == 1 - share
                and sim.batch_size == base.batch_size * affinity.DRIFT_LOAD):
            first = share == affinity.DRIFT[0]
            if hw == {"h800"} and sim.trainer_gpus == 6:
                t = 50.0 if first else 5.0
            elif sim.trainer_gpus == base.trainer_gpus:
                t = {frozenset({"h800"}): 10.0 if first else 20.0,
                     frozenset({"h20"}): 40.0 if first else 10.0}.get(hw, 30.0)
        return _taking(t, sim, seed, warmup)

    monkeypatch.setattr(affinity, "run_simulated", timed_run)
    assert affinity._drift_steps(3) == (6, 2, 1)
    space = affinity.replan_space(True)
    assert set(affinity.layouts(True)) | {f"h800_only, trainer {t}" for t in (2, 3, 5, 6)} \
        <= set(space)
    assert space["h800_only, trainer 2"] == (11, 0, 2)
    res = affinity.run_adaptive(True, 0)
    assert res["ratios"][
        "best layout per drift phase vs best static under drift (bound on re-planning)"
    ] == pytest.approx(14 / 6, abs=1e-4)
    phases = {(row["case"], row["layout"]) for row in res["rows"]}
    assert ("drift phase: agentic share 0.7", "h800_only, trainer 6") in phases


def test_affinity_mixed_sets_both_domains_shares() -> None:
    from benchmarks import affinity

    sc = affinity._mixed(affinity.scenario(9, 0, True), 0.3)
    assert {d.spec.name: d.weight for d in sc.domains} == pytest.approx(
        {"agentic": 0.3, "reasoning": 0.7})


def test_affinity_replan_space_moves_gpus_between_trainer_and_rollout_at_equal_cost() -> None:
    """Every split of the sweep at trainer 2-6 (the benchmark's 4 +- half, a quarter apart):
    each trainer GPU comes from the rollout H800s, or 3 H20s where there are none, so every
    layout costs what the benchmark's own does (H800 = 1, H20 = 1/3)."""
    from benchmarks import affinity

    space = affinity.replan_space(True)
    base = affinity.scenario(9, 0, True).trainer_gpus
    budget = 9 + base
    assert len(space) == 4 * 5
    for name, (h800, h20, trainer) in space.items():
        assert h800 + h20 / 3 + trainer == pytest.approx(budget), name
        assert 2 <= trainer <= 6
    assert space["h800_only, trainer 6"] == (7, 0, 6)
    assert space["h20_only, trainer 2"] == (0, 33, 2)
    assert space["4xh800+9xh20, trainer 6"] == (4, 9, 6)
    assert space["6xh800+9xh20"] == (6, 9, base)
    big = affinity.replan_space(False)
    assert big["h800_only, trainer 48"] == (56, 0, 48)
    # a mixed split whose H800s would all go to the trainer is left out, never negative
    assert "16xh800+168xh20" in big and "8xh800+192xh20, trainer 40" not in big
    assert all(h800 >= 1 for k, (h800, _, _) in big.items() if "xh800+" in k)
    assert all(h800 >= 0 and h20 >= 0 and h800 + h20 >= 1 for h800, h20, _ in big.values())


def test_affinity_adaptive_compares_the_splits_at_the_benchmarks_trainer(monkeypatch) -> None:
    """The head-to-head runs every split with the benchmark's trainer (4 GPUs at --quick),
    static and adaptive alike; only the re-planning bound's runs change the trainer. A faster
    layout at another trainer size (2 s a step) is neither chosen nor the best static."""
    from benchmarks import affinity

    base = affinity.scenario(9, 0, True).trainer_gpus
    trainers = []

    def timed_run(sim, seed, warmup=0):
        # only the bound runs one fixed mix other than the default (a drift phase alone)
        if sim.weight_changes or all(d.weight == 1.0 for d in sim.domains):
            trainers.append(sim.trainer_gpus)
        t = 2.0 if sim.trainer_gpus != base else 10.0
        return _taking(t, sim, seed, warmup)

    monkeypatch.setattr(affinity, "run_simulated", timed_run)
    res = affinity.run_adaptive(True, 0)
    assert trainers and set(trainers) == {base}
    assert res["ratios"]["adaptive vs best static at load x8"] == pytest.approx(1.0)
    assert {row["trainer_gpus"] for row in res["rows"] if "trainer_gpus" in row
            and not row["case"].startswith("drift phase")} == {base}


def _adaptive_with(monkeypatch, times_of):
    """``run_adaptive`` on fake runs whose step time is ``times_of(pools, trainer, adaptive)``
    (``pools``: ((hardware, workers), ...))."""
    from benchmarks import affinity

    def timed_run(sim, seed, warmup=0):
        adaptive = sim.adaptive_affinity is not None and sim.adaptive_affinity.enabled
        pools = tuple((p.hardware, p.num_workers) for p in sim.pools)
        t = times_of(pools, sim.trainer_gpus, adaptive)
        return _taking(t, sim, seed, warmup)

    monkeypatch.setattr(affinity, "run_simulated", timed_run)
    return affinity.run_adaptive(True, 0)


def test_affinity_best_mixed_split_and_paper_layout_are_mixed(monkeypatch) -> None:
    """h800_only is the fastest static layout: 'the best mixed split' is still one with both
    pools (4 + 15: 30 s static, 25 s adaptive), and the paper's layout is the first mixed
    split."""
    def times(pools, trainer, adaptive):
        if pools == (("h800", 9),):
            return 20.0
        if pools == (("h800", 4), ("h20", 15)):
            return 25.0 if adaptive else 30.0
        return 40.0

    ratios = _adaptive_with(monkeypatch, times)["ratios"]
    assert "adaptive vs static 6xh800+9xh20 at load x8" in ratios
    keys = [k for k in ratios if k.startswith("adaptive vs static on the best mixed split")]
    assert keys and all("4xh800+15xh20" in k for k in keys), keys
    assert ratios["adaptive vs static on the best mixed split (4xh800+15xh20) at load x8"] == \
        pytest.approx(30 / 25)


@pytest.mark.parametrize("case", ["pick", "paper"])
def test_affinity_best_mixed_split_ratio_uses_its_adaptive_run(monkeypatch, case) -> None:
    """The fastest mixed split static is the adaptive pick (or the paper's split, the pick
    elsewhere): its ratio is static over adaptive on it (30 / 20), never a run over itself."""
    target = (("h800", 6), ("h20", 9)) if case == "paper" else (("h800", 4), ("h20", 15))

    def times(pools, trainer, adaptive):
        if pools == target:
            return 20.0 if adaptive else 30.0
        if case == "paper" and pools == (("h800", 9),) and adaptive:
            return 10.0
        return 40.0

    ratios = _adaptive_with(monkeypatch, times)["ratios"]
    name = "6xh800+9xh20" if case == "paper" else "4xh800+15xh20"
    assert ratios[f"adaptive vs static on the best mixed split ({name}) at load x8"] == \
        pytest.approx(1.5)
