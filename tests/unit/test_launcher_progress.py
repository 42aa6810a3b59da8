"""``rollart run`` shows the controller's event-loop lag: a progress-table column and the
worst step's p99 in ``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from rich.console import Console

from rollart.config import parse_scenario
from rollart.controller.observe.metrics import StepMetrics
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
    progress.console, progress.tty = Console(record=True, width=200), True  # the table
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
    for col in ("abort=0", "fail=0", "waste=-", "lag_p99_ms=7.0"):
        assert col in out


def test_progress_in_a_log_is_key_value_words_under_100_columns(capsys) -> None:
    long_names = [f"domain_with_a_long_name_{i}" for i in range(6)]
    sc = parse_scenario(SCENARIO.read_text(), str(SCENARIO))
    progress = Progress(sc, 12)
    progress.domains = long_names
    m = msgspec.structs.replace(
        metrics(3, None), reward_mean_by_domain={n: 0.25 for n in long_names[:5]},
        num_generated_tokens=100, buffer_generated_tokens=100, wasted_tokens=41,
        trained_tokens=59,
        wasted_tokens_by_reason={"stale": 38, "redundancy": 3}, num_aborted=2, num_failed=1)
    progress.step(3, m)
    lines = capsys.readouterr().out.splitlines()
    step_lines = lines[lines.index(next(x for x in lines if x.startswith("step=3/12"))):]
    assert len(step_lines) > 1 and all(len(x) < 100 for x in step_lines)
    assert all(x.startswith("    ") for x in step_lines[1:])  # continuation lines indented
    words = " ".join(step_lines).split()
    assert {"step=3/12", "ver=3", "reward=0.500", "rollout_s=1.0", "train_s=0.5",
            "sync_s=0.00", "stale=1", "abort=2", "fail=1", "waste=41%(stale:38,red:3)",
            "lag_p99_ms=-"} <= set(words)
    assert {f"reward.{n}=0.250" for n in long_names[:5]} | {f"reward.{long_names[5]}=-"} \
        <= set(words)


async def test_eval_lines_are_printed_in_the_order_the_evaluations_ran() -> None:
    # Step 1's metrics carry the evaluation before step 1 (ended before the step began);
    # step 2's, the last, carry one started after step 1 and the one after step 2.
    from rollart.controller import TrainStep
    from rollart.controller.evaluation.stats import DomainEval, EvalRecord
    from rollart.launcher.run import _train

    def record(at: int) -> EvalRecord:
        return EvalRecord(at_step=at, version_min=at, version_max=at, wall_s=1.0, domains={
            "qa": DomainEval(tasks=8, correct=0, accuracy=0.0, ci95=[0.0, 0.324])})

    evals = {1: [record(0)], 2: [record(1), record(2)]}

    class FakeCluster:
        run_folder = None

        async def __aenter__(self): return self
        async def __aexit__(self, *exc): return False

        async def train(self, steps):
            for s in range(1, steps + 1):
                m = metrics(s, None)
                m.eval = evals[s]
                yield TrainStep(s, m, [])

    progress = Progress(scenario(), 2)
    progress.console, progress.tty = Console(record=True, width=200), True
    assert await _train(FakeCluster(), 0, 2, progress) == 0
    lines = [ln.strip() for ln in progress.console.export_text().splitlines()]
    order = [ln.split(" (")[0] if ln.startswith("held-out") else ln.split()[0]
             for ln in lines if ln.startswith(("held-out", "1/2", "2/2"))]
    assert order == ["held-out eval before step 1", "1/2", "held-out eval after step 1", "2/2",
                     "held-out eval after step 2"]


async def test_a_checkpoint_line_follows_the_row_of_the_step_it_saved(tmp_path) -> None:
    # The run folder's step hook saves step 2's checkpoint before `train` yields step 2 (as
    # `Cluster.train` runs its step hooks): its note must still come after step 2's row.
    from rollart.controller import TrainStep
    from rollart.launcher.run import _train
    from rollart.launcher.rundir import RunFolder

    progress = Progress(scenario(), 3)
    progress.console, progress.tty = Console(record=True, width=200), True
    quiet = parse_scenario(SCENARIO.read_text() + "\n[output]\ntensorboard = false\n")

    class FakeTrainer:
        async def save_checkpoint(self, name: str) -> None:
            (tmp_path / "checkpoints" / name).mkdir(parents=True)

    class FakeCluster:
        trainer_client = FakeTrainer()
        # as open_cluster builds it: its notes go to the progress
        run_folder = RunFolder(tmp_path, quiet, on_note=progress.note)

        def snapshot(self) -> dict:
            return {}

        async def __aenter__(self): return self
        async def __aexit__(self, *exc): return False

        async def train(self, steps):
            for s in range(1, steps + 1):
                if s == 2:  # the hook checkpoints the step before `train` yields it
                    await self.run_folder.checkpoint(self, s, s)
                yield TrainStep(s, metrics(s, None), [])

    assert await _train(FakeCluster(), 0, 3, progress) == 0
    lines = [ln.strip() for ln in progress.console.export_text().splitlines()]
    order = [ln.split(":")[0] if ln.startswith("checkpoint") else ln.split()[0]
             for ln in lines if ln.startswith(("1/3", "2/3", "3/3", "checkpoint"))]
    assert order == ["1/3", "2/3", "checkpoint saved", "3/3"]
