"""``rollart run`` shows the controller's event-loop lag: a progress-table column and the
worst step's p99 in ``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from rich.console import Console

from rollart.config import parse_scenario
from rollart.controller.metrics import StepMetrics
from rollart.launcher.progress import Progress
from rollart.launcher.rundir import write_summary

SCENARIO = Path(__file__).resolve().parents[1] / "minimal_scenario.toml"


def metrics(step: int, lag: float | None) -> StepMetrics:
    return StepMetrics(
        step=step, mode="rollart", policy_version=step, reward_mean=0.5,
        reward_mean_by_domain={}, num_samples=4, step_time_s=1.0, rollout_time_s=1.0,
        train_time_s=0.5, weight_sync_total_s=0.1, weight_sync_exposed_s=0.0,
        trainer_idle_s=0.2, staleness_max=1, staleness_mean=0.5, num_aborted=0, num_failed=0,
        num_failed_by_reason={}, num_retries=0, num_rerouted=0, num_generated_tokens=8,
        wasted_tokens=0, response_len_kept_mean=2.0, response_len_all_mean=2.0,
        num_turns_mean=1.0, loop_lag_p99_ms=lag, loop_lag_max_ms=lag)


def scenario():
    return parse_scenario(SCENARIO.read_text(), str(SCENARIO))


def test_progress_rows_show_the_lag_p99() -> None:
    progress = Progress(scenario(), 2)
    progress.console = Console(record=True, width=200)
    progress.step(1, metrics(1, 12.345))
    progress.step(2, metrics(2, None))
    text = progress.console.export_text()
    assert "lag p99 ms" in text and "12.3" in text
    assert text.rstrip().splitlines()[-1].rstrip().endswith("-")  # not monitored


def test_summary_reports_the_worst_steps_lag_p99(tmp_path: Path) -> None:
    rows = [metrics(1, 3.0), metrics(2, 41.5), metrics(3, None)]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(msgspec.to_builtins(r)) + "\n" for r in rows))
    write_summary(tmp_path, scenario(), started=0.0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["loop_lag_p99_ms_max"] == 41.5


def test_progress_redirected_to_a_file_keeps_every_column(capsys) -> None:
    # Not a terminal (captured): rich would assume 80 columns and drop the last ones.
    progress = Progress(scenario(), 2)
    progress.step(1, metrics(1, 7.0))
    out = capsys.readouterr().out
    for col in ("abort", "fail", "waste", "lag p99 ms"):
        assert col in out
