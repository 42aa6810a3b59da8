"""GRPO advantages and the trainer-service adapter (with a fake TrainerClient)."""

from __future__ import annotations

import math
import subprocess
import sys

import msgspec
import pytest

from helpers.fakes import FakeWorker
from rollart.controller.buffer.sample import Sample
from rollart.controller.training.advantages import grpo_advantages
from rollart.controller.training.remote import RemoteTrainer, to_train_samples
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RollartError


def sample(sid: str, group: str, reward: float, n_gen: int = 2) -> Sample:
    return Sample(sample_id=sid, group_key=group, token_ids=[5] * (3 + n_gen),
                  loss_mask=[0, 0, 0] + [1] * n_gen, behaviour_logprobs=[0.0] * 3 + [-1.0] * n_gen,
                  versions=[-1] * 3 + [0] * n_gen, reward=reward)


def test_grpo_advantages_are_group_relative() -> None:
    batch = [sample("a", "g1", 1.0), sample("b", "g1", 0.0), sample("c", "g2", 2.0),
             sample("d", "g2", 2.0)]
    std = grpo_advantages(batch)
    assert std[0] == pytest.approx(1.0, abs=1e-5) and std[1] == pytest.approx(-1.0, abs=1e-5)
    assert std[2] == std[3] == 0.0  # no signal in a group with equal rewards
    # Groups are matched by key, not by position.
    shuffled = [batch[2], batch[0], batch[3], batch[1]]
    assert grpo_advantages(shuffled) == [std[2], std[0], std[3], std[1]]


def test_to_train_samples_carries_tokens_and_rejects_unusable_samples() -> None:
    (ts,) = to_train_samples([sample("a", "g", 1.0)])
    assert tb.view_u8(ts.loss_mask).tolist() == [0, 0, 0, 1, 1]
    assert ts.sample_id == "a" and ts.advantage == 0.0
    # Over the wire each per-token field is one bin of the sample's own bytes.
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ts), type=m.TrainSample)
    assert tb.view_i32(wire.token_ids).tolist() == [5] * 5 and wire.num_loss_tokens == 2
    # One behaviour logprob per generated token; the per-token form is built on demand.
    assert tb.view_f32(wire.behaviour_logprobs).tolist() == [-1.0] * 2
    assert wire.full_logprobs().tolist() == [0.0] * 3 + [-1.0] * 2
    with pytest.raises(ValueError, match="no generated token"):
        to_train_samples([sample("a", "g", 1.0, n_gen=0)])


class FakeTrainerClient:
    def __init__(self, failed: dict[str, str] | None = None) -> None:
        self.version = 0
        self.workers: list[list[str]] = []
        self.batches: list[list[m.TrainSample]] = []
        self.failed = failed or {}
        self.waited: list[tuple[int, list[str]]] = []
        self.broadcast: list[int] = []

    async def train(self, version, samples):
        assert version == self.version, "the batch names the trainer's version"
        self.batches.append(list(samples))
        self.version += 1
        return m.TrainResult(step=version, version=self.version, metrics={"loss": 0.5},
                             train_time_s=1.5)

    async def register_workers(self, addresses):
        self.registered = list(addresses)
        self.workers.append(list(addresses))

    async def set_workers(self, addresses):
        assert set(addresses) <= set(self.registered), "only registered workers"
        self.workers.append(list(addresses))

    async def wait_published(self, version, addresses=()):
        self.waited.append((version, list(addresses)))
        return m.Published(version=version, total_s=0.1, num_bytes=10, failed=self.failed)

    async def broadcast_version(self, version):
        self.broadcast.append(version)
        return m.Published(version=version, total_s=0.2, num_bytes=10, failed=self.failed)


def worker(name: str) -> FakeWorker:
    w = FakeWorker(name)
    w.address = f"tcp://{name}"  # type: ignore[attr-defined]
    return w


async def test_remote_trainer_trains_and_waits_for_publication() -> None:
    client = FakeTrainerClient()
    trainer = RemoteTrainer(client)
    w1, w2 = worker("w1"), worker("w2")
    await trainer.set_workers([w1, w2])
    result = await trainer.train([sample("a", "g", 1.0), sample("b", "g", 0.0)])
    assert result.version == trainer.version == 1
    assert result.metrics == {"loss": 0.5, "trainer_step_s": 1.5}
    # rewards 1, 0: mean 0.5, population std 0.5 -> +-0.5 / (0.5 + 1e-6)
    assert [s.advantage for s in client.batches[0]] == pytest.approx([1.0, -1.0], abs=1e-5)
    await trainer.push_weights(1, [w1, w2])
    assert client.workers == [["tcp://w1", "tcp://w2"]]  # registered once
    assert client.registered == ["tcp://w1", "tcp://w2"]
    await trainer.push_weights(1, [w2])  # w1 was removed: the push set shrinks
    assert client.workers[-1] == ["tcp://w2"]
    assert client.registered == ["tcp://w1", "tcp://w2"]  # never registered again
    assert math.isclose(trainer.last_published.total_s, 0.1)


async def test_remote_trainer_reports_failed_pushes_to_live_workers() -> None:
    client = FakeTrainerClient(failed={"tcp://w2": "timeout", "tcp://gone": "dead"})
    trainer = RemoteTrainer(client)
    await trainer.set_workers([worker("w1"), worker("w2")])
    await trainer.train([sample("a", "g", 1.0), sample("b", "g", 0.0)])
    with pytest.raises(RollartError, match="tcp://w2"):
        await trainer.push_weights(1, [worker("w1"), worker("w2")])
    client.failed = {"tcp://gone": "dead"}
    await trainer.push_weights(1, [worker("w1"), worker("w2")])


async def test_the_controller_asks_the_trainer_and_keeps_no_push_bookkeeping() -> None:
    client = FakeTrainerClient()
    client.version = 2  # restored from a checkpoint; workers start from the base weights
    trainer = RemoteTrainer(client, version=2)
    w1 = worker("w1")
    # One question, with the workers: the trainer knows whom its pushes reached.
    await trainer.push_weights(2, [w1])
    assert client.waited == [(2, ["tcp://w1"])] and client.broadcast == []
    assert trainer.last_published.version == 2
    await trainer.train([sample("a", "g", 1.0), sample("b", "g", 0.0)])
    await trainer.push_weights(3, [w1])
    assert client.waited[-1] == (3, ["tcp://w1"])
    assert not hasattr(trainer, "_pushed_to")


async def test_a_collective_trainer_is_asked_to_broadcast_and_says_it_needs_a_pause() -> None:
    client = FakeTrainerClient()
    trainer = RemoteTrainer(client, push_needs_pause=True)
    assert trainer.push_needs_pause and not RemoteTrainer(client).push_needs_pause
    await trainer.set_workers([worker("w1")])
    await trainer.train([sample("a", "g", 1.0), sample("b", "g", 0.0)])
    await trainer.push_weights(1, [worker("w1")])
    assert client.broadcast == [1] and client.waited == []


async def test_a_published_version_other_than_asked_is_an_error() -> None:
    client = FakeTrainerClient()
    trainer = RemoteTrainer(client)

    async def wrong(version, addresses=()):
        return m.Published(version=version + 1, total_s=0.0, num_bytes=0)

    client.wait_published = wrong  # type: ignore[method-assign]
    with pytest.raises(RollartError, match="published version 1, the controller expected 0"):
        await trainer.push_weights(0, [worker("w1")])


def test_grpo_advantages_of_an_empty_batch_and_of_a_non_finite_reward() -> None:
    assert grpo_advantages([]) == []
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages([sample("a", "g", float("nan")), sample("b", "g", 0.0)])


def test_the_controller_does_not_import_torch() -> None:
    # Importing the controller and computing a batch's advantages (torch's job until now).
    code = ("import sys; from types import SimpleNamespace as S; "
            "import rollart.controller.controller, rollart.controller.training.weightsync; "
            "from rollart.controller.training.advantages import grpo_advantages; "
            "assert grpo_advantages([S(group_key='g', reward=1.0), "
            "S(group_key='g', reward=0.0)]) != [0.0, 0.0]; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300)
    assert out.stdout.strip() == "False", out.stderr


def test_batch_reuses_the_completion_check_and_still_checks_the_advantage(monkeypatch) -> None:
    from rollart.controller.training.remote import trainable_problem

    checked, unchecked = sample("a", "g", 1.0), sample("b", "g", 0.0)
    assert trainable_problem(checked) is None
    validations = []

    class CountingTrainSample(m.TrainSample):
        def __post_init__(self) -> None:
            validations.append(self.sample_id)
            super().__post_init__()

    monkeypatch.setattr(m, "TrainSample", CountingTrainSample)
    a, b = to_train_samples([checked, unchecked])
    assert validations == ["b"]  # the sample checked at completion is not validated again
    assert a.advantage == pytest.approx(1.0, abs=1e-5) and b.advantage < 0
    assert tb.view_u8(a.loss_mask).tolist() == [0, 0, 0, 1, 1] and a.sample_id == "a"
    monkeypatch.setattr("rollart.controller.training.advantages.grpo_advantages",
                        lambda samples: [float("nan")] * len(samples))
    with pytest.raises(ValueError, match="advantage nan not finite"):
        to_train_samples([checked])  # a non-finite advantage still fails the checked sample
