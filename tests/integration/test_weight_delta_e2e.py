"""Delta weight transfer between real processes: a trainer with ``weight_delta = "xor"`` and a
bf16 wire, and a real vLLM CPU worker on the tiny model.

The worker rebuilds each delta on the exact base it holds and then serves the trainer's weights
(rounded to bf16, as sent); a delta naming a base it does not hold is refused with
``NeedFullVersion``; a delta failing its checksum stages nothing and the served weights stay; a
worker that missed versions is brought up to date by a full version, then gets deltas again.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zstandard
from safetensors import safe_open
from weight_checks import FIXED, prompt_logprobs

from rollart.inference.client import InferenceClient
from rollart.trainer.client import TrainerClient
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError
from rollart.transport.security import env_credentials

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOL = 1e-4  # as test_trainer_weight_sync: float32 engine, the same (bf16-rounded) weights


@pytest.fixture(scope="module")
def services(tiny_model_dir, service_starter, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("weight-delta-logs")
    worker = service_starter("rollart.inference.worker",
                             ["--model", str(tiny_model_dir), "--dtype", "float32",
                              "--enforce-eager"], log_dir=log_dir, ready_timeout_s=600)
    trainer = service_starter("rollart.trainer.service",
                              ["--model", str(tiny_model_dir), "--options",
                               '{"lr": 0.01, "bucket_bytes": 200000, "weight_delta": "xor", '
                               '"weight_wire_dtype": "bf16", "weight_full_every": 1000}',
                               "--worker", worker.address,
                               "--checkpoint-dir", str(tmp_path_factory.mktemp("ckpts"))],
                              log_dir=log_dir, ready_timeout_s=300)
    yield worker.address, trainer.address
    worker.stop()
    trainer.stop()


@pytest.fixture
async def clients(services):
    worker_addr, trainer_addr = services
    worker = InferenceClient(worker_addr, name="worker", liveness_timeout_s=30,
                             auth=env_credentials())
    trainer = TrainerClient(trainer_addr, auth=env_credentials())
    await trainer.set_workers([worker_addr])
    yield worker, trainer, worker_addr
    await worker.close()
    await trainer.close()


def _samples(n: int) -> list[m.TrainSample]:
    return [m.TrainSample.from_lists(
        token_ids=FIXED, loss_mask=[0] * 4 + [1] * (len(FIXED) - 4),
        behaviour_logprobs=[0.0] * 4 + [-3.0] * (len(FIXED) - 4),
        advantage=1.0 if i % 2 else -1.0, sample_id=f"s{i}-{torch.randint(1 << 30, ()).item()}")
        for i in range(n)]


async def _step(trainer: TrainerClient) -> m.Published:
    status = await trainer.status()
    result = await trainer.train(status.step, _samples(4))
    return await trainer.wait_published(result.version)


def _bf16_trainer_logprobs(model_dir: Path, ckpt: Path) -> list[float]:
    """Logprobs of ``FIXED`` under the checkpoint's float32 masters rounded to bf16 (the wire)."""
    from transformers import AutoModelForCausalLM

    from rollart.trainer.checkpoint import load_trainer
    from rollart.trainer.step import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    load_trainer(ckpt, model, torch.optim.AdamW(model.parameters()))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ids = torch.tensor([FIXED])
    with torch.no_grad():
        lp = token_logprobs(model.eval(), ids, torch.ones_like(ids))
    return lp[0, 1:].tolist()


async def test_delta_round_trip_serves_the_trainers_weights(clients, tiny_model_dir):
    worker, trainer, addr = clients
    first = await _step(trainer)
    assert first.delta_workers == [] and first.failed == {}  # no base yet: full
    await worker.apply_weights(first.version)
    second = await _step(trainer)
    assert second.delta_workers == [addr] and second.failed == {}
    assert 0 < second.wire_bytes < second.num_bytes
    await worker.apply_weights(second.version)
    saved = await trainer.save_checkpoint("delta-round-trip")
    assert saved.version == second.version
    expected = _bf16_trainer_logprobs(tiny_model_dir, Path(saved.path))
    assert await prompt_logprobs(worker) == pytest.approx(expected, abs=TOL)


async def test_unknown_base_and_bad_checksum_leave_the_served_weights(clients, tiny_model_dir):
    worker, trainer, addr = clients
    published = await _step(trainer)
    await worker.apply_weights(published.version)
    held = published.version
    before = await prompt_logprobs(worker)
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        name = next(n for n in f.keys() if f.get_slice(n).get_shape() == [128])  # noqa: SIM118
    meta = m.TensorMeta(name=name, dtype="bfloat16", shape=[128], nbytes=256)
    no_change = zstandard.ZstdCompressor().compress(bytes(256))

    def delta(base: int, checksum: str) -> m.WeightDelta:
        return m.WeightDelta(version=held + 1, base_version=base, bucket_index=0, num_buckets=1,
                             tensors=[meta], checksum=checksum, encoding="xor")

    reply = await worker.push_weight_delta(delta(held + 500, "00000000"), no_change)
    assert isinstance(reply, m.NeedFullVersion) and reply.base_version == held + 500
    with pytest.raises(RemoteError) as err:  # the held base, but the rebuilt CRC is wrong
        await worker.push_weight_delta(delta(held, "00000000"), no_change)
    assert err.value.code == "checksum_mismatch"
    with pytest.raises(RemoteError, match="incomplete_version"):
        await worker.apply_weights(held + 1)
    assert (await worker.stats()).version == held
    assert await prompt_logprobs(worker) == before
    # The trainer's own next version still arrives as a delta on the held base.
    nxt = await _step(trainer)
    assert nxt.delta_workers == [addr]
    await worker.apply_weights(nxt.version)


async def test_a_lagging_worker_gets_a_full_version_then_deltas(clients, tiny_model_dir):
    worker, trainer, addr = clients
    await trainer.set_workers([])  # the worker misses two versions
    for _ in range(2):
        missed = await _step(trainer)
        assert missed.wire_bytes == 0
    await trainer.set_workers([addr])
    latest = await trainer.publish_latest([addr])
    assert latest.delta_workers == [] and latest.wire_bytes == latest.num_bytes
    await worker.apply_weights(latest.version)
    healed = await _step(trainer)
    assert healed.delta_workers == [addr]
    await worker.apply_weights(healed.version)
    saved = await trainer.save_checkpoint("delta-lagging")
    expected = _bf16_trainer_logprobs(tiny_model_dir, Path(saved.path))
    assert await prompt_logprobs(worker) == pytest.approx(expected, abs=TOL)
    r = await worker.generate(m.Generate(
        request_id="after-delta", new_token_ids=tb.pack_i32(FIXED[:5]),
        sampling=m.SamplingParams(max_tokens=4, ignore_eos=True)))
    assert set(tb.view_i32(r.versions).tolist()) == {healed.version}
