"""The trainer service owns its version: a batch names the version it is for, and each weight
transfer kind answers only its own request (``WaitPublished`` zmq, ``BroadcastVersion``
collective). In-process: no socket, no vLLM."""

from __future__ import annotations

import pytest

from rollart.trainer.service import TrainerOptions, TrainerService
from rollart.transport import messages as m
from rollart.transport.errors import RemoteError
from rollart.transport.security import INSECURE


def _samples() -> list[m.TrainSample]:
    ids = [2, *range(20, 40)]
    return [m.TrainSample.from_lists(token_ids=ids, loss_mask=[0] * 5 + [1] * (len(ids) - 5),
                                     behaviour_logprobs=[0.0] * 5 + [-5.0] * (len(ids) - 5),
                                     advantage=1.0 if i % 2 else -1.0, sample_id=f"v{i}")
            for i in range(4)]


async def test_a_batch_for_another_version_is_refused_and_trains_nothing(tiny_model_dir):
    service = TrainerService(tiny_model_dir, TrainerOptions(lr=0.05), None, resume=None,
                             auth=INSECURE, workers=["tcp://127.0.0.1:1"])
    try:
        first = await service.train(m.TrainBatch(version=0, samples=_samples()), None)
        assert (first.step, first.version) == (0, 1)
        before = [p.detach().clone() for p in service.model.parameters()]
        for stale in (0, 2):  # sent twice, or from a controller that is ahead
            with pytest.raises(RemoteError) as info:
                await service.train(m.TrainBatch(version=stale, samples=_samples()), None)
            assert info.value.code == "stale_version"
            assert "holds version 1" in str(info.value)
        assert service.version == 1 and service.step == 1
        assert all((a == b).all() for a, b in zip(before, service.model.parameters(),
                                                   strict=True))
        # The zmq trainer pushes in the background: a broadcast request is not for it.
        with pytest.raises(RemoteError, match="WaitPublished, not BroadcastVersion") as info:
            await service.broadcast_version(m.BroadcastVersion(version=1), None)
        assert info.value.code == "bad_request"
        # Only registered workers may be brought to a version.
        with pytest.raises(RemoteError) as info:
            await service.wait_published(
                m.WaitPublished(version=1, addresses=["tcp://evil:1"]), None)
        assert info.value.code == "forbidden"
    finally:
        await service.publisher.close()
