"""A benchmark writes the JSON schema of issue 6, run_all collects it, report renders it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks import env_tail, report, run_all
from benchmarks.common import main_for


def test_env_tail_quick_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "env_tail.json"
    main_for("env_tail", "", env_tail.run, ["--quick", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "env_tail" and data["simulated"] is True
    assert len(data["rows"]) == 4
    assert set(data["ratios"]) >= {"std 1s: trajectory-level vs batch", "std 10s: ideal"}
    # More env-latency spread -> larger trajectory-level speedup (the paper's trend).
    speedups = [row["speedup"] for row in data["rows"]]
    assert speedups[0] < speedups[-1] and speedups[-1] > 1.2
    table = report.render(tmp_path)
    assert "| env_tail | True | std 1s: trajectory-level vs batch |" in table


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
