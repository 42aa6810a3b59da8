"""The trainer as data-parallel FSDP2 ranks under torchrun (2 CPU processes, gloo).

- One `train_step` over 2 ranks gives the weights and metrics of one process on the same batch
  (``fsdp_step_worker.py`` runs both ways), including 5 samples over 2 ranks with one rank
  running more micro-batches than the other.
- ``rollart serve-trainer`` launched as the launcher does with ``trainer.num_processes = 2``:
  trains over RPC, saves a DCP checkpoint, resumes from it after a SIGKILL of torchrun (rank 0's
  parent), which leaves no rank behind; a dead follower rank ends the whole trainer; a SIGKILL of
  a launcher (``Supervisor``) leaves neither torchrun nor a rank behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from weight_checks import TWO_RANK_SCENARIO

from rollart.config import parse_scenario
from rollart.launcher.services import trainer_argv
from rollart.trainer.client import TrainerClient
from rollart.transport import messages as m
from rollart.transport.errors import PeerDeadError, RemoteError
from rollart.transport.security import env_credentials

HERE = Path(__file__).parent
WORKER = HERE / "fsdp_step_worker.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

# float32 summation order differs between 1 and 2 ranks (gradients are summed across ranks and
# micro-batches are packed per rank). Measured max |w_1 - w_2|: 6e-8 with SGD (updates up to
# 2.8e-2, so a gradient off by the world size would be off by ~1e-2) and 7.3e-6 with AdamW
# (updates ~1e-3); one process with another micro-batch budget differs from itself by up to 8e-6
# under AdamW, which divides tiny gradients by their own size.
WEIGHT_ATOL = {"odd": 1e-6, "clipped": 1e-6, "minibatches": 5e-5}
METRIC_REL = 1e-5

SCENARIO = TWO_RANK_SCENARIO


def _run(argv: list[str], log: Path) -> None:
    with log.open("wb") as fh:
        proc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, timeout=300,
                              start_new_session=True)
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]


@pytest.mark.slow
def test_two_ranks_train_step_equals_one_process(tmp_path):
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    _run([sys.executable, str(WORKER), str(one)], tmp_path / "one.log")
    _run([*TORCHRUN, str(WORKER), str(two)], tmp_path / "two.log")
    for case, atol in WEIGHT_ATOL.items():
        w1, w2 = load_file(one / f"{case}.safetensors"), load_file(two / f"{case}.safetensors")
        assert w1.keys() == w2.keys() and len(w1) > 10
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=atol, msg=name)
        m1 = json.loads((one / f"{case}.json").read_text())
        m2 = json.loads((two / f"{case}.json").read_text())
        for key in ("loss", "pg_loss", "grad_norm", "num_tokens", "num_samples", "iw_mean",
                    "iw_max", "iw_min", "logprob_mismatch", "ratio_mean", "clip_fraction",
                    "num_skipped_steps", "entropy_mean"):
            assert m2[key] == pytest.approx(m1[key], rel=METRIC_REL, abs=1e-7), (case, key)
        # Per-sample engine/trainer agreement: each rank has a share, all-reduced to the whole.
        assert len(m2["agreement"]) == m1["num_samples"]
        for row1, row2 in zip(m1["agreement"], m2["agreement"], strict=True):
            assert row2 == pytest.approx(row1, rel=METRIC_REL, abs=1e-6), case
        # Only the version-1 tokens (every second generated one) were compared.
        lengths = [6 + (i * 5) % 11 for i in range(int(m1["num_samples"]))]
        assert [r[3] for r in m2["agreement"]] == [(n - n // 2) // 2 for n in lengths], case
    clipped = json.loads((two / "clipped.json").read_text())
    assert clipped["grad_norm"] > 2.0  # clipping to 1.0 was active
    odd = json.loads((two / "odd.json").read_text())
    # 5 samples, one per micro-batch: rank 0 ran 3, rank 1 ran 2 and one padding pass.
    assert odd["num_microbatches"] == 5 and odd["num_padding_microbatches"] == 1


# ---------------------------------------------------------------------------------------------


def _state(pid: int) -> str | None:
    """The process's state letter, None once it is gone (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    return None if state in ("Z", "X") else state


def _ranks(torchrun_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == torchrun_pid:
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
            if rank is not None:
                out[rank] = int(d.name)
    return out


def _wait_gone(pids, timeout_s: float = 60.0) -> list[int]:
    """Wait until every pid is gone; returns those still alive after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if _state(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def _samples(n: int) -> list[m.TrainSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = 6 + (i * 5) % 11
        ids = torch.randint(5, 100, (length,), generator=g).tolist()
        gen = length - length // 2
        out.append(m.TrainSample.from_lists(
            token_ids=ids, loss_mask=[0] * (length - gen) + [1] * gen,
            behaviour_logprobs=[0.0] * (length - gen) + [-4.0] * gen,
            advantage=1.0 if i % 2 else -1.0, sample_id=f"s{i}"))
    return out


def _load(model_dir: Path, ckpt: Path):
    from transformers import AutoModelForCausalLM

    from rollart.trainer.checkpoint import load_trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    state = load_trainer(ckpt, model, opt)
    avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    return state, {k: v.detach().clone() for k, v in model.named_parameters()}, avg


def _start(service_launcher, model_dir: Path, resume: Path | None, log_dir: Path,
           checkpoint_dir: Path | None = None):
    argv = trainer_argv(parse_scenario(SCENARIO), model_dir, resume,
                        checkpoint_dir=checkpoint_dir)
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    svc = service_launcher(argv[2], argv[3:], log_dir=log_dir, ready_timeout_s=240)
    deadline = time.monotonic() + 60
    while len(ranks := _ranks(svc.proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(ranks) == [0, 1], svc.log()[-3000:]
    return svc, ranks


@pytest.mark.slow
async def test_serve_trainer_with_two_ranks_trains_saves_and_resumes(
        tiny_model_dir, service_launcher, tmp_path):
    svc, ranks = _start(service_launcher, tiny_model_dir, None, tmp_path / "logs",
                        tmp_path / "ckpt")
    client = TrainerClient(svc.address, auth=env_credentials())
    samples = _samples(5)
    try:
        assert (await client.status()).version == 0
        result = await client.train(0, samples)
        assert result.version == 1
        assert result.metrics["num_tokens"] == sum(s.num_loss_tokens for s in samples)
        assert result.metrics["num_padding_microbatches"] >= 0  # the 2-rank path reported
        assert result.metrics["grad_norm"] > 0 and result.metrics["loss"] != 0
        ckpt = (tmp_path / "ckpt" / "step_000001").resolve()
        saved = await client.save_checkpoint("step_000001")
        assert saved.path == str(ckpt)
        assert saved.version == 1
    finally:
        await client.close()
    state1, weights1, avg1 = _load(tiny_model_dir, ckpt)
    from transformers import AutoModelForCausalLM

    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert state1.version == 1 and state1.step == 1
    assert max((weights1[k] - base[k]).abs().max().item() for k in weights1) > 1e-3

    # SIGKILL torchrun alone (rank 0's parent): the ranks must not outlive it.
    os.kill(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait(timeout=30)
    assert _wait_gone(ranks.values()) == []

    svc, ranks = _start(service_launcher, tiny_model_dir, ckpt, tmp_path / "logs2",
                        tmp_path / "ckpt")
    client = TrainerClient(svc.address, auth=env_credentials())
    try:
        status = await client.status()
        assert (status.version, status.step) == (1, 1)
        again = Path((await client.save_checkpoint("again")).path)
        result = await client.train(status.version, samples)
        assert result.version == 2
    finally:
        await client.close()
    _, weights2, avg2 = _load(tiny_model_dir, again)
    for k in weights1:
        assert torch.equal(weights2[k], weights1[k]), k
    for a, b in zip(avg1, avg2, strict=True):
        assert torch.equal(a, b)
    # SIGTERM to torchrun's group (the launcher's stop): every rank goes.
    svc.stop()
    assert _wait_gone(ranks.values()) == []


@pytest.mark.slow
async def test_a_dead_follower_rank_ends_the_whole_trainer(
        tiny_model_dir, service_launcher, tmp_path):
    svc, ranks = _start(service_launcher, tiny_model_dir, None, tmp_path / "logs")
    os.kill(ranks[1], signal.SIGKILL)
    # torchrun ends rank 0 and exits non-zero: nothing is left to hang.
    assert svc.wait_exit(timeout_s=120) != 0
    assert _wait_gone(ranks.values()) == []
    client = TrainerClient(svc.address, liveness_timeout_s=5, auth=env_credentials())
    try:
        with pytest.raises((PeerDeadError, RemoteError)):
            await client.train(0, _samples(2))
    finally:
        await client.close()


LAUNCHER = """
import asyncio, sys
from pathlib import Path
from rollart.config import parse_scenario
from rollart.launcher.procs import Supervisor
from rollart.launcher.services import trainer_argv

async def main():
    sup = Supervisor(Path(sys.argv[1]))
    argv = trainer_argv(parse_scenario(sys.argv[2]), Path(sys.argv[3]), None)
    await sup.start("trainer", argv, ready_timeout_s=240)
    print(sup.services["trainer"].proc.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.slow
def test_killing_the_launcher_leaves_no_trainer_rank(tiny_model_dir, tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "run"), SCENARIO, str(tiny_model_dir)],
        stdout=subprocess.PIPE, start_new_session=True)
    try:
        line = launcher.stdout.readline()  # the launcher prints torchrun's pid once ready
        assert line.strip().isdigit(), (tmp_path / "run" / "logs" / "trainer.log").read_text()
        torchrun = int(line)
        deadline = time.monotonic() + 60
        while len(ranks := _ranks(torchrun)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(ranks) == [0, 1]
        launcher.kill()  # SIGKILL: no cleanup code of the launcher runs
        launcher.wait(timeout=30)
        assert _wait_gone([torchrun, *ranks.values()]) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
