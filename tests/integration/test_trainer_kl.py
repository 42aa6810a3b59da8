"""The trainer service with a KL term (``kl_coef`` > 0): the reference policy is the initial
checkpoint, held frozen beside the policy (it used to be missing: every step failed)."""

from __future__ import annotations

import pytest

from rollart.trainer.service import TrainerOptions, TrainerService
from rollart.transport import messages as m
from rollart.transport.security import INSECURE


def _samples() -> list[m.TrainSample]:
    ids = [2, *range(20, 40)]
    return [m.TrainSample.from_lists(token_ids=ids, loss_mask=[0] * 5 + [1] * (len(ids) - 5),
                          behaviour_logprobs=[0.0] * 5 + [-5.0] * (len(ids) - 5),
                          advantage=1.0 if i % 2 else -1.0, sample_id=f"k{i}")
            for i in range(4)]


async def test_kl_to_the_initial_policy_is_zero_then_grows(tiny_model_dir):
    service = TrainerService(tiny_model_dir, TrainerOptions(lr=0.05),
                             b'{"kl_coef": 0.5}', resume=None, auth=INSECURE)  # in-process: opens no socket
    first = await service.train(m.TrainBatch(version=0, samples=_samples()), None)
    second = await service.train(m.TrainBatch(version=1, samples=_samples()), None)
    assert first.metrics["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference
    assert second.metrics["kl"] > 1e-4  # the policy moved away from the frozen reference
    assert all(not p.requires_grad for p in service.ref_model.parameters())
    await service.publisher.close()
