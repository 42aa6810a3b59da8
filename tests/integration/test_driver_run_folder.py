"""A driver script with its own env and reward runs under ``rollart.open_cluster`` end to end
(real vLLM worker, reward service and trainer processes; the env and reward live in the user's
files) and writes the same run folder as ``rollart run``: metrics, TensorBoard, transcripts,
checkpoints honouring ``checkpoint_every``, summary; ``rollart run --resume`` continues it with
the same env and reward registered from the scenario's ``run.local_module``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Two cluster start-ups (fresh, resume) on a loaded CPU machine can exceed the 600 s default.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

SCENARIO = """
[run]
seed = 5
steps = 3
batch_size = 4
group_size = 2
max_turns = 2
max_tokens_per_turn = 8
max_tokens_per_trajectory = 400
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
reward = "contains_reference"
reward_url = "local"

[trainer]
lr = 1e-4
checkpoint_every = 2
weight_bucket_bytes = 1048576

[output]
transcripts_per_step = 4
transcript_rate = 1.0
"""

# The user's env and reward, in their own file: the driver script imports it, and the
# scenario's run.local_module names it for `rollart run`.
TASK = '''
import os
from pathlib import Path

LOG = Path(__file__).parent / "task_calls.log"  # which process used this file's env

class Echo:
    """Two turns: asks for a letter, then says which letter it wanted."""
    def reset(self, seed):
        with LOG.open("a") as f:
            f.write(f"reset {os.getpid()}\\n")
        self.letter = "abcdefgh"[seed % 8]
        self.turn = 0
        return f"say {self.letter}", {"reference": self.letter}
    def step(self, action):
        self.turn += 1
        done = self.turn >= 2
        return f"I wanted {self.letter}", 0.0, done, False, {}

calls = []
def contains_reference(prompt, response, reference, metadata):
    calls.append(len(metadata["responses"]))
    return float(reference in response), {"turns_seen": len(metadata["responses"])}

REWARDS = {"contains_reference": contains_reference}
ENVS = {"script:echo": Echo}
'''

SCRIPT = '''
import asyncio, sys
import rollart
from task import Echo, calls, contains_reference

async def main(scenario, run_dir, steps):
    async with rollart.open_cluster(scenario, run_dir=run_dir, steps=steps,
                                    envs={"script:echo": Echo}) as cluster:
        cluster.register_reward("contains_reference", contains_reference)
        async for step in cluster.train(steps=3):
            print("step", step.step, step.metrics.reward_mean, flush=True)
    print("reward calls", len(calls), "max turns", max(calls, default=0))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
'''


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _run(tmp_path: Path, argv: list[str], cache_dir: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ROLLART_CACHE_DIR=str(cache_dir))
    # cwd elsewhere: `rollart run` finds run.local_module beside the scenario, not in cwd
    proc = subprocess.run([sys.executable, *argv], cwd=tmp_path / "elsewhere", env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _check_export(out: Path, base: Path, ckpt: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rollart.trainer.checkpoint import load_trainer

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    load_trainer(ckpt, model, torch.optim.AdamW(model.parameters()))
    want = model.state_dict()
    assert set(exported) == set(want) and all(torch.equal(exported[k], want[k]) for k in want)


def test_driver_script_with_its_own_env_and_reward_writes_the_run_folder(tmp_path,
                                                                        rollart_cache_dir):
    (tmp_path / "scenario.toml").write_text(SCENARIO)
    (tmp_path / "task.py").write_text(TASK)
    (tmp_path / "driver.py").write_text(SCRIPT)
    (tmp_path / "elsewhere").mkdir()
    run_dir = tmp_path / "run"
    out = _run(tmp_path, [str(tmp_path / "driver.py"), str(tmp_path / "scenario.toml"),
                          str(run_dir), "3"], rollart_cache_dir).stdout
    assert [x.split()[1] for x in out.splitlines() if x.startswith("step ")] == ["1", "2", "3"]
    # The untrained model rarely ends a turn within 8 tokens (a cut-off turn ends the
    # episode), so most trajectories have one turn; the two-turn split is unit-tested.
    assert "max turns" in out

    rows = _jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["num_samples"] == 4 and r["num_failed"] == 0 for r in rows)
    assert [r["step"] for r in _jsonl(run_dir / "trained_samples.jsonl")] == [1, 2, 3]
    # checkpoint_every = 2, and the planned last step
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000002", "step_000003"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
    # The base model is recorded (the built tiny model in the cache): `rollart export` of an
    # earlier step loads in transformers with the checkpoint's weights.
    base = json.loads((run_dir / "base_model.json").read_text())
    assert base["model_path"] == "tiny" and Path(base["path"]).is_relative_to(rollart_cache_dir)
    _run(tmp_path, ["-m", "rollart.cli", "export", str(run_dir), "--step", "2",
                    str(tmp_path / "export")], rollart_cache_dir)
    _check_export(tmp_path / "export", Path(base["path"]), run_dir / "checkpoints" / "step_000002")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["domains"]["echo"]["trained_share"] == 1.0
    assert summary["domains"]["echo"]["reward_first10_mean"] is not None
    assert list((run_dir / "tensorboard").iterdir())

    transcripts = _jsonl(run_dir / "transcripts.jsonl")
    assert transcripts and {t["step"] for t in transcripts} <= {1, 2, 3}
    for t in transcripts:
        assert t["domain"] == "echo" and t["status"] in ("kept", "wasted")
        assert t["status"] == "kept" or t["reason"]
        assert "say " in t["turns"][0]["prompt"]  # the env's first observation, decoded
        assert 1 <= len(t["turns"]) <= 2
        if len(t["turns"]) == 2:
            assert "I wanted" in t["turns"][1]["prompt"]  # the observation delta
    kept = [t for t in transcripts if t["status"] == "kept"]
    assert kept and all(t["reward_details"]["turns_seen"] == len(t["turns"]) for t in kept)

    # Resume with `rollart run`: the scenario names the user's file (run.local_module) for the
    # same env and reward. It continues from step 3's checkpoint; old logs move aside, new ones
    # start fresh. Three more steps: the samples restored from the checkpoint were admitted for
    # batches 4 and 5 at most (alpha 1, capacity admission), so step 6 needs new trajectories
    # whichever way the restored ones fall.
    (tmp_path / "with_module.toml").write_text(
        SCENARIO.replace("[run]\n", '[run]\nlocal_module = "task.py"\n', 1))
    first_logs = {p.name: p.read_text() for p in (run_dir / "logs").iterdir()}
    (tmp_path / "task_calls.log").unlink()
    proc = _run(tmp_path, ["-m", "rollart.cli", "run", str(tmp_path / "with_module.toml"),
                           "--resume", str(run_dir), "--steps", "6"], rollart_cache_dir)
    # `rollart run` ends on its closing block, with no exit noise after it (nanobind's leak
    # report of the frozen objects triton binds reads like a crash).
    lines = proc.stdout.rstrip().splitlines()
    assert any("run summary" in x for x in lines) and lines[-1].startswith("continue "), lines
    assert "nanobind" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert [r["step"] for r in _jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    # The file's env served the resumed run's new trajectories in `rollart run`'s process.
    pids = {line.split()[1] for line in (tmp_path / "task_calls.log").read_text().splitlines()}
    assert len(pids) == 1 and pids != {str(os.getpid())}
    ids = [i for t in _jsonl(run_dir / "trained_samples.jsonl") for i in t["sample_ids"]]
    assert len(ids) == len(set(ids)) == 24
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000006"
    (previous,) = run_dir.glob("previous-*")
    assert {p.name: p.read_text() for p in (previous / "logs").iterdir()} == first_logs
    old, new = first_logs["trainer.log"], (run_dir / "logs" / "trainer.log").read_text()
    assert new and not (old and new.startswith(old))  # a fresh log, not appended to
