"""Trainer process -> inference worker weight sync, both real processes on the tiny model.

One training step changes the weights; the worker stages the pushed version, applies it, acks
it, and its prompt logprobs then equal the trainer's under that version. A worker that missed
versions is brought straight to the latest one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from weight_checks import FIXED, prompt_logprobs, trainer_logprobs

from rollart.inference.client import InferenceClient
from rollart.trainer.client import TrainerClient
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.security import env_credentials

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOL = 1e-4  # float32 on both sides; measured differences are ~1e-6


@pytest.fixture(scope="module")
def services(tiny_model_dir, service_starter, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("weight-sync-logs")
    worker = service_starter("rollart.inference.worker",
                             ["--model", str(tiny_model_dir), "--dtype", "float32",
                              "--enforce-eager"], log_dir=log_dir, ready_timeout_s=300)
    trainer = service_starter("rollart.trainer.service",
                              ["--model", str(tiny_model_dir), "--options",
                               '{"lr": 0.01, "bucket_bytes": 200000}',
                               "--worker", worker.address,  # the run's only worker
                               "--checkpoint-dir", str(tmp_path_factory.mktemp("ckpts"))],
                              log_dir=log_dir, ready_timeout_s=300)
    yield worker.address, trainer.address
    worker.stop()
    trainer.stop()


async def _rollout_samples(worker: InferenceClient, n: int) -> list[m.TrainSample]:
    samples = []
    for i in range(n):
        prompt = FIXED[: 4 + i]
        r = await worker.generate(m.Generate(
            request_id=f"roll-{i}-{torch.randint(1 << 30, ()).item()}", new_token_ids=tb.pack_i32(prompt),
            sampling=m.SamplingParams(max_tokens=8, ignore_eos=True, seed=i)))
        gen = tb.view_i32(r.token_ids).tolist()
        samples.append(m.TrainSample.from_lists(
            token_ids=prompt + gen, loss_mask=[0] * len(prompt) + [1] * len(gen),
            behaviour_logprobs=[0.0] * len(prompt) + tb.view_f32(r.logprobs).tolist(),
            advantage=1.0 if i % 2 == 0 else -1.0, sample_id=f"s{i}"))
    return samples


async def test_one_step_changes_weights_and_worker_serves_the_trainers_version(
        services, tiny_model_dir, tmp_path):
    worker_addr, trainer_addr = services
    worker = InferenceClient(worker_addr, name="worker", liveness_timeout_s=30, auth=env_credentials())
    trainer = TrainerClient(trainer_addr, auth=env_credentials())
    try:
        before = await prompt_logprobs(worker)
        await trainer.set_workers([worker_addr])
        start = await trainer.status()
        result = await trainer.train(start.version, await _rollout_samples(worker, 4))
        assert result.version == start.version + 1
        assert {"loss", "grad_norm", "clip_fraction", "logprob_mismatch"} <= set(result.metrics)
        # vLLM's behaviour logprobs and the trainer's proximal ones agree before the update.
        assert result.metrics["logprob_mismatch"] < 1e-3
        published = await trainer.wait_published(result.version)
        assert published.failed == {} and published.num_bytes > 0
        applied = await worker.apply_weights(result.version)
        assert applied.version == result.version == applied.stats.version
        after = await prompt_logprobs(worker)
        saved = await trainer.save_checkpoint("one-step")
        assert saved.version == result.version
        expected = trainer_logprobs(tiny_model_dir, Path(saved.path))
        assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-3  # changed
        assert after == pytest.approx(expected, abs=TOL)
        # New tokens now carry the new version.
        r = await worker.generate(m.Generate(
            request_id="after-update", new_token_ids=tb.pack_i32(FIXED[:5]),
            sampling=m.SamplingParams(max_tokens=4, ignore_eos=True)))
        assert set(tb.view_i32(r.versions).tolist()) == {result.version}
    finally:
        await worker.close()
        await trainer.close()


async def test_a_worker_that_missed_versions_is_brought_to_the_latest(services, tmp_path):
    worker_addr, trainer_addr = services
    worker = InferenceClient(worker_addr, name="worker", liveness_timeout_s=30, auth=env_credentials())
    trainer = TrainerClient(trainer_addr, auth=env_credentials())
    try:
        await trainer.set_workers([])  # the worker misses the next two versions
        samples = await _rollout_samples(worker, 2)
        for _ in range(2):
            status = await trainer.status()
            result = await trainer.train(status.version, samples)
        served = (await worker.stats()).version
        assert served < result.version - 1
        with pytest.raises(Exception, match="stale_version|incomplete_version|not_found"):
            await worker.apply_weights(result.version)  # nothing of it was staged
        published = await trainer.publish_latest([worker_addr])
        assert published.version == result.version and published.failed == {}
        applied = await worker.apply_weights(result.version)
        assert applied.version == result.version
    finally:
        await worker.close()
        await trainer.close()
