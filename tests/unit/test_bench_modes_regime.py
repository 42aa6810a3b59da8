"""``modes --regime``: a loaded regime keeps the trajectory and group timeouts' margin over
a trajectory's time, so it is measured rather than stopped by its own queueing."""

from __future__ import annotations

import pytest

from rollart.config import RunConfig
from rollart.sim.harness import scenario_of


@pytest.mark.parametrize("load_x", [1, 2, 8])
def test_regime_scales_the_trajectory_and_group_timeouts_with_load(load_x: int) -> None:
    from benchmarks import modes

    base = modes.regime_base("qwen3-32b", "rollart", False)
    run = scenario_of(modes.regime_sim(base, 1, load_x, True), 0).run
    # the run's defaults (one hour per trajectory, three per group) at load x1, times load_x
    assert (RunConfig().trajectory_timeout_s, RunConfig().group_timeout_s) == (3600.0, 10800.0)
    assert run.trajectory_timeout_s == pytest.approx(3600.0 * load_x)
    assert run.group_timeout_s == pytest.approx(10800.0 * load_x)
    # only load moves them: a faster trainer does not lengthen a trajectory
    assert scenario_of(modes.regime_sim(base, 4, 1, False), 0).run.trajectory_timeout_s == (
        pytest.approx(3600.0))


def test_simulated_timeouts_reach_the_controller_and_none_means_no_limit() -> None:
    from benchmarks import modes

    base = modes.regime_base("qwen3-8b", "sync", True)
    run = scenario_of(base.replace(trajectory_timeout_s=None, group_timeout_s=None), 0).run
    assert run.trajectory_timeout_s is None and run.group_timeout_s is None
    assert modes.regime_sim(base.replace(trajectory_timeout_s=None), 1, 8, True
                            ).trajectory_timeout_s is None


def test_grid_option_picks_the_regimes_and_is_refused_without_regime(monkeypatch) -> None:
    from benchmarks import modes

    seen = []
    monkeypatch.setattr(modes, "run_regime",
                        lambda quick, seed, grid=None: seen.append((quick, grid)) or {})
    import benchmarks.common as common

    monkeypatch.setattr(common, "emit", lambda res, path: None)
    modes.main(["--regime", "--grid", "axes", "--seeds", "2"])
    modes.main(["--regime", "--quick"])
    assert seen == [(False, "axes"), (True, None)]
    with pytest.raises(SystemExit):
        modes.main(["--grid", "axes", "--quick"])
    with pytest.raises(ValueError, match="grid"):
        modes.regime_grid(False, "diagonal")
    common.parse_args("x", "", [])  # leave the module-level size as the defaults


def test_a_loaded_regime_is_measured_not_failed_by_its_own_queueing() -> None:
    """A one-engine-per-pool sync_plus cluster whose trajectory limit (120 s) its x1 load
    never reaches: at load x8 queued trajectories outlast that limit, so unscaled they fail
    (and inflate the step); the sweep's scaled limit lets every one finish."""
    import dataclasses

    from benchmarks import modes

    from rollart.sim.harness import run_simulated

    base = modes.regime_base("qwen3-8b", "sync_plus", True)
    base = base.replace(pools=tuple(dataclasses.replace(p, num_workers=1) for p in base.pools),
                        batch_size=8, group_size=4, trainer_gpus=2, steps=2,
                        trajectory_timeout_s=120.0, group_timeout_s=360.0)
    assert run_simulated(modes.regime_sim(base, 1, 1, True), 0).buffer["failed"] == {}
    loaded = modes.regime_sim(base, 1, 8, True)
    assert loaded.trajectory_timeout_s == 960.0
    assert run_simulated(loaded, 0).buffer["failed"] == {}
    unscaled = loaded.replace(trajectory_timeout_s=120.0, group_timeout_s=360.0)
    assert run_simulated(unscaled, 0).buffer["failed"].get("trajectory_timeout", 0) > 0
