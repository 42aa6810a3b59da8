"""``python examples/agent_calculator.py`` runs with its defaults to its end: its default
scenario (``scenarios/agent_calculator.toml``, found from any working directory), the tiny
model warmed up on tool calls (shared with ``test_agents_e2e`` through the session's model
cache), two training steps. The other examples: ``test_driver_example`` (``driver.py``, fast
variant), ``tests/unit/test_admission_policy.py`` (``admission_policy.py``, a module)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# the tool-call warm-up (~3 min) runs once per model cache, then one engine's start-up
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]


def test_agent_calculator_runs_with_its_defaults(tmp_path, rollart_cache_dir) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "agent_calculator.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1500,
                          env=dict(os.environ, ROLLART_CACHE_DIR=str(rollart_cache_dir)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [x.split(":")[0] for x in proc.stdout.splitlines() if x.startswith("step ")]
    assert steps == ["step 1", "step 2"]
    run = tmp_path / "runs" / "agent-example"
    assert (run / "metrics.jsonl").read_text().count("\n") == 2
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000002"
