"""benchmarks.learning at its smallest size: one step of rollart sync (real services) and of
TRL's GRPOTrainer from the same warmed-up checkpoint, both evaluated by the shared evaluator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", reason="needs the learning extra (pip install -e .[learning])")


@pytest.mark.slow
@pytest.mark.vllm
def test_learning_smallest_size(tmp_path: Path, rollart_cache_dir: Path) -> None:
    out = tmp_path / "learning.json"
    cmd = [sys.executable, "-m", "benchmarks.learning", "--steps", "1", "--eval-every", "1",
           "--eval-size", "8", "--seeds", "1", "--cache-dir", str(rollart_cache_dir),
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["benchmark"] == "learning" and res["simulated"] is False
    key = "final eval: rollart sync vs trl"
    assert key in res["ratios"] and key in res["ci95"]
    rows = res["rows"]
    assert {(r["side"], r["step"]) for r in rows} == {
        ("rollart sync", 0), ("rollart sync", 1), ("trl", 0), ("trl", 1)}
    for r in rows:
        assert 0.0 <= r["accuracy"] <= 1.0 and 0.0 <= r["sampled_accuracy"] <= 1.0
    assert 0.0 < res["majority_baseline"] <= 1.0
    # both sides trained one step on the same task, scored by the same scorer
    assert len(res["train_reward"]["rollart sync"]["0"]) == 1
    assert len(res["train_reward"]["trl"]["0"]) == 1
    # sync mode: behaviour and trainer logprobs agree, so the IS weight stays ~1
    assert res["rollart_importance_weight"]["0"]["iw_max"] < 1.01
    # rollart's step trained the groups TRL's step trained (the controller's seed draw)
    assert res["rollart_importance_weight"]["0"]["same_prompts_as_trl"] is True
    assert res["trl_settings"]["shuffle_dataset"]["value"] is False
    assert res["trl_settings"]["loss_type"]["value"] == "dapo"
