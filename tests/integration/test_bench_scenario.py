"""``env_tail --scenario`` and ``affinity --scenario`` on REAL services: the vLLM CPU engine,
the tiny model, env host, reward service and trainer processes of
``scenarios/cpu-two-pools.toml``, at the smallest size that yields a ratio (one
seed, 2 steps per variant: a warm-up and one measured step). They check the path and the
JSON, not the values: on one loaded CPU machine a single step's ratio is noise.

Marked ``bench`` (``nox -s bench_measured`` runs them): each starts about ten clusters
(13-15 minutes at load 15-20). The tests session keeps the smaller checks of the same code path
(``benchmarks.on_scenario`` through ``modes --scenario``, the layouts and latency injection in
``test_bench_json.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.bench, pytest.mark.timeout(1800)]

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios/cpu-two-pools.toml"


def _common(tmp_path: Path, cache_dir: Path) -> list[str]:
    return ["--scenario", str(SCENARIO), "--cache-dir", str(cache_dir), "--steps", "2",
            "--json", str(tmp_path / "out.json")]


def test_env_tail_on_a_real_scenario(tmp_path: Path, rollart_cache_dir: Path) -> None:
    from benchmarks import env_tail

    env_tail.main([*_common(tmp_path, rollart_cache_dir), "--stds", "2", "--env-mean-s", "0.5"])
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["benchmark"] == "env_tail" and data["simulated"] is False
    (row,) = data["rows"]
    assert row["env_std_s"] == 2.0 and row["seeds"] == 1
    assert row["batch_rollout_s"] > 0 and row["traj_level_rollout_s"] > 0
    key = "std 2s: trajectory-level vs batch"
    assert data["ratios"][key] == pytest.approx(
        row["batch_rollout_s"] / row["traj_level_rollout_s"], rel=1e-3)
    assert set(data["ci95"]) == set(data["ratios"]) and "normal(0.5 s" in data["meta"]["notes"]


def test_affinity_on_a_real_scenario(tmp_path: Path, rollart_cache_dir: Path) -> None:
    from benchmarks import affinity

    affinity.main([*_common(tmp_path, rollart_cache_dir), "--splits", "1"])
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["benchmark"] == "affinity" and data["simulated"] is False
    rows = {r["layout"]: r for r in data["rows"]}
    assert sorted(rows) == ["1xgame+1xreasoning", "game_only", "reasoning_only"]
    assert all(r["cost_units"] == 2.0 and r["step_time_s"] > 0 for r in rows.values())
    assert rows["game_only"]["workers_game"] == 2
    mixed = rows["1xgame+1xreasoning"]["step_time_s"]
    assert data["ratios"]["best mixed vs best game_only"] == pytest.approx(
        rows["game_only"]["step_time_s"] / mixed, rel=1e-3)
    assert set(data["ratios"]) == {"best mixed vs best game_only",
                                   "best mixed vs best reasoning_only",
                                   "1xgame+1xreasoning vs game_only"}
    assert set(data["ci95"]) == set(data["ratios"])
