"""`rollart run` end to end on the tiny model: every process real (vLLM workers, env host,
reward service, trainer, controller); outputs, clean shutdown, SIGTERM. Exactly-once across a
kill -9 of the launcher and a resume: ``test_run_faults`` (its runs share one run folder)."""

from __future__ import annotations

import json
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proctree import alive, assert_no_process_mentions, descendants
from short_run import SHORT_RUN

# A run starts 5 processes (two vLLM engines): on the loaded 2-core machine their start-up alone
# took 8 minutes once, past the suite's 600 s default.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

SCENARIO = SHORT_RUN  # the compiled engines: test_short_run_writes_metrics_and_stops_every_process
METRIC_KEYS = {
    "step", "policy_version", "reward_mean", "reward_mean_by_domain", "num_samples",
    "step_time_s", "rollout_time_s", "train_time_s", "weight_sync_total_s",
    "weight_sync_exposed_s", "trainer_idle_s", "staleness_max", "num_aborted", "num_failed",
    "num_generated_tokens", "wasted_tokens", "wasted_tokens_by_reason", "by_domain",
    "buffer_generated_tokens", "trained_tokens", "in_flight_tokens",
}
WASTE_REASONS = {"stale", "redundancy", "failed", "unselected", "retired", "shutdown"}


@pytest.fixture(scope="module")
def cache_dir(rollart_cache_dir) -> Path:
    return rollart_cache_dir  # the session's: the tiny model is built once


def _rollart(*args: str, scenario: Path = SCENARIO) -> list[str]:
    return [sys.executable, "-m", "rollart.cli", "run", str(scenario), *args]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_short_run_writes_metrics_and_stops_every_process(tmp_path, cache_dir):
    """Two steps of the compiled engines (two pools), the trainer as two FSDP2 ranks under
    torchrun and the collective (vLLM weight-transfer engine, gloo) path on CPU: one run for
    what the outputs, the pools, the transfer and the ranks each need (a cluster start-up is
    most of a run). The default transfer (zmq) with a one-process trainer under `rollart run`:
    `test_run_faults.test_interrupt_kill_resume_and_worker_loss_train_every_sample_once`."""
    scenario = tmp_path / "gloo.toml"
    # A small held-out evaluation rides along: before step 1, after each step (beside rollout).
    # weight_apply "at_batch": the paper's order, so that the exposed share of the weight sync
    # below is all of it (the default applies eagerly, hiding part of it behind rollout).
    text = SCENARIO.read_text().replace("[run]\n", '[run]\nweight_apply = "at_batch"\n', 1)
    scenario.write_text(text + '\nweight_transfer = "gloo"\nnum_processes = 2\n'
                        + "\n[eval]\nenabled = true\nevery = 1\nsize = 12\npass_k = 2\n")
    out = tmp_path / "run"
    proc = subprocess.run(_rollart("--out", str(out), "--steps", "2", "--cache-dir",
                                   str(cache_dir), scenario=scenario),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert METRIC_KEYS <= set(r), METRIC_KEYS - set(r)
        assert r["num_samples"] == 8
        assert set(r["reward_mean_by_domain"]) <= {"guess", "arith"}
        assert r["num_failed"] == 0, r.get("num_failed_by_reason")
        # Real workers keep the reply contract and agree with the trainer (issue 13): the
        # agreement is reported per serving worker, none over the thresholds.
        assert r["num_invalid_replies"] == 0 and r["quarantined_workers"] == []
        assert r["logprob_mismatch_by_worker"] and r["disagreeing_workers"] == []
        assert set(r["agreement_tokens_by_worker"]) == set(r["logprob_mismatch_by_worker"])
        assert max(r["logprob_mismatch_by_worker"].values()) < 1e-2, r
        # Waste by reason and per domain, adding up within the step.
        assert set(r["wasted_tokens_by_reason"]) <= WASTE_REASONS, r["wasted_tokens_by_reason"]
        assert r["wasted_tokens"] == sum(r["wasted_tokens_by_reason"].values())
        assert sum(d["trained"] for d in r["by_domain"].values()) == r["num_samples"]
        assert sum(d["trained_tokens"] for d in r["by_domain"].values()) == r["trained_tokens"]
        for reason, n in r["wasted_tokens_by_reason"].items():
            assert sum(d["wasted_tokens"].get(reason, 0) for d in r["by_domain"].values()) == n
    assert [r["policy_version"] for r in rows] == [1, 2]
    # Step 1 trained version 0's tokens only: every worker was judged on its current tokens.
    assert set(rows[0]["agreement_basis_by_worker"].values()) == {"current"}, rows[0]
    # Version 1 was broadcast and applied at step 2's pause point: all of it exposed.
    assert rows[1]["weight_sync_exposed_s"] == pytest.approx(rows[1]["weight_sync_total_s"])
    assert rows[1]["weight_sync_total_s"] > 0
    assert "formed gloo weight-transfer group of 3 ranks" in (
        out / "logs" / "trainer.log").read_text()
    trainer_cfg = json.loads((out / "config.json").read_text())["trainer"]
    assert (trainer_cfg["weight_transfer"], trainer_cfg["num_processes"]) == ("gloo", 2)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["mode"] == "rollart" and summary["alpha"] == 1
    assert summary["failed_by_reason"] == {} and summary["quarantined_workers"] == []
    # Every generated token is trained, wasted for one reason, or in flight at the end.
    assert summary["generated_tokens"] > 0
    assert summary["generated_tokens"] == summary["trained_tokens"] \
        + summary["wasted_tokens"] + summary["in_flight_tokens"]
    assert summary["wasted_tokens"] == sum(summary["wasted_tokens_by_reason"].values())
    # Rollout while step 1 waited for the first evaluation is step 1's; the rows also count
    # replies the buffer refused (a turn back after its trajectory was cancelled), never fewer.
    assert rows[0]["num_generated_tokens"] > 0
    assert sum(r["num_generated_tokens"] for r in rows) >= summary["generated_tokens"]
    assert set(summary["domains"]) <= {"guess", "arith"}
    assert sum(d["trained"] for d in summary["domains"].values()) == 16
    for d in summary["domains"].values():
        assert {"trained_share_vs_configured", "length_bias", "mean_generated_trained",
                "mean_generated_finished", "wasted_tokens"} <= set(d)
    assert summary["inference_engine"].startswith("vllm")
    assert json.loads((out / "config.json").read_text())["run"]["batch_size"] == 8
    # Authenticated by default, with the run's own key, private to the user.
    key = out / "keys" / "run.key_secret"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    # Held-out evaluation through the same workers (greedy at temperature 0 and sampled),
    # never trained (the token accounting above holds without its tokens).
    assert sorted(e["at_step"] for r in rows for e in r["eval"]) == [0, 1, 2]
    assert all(r["response_len_mean_by_domain"] for r in rows)
    assert set(summary["eval"]) == {"guess", "arith"}
    for name, ev in summary["eval"].items():
        assert 0.0 <= ev["first"] <= 1.0 and 0.0 <= ev["last"] <= 1.0, (name, ev)
        assert ev["last_ci95"][0] <= ev["last"] <= ev["last_ci95"][1]
        assert 0.0 <= ev["majority_baseline"] <= 1.0 and ev["evals"] == 3 and ev["k"] == 2
        assert 0.0 < ev["distinct_answer_share_last"] <= 1.0 and "collapse" in ev
    assert_no_process_mentions(out)  # no orphans, torchrun's ranks included


def test_config_error_names_file_and_field_before_any_process(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(SCENARIO.read_text().replace("batch_size = 8", "batch_size = 6"))
    proc = subprocess.run([sys.executable, "-m", "rollart.cli", "run", str(bad), "--out",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "bad.toml" in proc.stderr and "run.batch_size" in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()


def test_sigterm_during_start_up_stops_every_process(tmp_path, cache_dir):
    """SIGTERM while the vLLM engines start: the launcher stops every service's process group,
    so no engine-core process (a worker's child) outlives it."""
    out = tmp_path / "run"
    launcher = subprocess.Popen(_rollart("--out", str(out), "--steps", "2", "--cache-dir",
                                         str(cache_dir)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    # Wait until an engine core exists (a grandchild of the launcher), then stop the run.
    while not any(Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"VLLM")
                  for p in descendants(launcher.pid)):
        assert launcher.poll() is None, launcher.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "no engine core started"
        time.sleep(0.2)
    family = descendants(launcher.pid)
    launcher.send_signal(signal.SIGTERM)
    output, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, output[-3000:]
    assert "terminated" in output
    deadline = time.monotonic() + 30
    while alive(family) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(family) == set()
