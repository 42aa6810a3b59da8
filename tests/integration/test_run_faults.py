"""Process faults in a real `rollart run` (tiny model; every process real): kill -9 of a service
mid-run, and the optional checkpoint on Ctrl-C.

- ``--checkpoint-on-interrupt``: Ctrl-C finishes the step, checkpoints it, and ``--resume``
  continues from there, training every sample once;
- one of two workers of a pool dies (in that resumed run): it is taken out of its pool, its
  turns re-routed, the run finishes every step with every sample trained once, and its vLLM
  children die with it;
- a process the run cannot do without dies (the only env host, the trainer, the last worker of a
  pool): the run stops with exit code 1 and one message naming the process, its exit code and
  its log; the launcher never talks to the dead peer (no env-session close to a dead host).

Every `rollart run` here costs a cluster start-up (one or two vLLM engines, the trainer), so
the interrupt / resume and the worker-loss checks share runs: a resumed run is a run like any
other for losing a worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from proctree import alive, descendants
from short_run import SHORT_RUN, eager, one_pool

# A run starts 4-5 processes (two vLLM engines); on a loaded 2-core machine start-up alone took
# up to 7 minutes, and the interrupt test starts two runs.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def cache_dir(rollart_cache_dir) -> Path:
    return rollart_cache_dir  # the session's: the tiny model is built once


def _scenario(tmp_path: Path, *, single_pool: bool = False, workers: int = 1,
              checkpoint_every: int = 1) -> Path:
    """``short_run.toml`` with engines without torch.compile (``enforce_eager``): what these
    runs check is process handling, and the compile was the largest part of an engine's
    start-up. The compiled engine under `rollart run` is covered by ``test_run_e2e``'s short
    run. ``single_pool``: both domains on pool reasoning, one engine fewer
    (``short_run.one_pool``), with ``workers`` workers."""
    text = eager(SHORT_RUN.read_text())
    if single_pool:
        text = one_pool(text)
        text = text.replace('name = "reasoning"\n',
                            f'name = "reasoning"\nnum_workers = {workers}\n', 1)
    else:
        assert workers == 1
    text = text.replace("checkpoint_every = 1", f"checkpoint_every = {checkpoint_every}")
    path = tmp_path / "scenario.toml"
    path.write_text(text)
    return path


def _rollart(scenario: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "rollart.cli", "run", str(scenario), *args]


def _jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _start_and_wait_for_step(argv: list[str], out: Path, step: int) -> subprocess.Popen:
    launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    deadline = time.monotonic() + 900
    while len(_jsonl(out / "metrics.jsonl")) < step:
        assert launcher.poll() is None, launcher.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"no step {step}"
        time.sleep(0.2)
    return launcher


def _service_pid(out: Path, service: str) -> int:
    """Pid of the service process the launcher started as ``service`` (its --ready-file)."""
    ready = str(out / "ready" / f"{service}.addr")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if ready.encode() in argv and b"--ready-file" in argv:
            return int(entry)
    raise AssertionError(f"no process for {service}")


@pytest.mark.parametrize(("service", "context"), [
    ("env-envhost", "no live env host is left"),
    ("trainer", ""),
    ("worker-reasoning-0", "it was the last live worker of pool 'reasoning'"),
])
def test_fatal_loss_stops_the_run_with_one_message(service, context, tmp_path, cache_dir):
    out = tmp_path / "run"
    # Losing the last worker of one pool stops the run although pool game still has a live
    # worker: two pools there. The env host and the trainer are fatal whatever the pools.
    scenario = _scenario(tmp_path, single_pool=not service.startswith("worker-"))
    launcher = _start_and_wait_for_step(
        _rollart(scenario, "--out", str(out), "--steps", "6", "--cache-dir", str(cache_dir)),
        out, 1)
    os.kill(_service_pid(out, service), signal.SIGKILL)
    output, _ = launcher.communicate(timeout=900)
    assert launcher.returncode == 1, output[-3000:]
    message = f"process '{service}' exited with code -9 (log: {out / 'logs' / service}.log)"
    assert output.count("exited with code") == 1, output[-3000:]
    assert message + (f"; {context}" if context else "") in output, output[-3000:]
    assert "every worker died" not in output
    # The launcher never talks to a peer it knows is dead: no session close to a dead host.
    assert "closing env session" not in output, output[-3000:]


def test_checkpoint_on_interrupt_then_resume_then_lose_one_worker_of_a_pool(tmp_path,
                                                                          cache_dir):
    out = tmp_path / "run"
    # One pool of two workers (both domains on it); only the interrupt checkpoints.
    scenario = _scenario(tmp_path, single_pool=True, workers=2, checkpoint_every=0)
    launcher = _start_and_wait_for_step(
        _rollart(scenario, "--out", str(out), "--steps", "6", "--cache-dir", str(cache_dir),
                 "--checkpoint-on-interrupt"), out, 1)
    launcher.send_signal(signal.SIGINT)
    output, _ = launcher.communicate(timeout=900)
    assert launcher.returncode == 130, output[-3000:]
    done = len(_jsonl(out / "metrics.jsonl"))
    assert 1 <= done < 6
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{done:06d}"
    assert f"checkpoint saved: {out / 'checkpoints' / f'step_{done:06d}'}" in output

    # Resume for three more steps; after the first of them one of the two workers dies,
    # leaving two steps to run on the survivor (as a fresh run losing it after step 1 would).
    last = done + 3
    launcher = _start_and_wait_for_step(
        _rollart(scenario, "--resume", str(out), "--steps", str(last), "--cache-dir",
                 str(cache_dir)), out, done + 1)
    pid = _service_pid(out, "worker-reasoning-0")
    assert pid in descendants(launcher.pid)  # the resumed run's worker, not a leftover
    family = descendants(pid) | {pid}
    assert len(family) >= 2  # the engine core at least
    os.kill(pid, signal.SIGKILL)
    output, _ = launcher.communicate(timeout=900)
    assert launcher.returncode == 0, output[-3000:]
    assert re.search(r"pool reasoning: worker reasoning-0 removed \(process 'worker-reasoning-0' "
                     r"exited with code -9 \(log: .*worker-reasoning-0.log\)\)", output), \
        output[-3000:]
    rows = _jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, last + 1))
    trained = _jsonl(out / "trained_samples.jsonl")
    assert [t["step"] for t in trained] == list(range(1, last + 1))
    ids = [i for t in trained for i in t["sample_ids"]]
    assert len(ids) == len(set(ids)) == 8 * last  # none lost, none trained twice
    for r in rows:  # losing a worker is not a trajectory failure (and never a reward of 0)
        assert r["num_failed"] == 0, r.get("num_failed_by_reason")
    assert alive(family) == set()  # its EngineCore / VLLM::Worker died with it
