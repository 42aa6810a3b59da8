"""The README's in-process env pattern runs as written: ``open_cluster(scenario)``, then
``cluster.register_env(name, factory)`` on the yielded cluster, then ``cluster.train(steps=2)``,
on a scenario of that env only (no ``[[env_hosts]]``), with real vLLM worker and trainer
processes. The script is the README's own code block (extracted from the README itself)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]

# What the README's text before the block says the scenario holds: domains of env
# "script:echo" scored by the env (env_return, local), no [[env_hosts]], and (the default tiny
# model has no demonstrations of a user's env) tiny_warmup = false.
SCENARIO = """
[run]
seed = 3
steps = 2
batch_size = 4
group_size = 2
max_turns = 1
max_tokens_per_turn = 8
max_tokens_per_trajectory = 200
generate_timeout_s = 120.0

[model]
path = "tiny"
tiny_warmup = false
dtype = "float32"

[[pools]]
name = "cpu"
[pools.engine]
enforce_eager = true
kv_cache_bytes = 67108864
max_model_len = 512
max_num_seqs = 16

[[domains]]
name = "echo"
env = "script:echo"
pool = "cpu"
reward = "env_return"
reward_url = "local"

[trainer]
lr = 1e-4
weight_bucket_bytes = 1048576

[output]
transcripts_per_step = 4
transcript_rate = 1.0
"""


def readme_register_env_script() -> str:
    """The README's code block that calls ``cluster.register_env`` (exactly one)."""
    text = (ROOT / "README.md").read_text()
    blocks = [code for code in re.findall(r"```python\n(.*?)```", text, flags=re.S)
              if "cluster.register_env(" in code]
    assert len(blocks) == 1, blocks
    return blocks[0]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_readme_register_env_pattern_trains_two_steps(tmp_path, rollart_cache_dir):
    code = readme_register_env_script()
    # Same calls, same order: open_cluster, register_env on the cluster, then train.
    calls = [code.index(c) for c in ("rollart.open_cluster(", "cluster.register_env(",
                                     "cluster.train(steps=2)")]
    assert calls == sorted(calls)
    assert "envs=" not in code and "env_hosts" not in SCENARIO
    # The block defines `main(scenario)`; a script runs it as examples/driver.py does.
    script = tmp_path / "echo_driver.py"
    script.write_text(code + "\n\nimport asyncio\nimport sys\n\n"
                      "asyncio.run(main(sys.argv[1]))\n")
    scenario = tmp_path / "echo.toml"
    scenario.write_text(SCENARIO)
    env = dict(os.environ, ROLLART_CACHE_DIR=str(rollart_cache_dir))
    proc = subprocess.run([sys.executable, str(script), str(scenario)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    steps = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["1:", "2:"], proc.stdout

    run_dir = tmp_path / "runs" / "echo"  # the block's run_dir, relative to the script's cwd
    rows = _jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["num_samples"] == 4 and r["num_failed"] == 0 for r in rows)
    assert [r["step"] for r in _jsonl(run_dir / "trained_samples.jsonl")] == [1, 2]
    # The registered env served the trajectories: its first observation and its reference
    # answer, and its step reward (0 or 1) as the trajectory's reward.
    transcripts = _jsonl(run_dir / "transcripts.jsonl")
    assert transcripts
    for t in transcripts:
        assert t["domain"] == "echo" and "say " in t["turns"][0]["prompt"]
        assert t["reference"] in "abcdefgh" and len(t["reference"]) == 1
        if t["status"] == "kept":
            assert t["reward"] in (0.0, 1.0)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
