"""The controller's side of training: GRPO advantages and the trainer-service adapter.

:func:`grpo_advantages` turns a batch of scored samples (whole groups) into per-sample
advantages, and :class:`RemoteTrainer` adapts ``rollart.trainer.client.TrainerClient`` (the
``rollart serve-trainer`` process) to the controller's ``TrainerBackend`` port: ``train`` sends
the samples as ``TrainSample`` with their advantages, ``push_weights`` waits until the trainer
has staged the new version on every worker (the trainer pushes by itself after each step, so the
transfer overlaps rollout, paper §6.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rollart.controller.ports import GenerationBackend, TrainResult
from rollart.controller.sample import Sample
from rollart.transport import messages as m
from rollart.transport.errors import RollartError


def grpo_advantages(samples: Sequence[Sample]) -> list[float]:
    """GRPO advantages of a batch of whole groups, one per sample, in ``samples`` order.

    Delegates to :func:`rollart.trainer.loss.grpo_advantages` (Shao et al. 2024, DeepSeekMath
    §4.1; all-equal groups get exactly 0): the batch holds only kept samples, so failed or
    cancelled members never enter a group's baseline. Groups are keyed by ``sample.group_key``.
    """
    import torch

    from rollart.trainer.loss import grpo_advantages as _grpo

    keys: dict[str, int] = {}
    group_ids = torch.tensor([keys.setdefault(s.group_key, len(keys)) for s in samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    return _grpo(rewards, group_ids=group_ids).tolist()


def to_train_samples(samples: Sequence[Sample]) -> list[m.TrainSample]:
    """The wire form of a batch, with GRPO advantages. Raises ValueError (from
    ``TrainSample``) for a sample the trainer cannot use (e.g. no generated token)."""
    advantages = grpo_advantages(samples)
    return [
        m.TrainSample(token_ids=s.token_ids, loss_mask=s.loss_mask,
                      behaviour_logprobs=s.behaviour_logprobs, advantage=a, sample_id=s.sample_id)
        for s, a in zip(samples, advantages, strict=True)
    ]


#: buffer reason of a sample the train path's last check refused
INVALID_SAMPLE_REASON = "invalid_sample"


def trainable_problem(sample: Sample) -> str | None:
    """Why the trainer would refuse ``sample`` (``TrainSample``'s own validation: no generated
    token, a behaviour logprob not finite or > 0, a negative token id, ...), or ``None``.

    The controller checks each sample when its trajectory completes (a refused one fails the
    trajectory, reason ``invalid_sample``, and its slot is retried) and again for every batch
    (samples restored from a checkpoint skipped the first check): one bad sample is dropped,
    never the batch. Costs one vectorised pass over the sample's arrays, no copy.
    """
    try:
        m.TrainSample(token_ids=sample.token_ids, loss_mask=sample.loss_mask,
                      behaviour_logprobs=sample.behaviour_logprobs, advantage=0.0,
                      sample_id=sample.sample_id)
    except ValueError as exc:
        return str(exc)
    return None


class TrainerClientLike(Protocol):
    """What :class:`RemoteTrainer` needs of ``TrainerClient``."""

    async def train(self, step: int, samples: Sequence[m.TrainSample]) -> m.TrainResult: ...

    async def register_workers(self, addresses: Sequence[str]) -> None: ...

    async def set_workers(self, addresses: Sequence[str]) -> None: ...

    async def wait_published(self, version: int) -> m.Published: ...

    async def publish_latest(self, addresses: Sequence[str]) -> m.Published: ...


class RemoteTrainer:
    """``TrainerBackend`` over the trainer service.

    Args:
        client: a ``TrainerClient``.
        version: the trainer's version now (0 for a fresh run; the checkpoint's on resume).

    ``set_workers`` registers the workers' addresses (``InferenceClient.address``) with the
    trainer, which pushes every new version to them right after the step: the first call
    registers the run's workers (``RegisterWorkers``, once: the trainer sends weights to no
    other address); ``push_weights`` re-sends the set (``SetWorkers``, registered addresses
    only) if it changed (a dead worker was removed) and waits until
    ``version`` is staged. Workers the trainer did not push ``version`` to after its step (a
    resumed run's workers, a worker registered later) get the trainer's latest weights pushed to
    them directly. Raises ``RollartError`` naming live workers the push failed on.

    ``push_needs_pause`` (the trainer's ``weight_transfer`` is ``nccl`` / ``gloo``): nothing is
    pushed after a step; ``push_weights`` asks the trainer to broadcast ``version`` into the
    workers' models, so the controller calls it only with the workers paused.
    """

    def __init__(self, client: TrainerClientLike, *, version: int = 0,
                 push_needs_pause: bool = False) -> None:
        self.client = client
        self._version = version
        #: the trainer broadcasts into the serving models (``nccl`` / ``gloo`` weight transfer):
        #: ``push_weights`` only when the workers are paused, and it loads, not stages
        self.push_needs_pause = push_needs_pause
        self._addresses: list[str] | None = None
        #: version -> addresses registered when the trainer produced (and so pushed) it
        self._pushed_to: dict[int, set[str]] = {}
        #: last ``Published`` reply (bytes and seconds of the transfer)
        self.last_published: m.Published | None = None

    @property
    def version(self) -> int:
        return self._version

    async def set_workers(self, workers: Sequence[GenerationBackend]) -> None:
        addresses = [getattr(w, "address") for w in workers]  # noqa: B009 - not in the port
        if self._addresses is None:
            await self.client.register_workers(addresses)
            self._addresses = addresses
        elif addresses != self._addresses:
            await self.client.set_workers(addresses)
            self._addresses = addresses

    async def train(self, samples: Sequence[Sample]) -> TrainResult:
        registered = set(self._addresses or [])
        reply = await self.client.train(self._version, to_train_samples(samples))
        self._pushed_to = {reply.version: registered}
        if reply.version != self._version + 1:
            raise RollartError(
                f"trainer answered version {reply.version} for a step at {self._version}"
            )
        self._version = reply.version
        return TrainResult(version=reply.version,
                           metrics={**reply.metrics, "trainer_step_s": reply.train_time_s},
                           agreement=reply.agreement, dropped=reply.dropped)

    async def push_weights(self, version: int, workers: Sequence[GenerationBackend]) -> None:
        await self.set_workers(workers)
        missing = [a for a in self._addresses or [] if a not in self._pushed_to.get(version, ())]
        if self.push_needs_pause:
            published = await self.client.wait_published(version)
        elif missing:
            published = await self.client.publish_latest(missing)
            if published.version != version:
                raise RollartError(f"trainer's latest version is {published.version}, the "
                                   f"controller expected {version}")
            self._pushed_to.setdefault(version, set()).update(missing)
        else:
            published = await self.client.wait_published(version)
        self.last_published = published
        # A worker removed or found dead since may be among the failures; only live ones
        # matter (the controller re-routes the dead one's trajectories).
        live = {getattr(w, "address") for w in workers if not w.dead}  # noqa: B009
        failed = {a: why for a, why in published.failed.items()
                  if a in (self._addresses or []) and a in live}
        if failed:
            raise RollartError(f"weights of version {version} not staged on: {failed}")
