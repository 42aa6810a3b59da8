"""The trainer-service adapter: the controller's ``TrainerBackend`` over ``rollart serve-trainer``.

:class:`RemoteTrainer` adapts ``rollart.trainer.client.TrainerClient`` to the controller's
``TrainerBackend`` port: ``train`` sends the samples as ``TrainSample`` with their GRPO
advantages (:func:`to_train_samples`), ``push_weights`` returns once the trainer says the new
version is ready on the workers (the trainer pushes by itself after each step, so the transfer
overlaps rollout, paper §6.3, and it alone knows which workers each push reached).
:func:`trainable_problem` is the trainer's own sample validation, run by the controller before
a sample enters a batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, cast

import msgspec

from rollart.controller.buffer.sample import Sample
from rollart.controller.ports import GenerationBackend, TrainResult
from rollart.controller.training import advantages
from rollart.transport import messages as m
from rollart.transport.errors import RollartError


def to_train_samples(samples: Sequence[Sample]) -> list[m.TrainSample]:
    """The wire form of a batch, with GRPO advantages and each sample's domain. Raises
    ValueError (from ``TrainSample``) for a sample the trainer cannot use (e.g. no generated
    token)."""
    values = advantages.grpo_advantages(samples)
    out = []
    for s, a in zip(samples, values, strict=True):
        checked = s.__dict__.get(_CHECKED)
        if checked is not None and math.isfinite(a):
            # The arrays passed TrainSample's validation at completion and never change;
            # ``replace`` does not run it again (one pass over 32k tokens saved per sample,
            # on the event loop, while the batch is assembled).
            out.append(msgspec.structs.replace(checked, advantage=a))
        else:
            out.append(m.TrainSample(token_ids=_wire(s.token_ids), loss_mask=_wire(s.loss_mask),
                                     behaviour_logprobs=_wire(s.behaviour_logprobs),
                                     advantage=a, sample_id=s.sample_id,
                                     behaviour_versions=_wire(s.versions), domain=s.domain))
    return out


def _wire(view: object) -> bytes:
    """A ``Sample`` array as a ``TrainSample`` field, without a copy.

    ``TrainSample``'s fields are typed ``bytes`` (what decoding yields); at construction msgspec
    keeps any contiguous buffer as given, and ``Sample`` holds its arrays as memoryviews (its
    validation converts every input), so the view is passed as is.
    """
    return cast(bytes, view)


#: buffer reason of a sample the train path's last check refused
INVALID_SAMPLE_REASON = "invalid_sample"
#: key in a ``Sample``'s ``__dict__``: its ``TrainSample`` (advantage 0) once it passed
#: :func:`trainable_problem`
_CHECKED = "_rollart_trainable"


def trainable_problem(sample: Sample) -> str | None:
    """Why the trainer would refuse ``sample`` (``TrainSample``'s own validation: no generated
    token, a behaviour logprob not finite or > 0, a negative token id, ...), or ``None``.

    The controller checks each sample when its trajectory completes (a refused one fails the
    trajectory, reason ``invalid_sample``, and its slot is retried) and again for every batch
    (samples restored from a checkpoint skipped the first check): one bad sample is dropped,
    never the batch. Costs one vectorised pass over the sample's arrays, no copy; a sample
    that passed is remembered (its arrays never change: see ``Sample``), so the batch's check
    of a sample checked at completion costs nothing.
    """
    if sample.__dict__.get(_CHECKED) is not None:
        return None
    try:
        checked = m.TrainSample(token_ids=_wire(sample.token_ids),
                                loss_mask=_wire(sample.loss_mask),
                                behaviour_logprobs=_wire(sample.behaviour_logprobs),
                                advantage=0.0, sample_id=sample.sample_id,
                                behaviour_versions=_wire(sample.versions), domain=sample.domain)
    except ValueError as exc:
        return str(exc)
    sample.__dict__[_CHECKED] = checked  # views of the sample's arrays, no copy
    return None


class TrainerClientLike(Protocol):
    """What :class:`RemoteTrainer` needs of ``TrainerClient``."""

    async def train(self, version: int, samples: Sequence[m.TrainSample]) -> m.TrainResult: ...

    async def register_workers(self, addresses: Sequence[str]) -> None: ...

    async def set_workers(self, addresses: Sequence[str]) -> None: ...

    async def wait_published(self, version: int, addresses: Sequence[str] = ()) -> m.Published:
        ...

    async def broadcast_version(self, version: int) -> m.Published: ...


class RemoteTrainer:
    """``TrainerBackend`` over the trainer service.

    Args:
        client: a ``TrainerClient``.
        version: the trainer's version now (0 for a fresh run; the checkpoint's on resume).
        push_needs_pause: the trainer's ``weight_transfer`` is ``nccl`` / ``gloo`` (it
            broadcasts into the serving models): see ``TrainerBackend.push_needs_pause``.

    ``set_workers`` registers the workers' addresses with the trainer, which pushes every new
    version to them right after the step: the first call registers the run's workers
    (``RegisterWorkers``, once: the trainer sends weights to no other address), later calls
    re-send the set (``SetWorkers``, registered addresses only) if it changed (a dead worker
    was removed). ``push_weights`` asks the trainer ``WaitPublished(version, addresses)``: it
    waits for that version's push and pushes it itself to any of the workers the push did not
    reach (a resumed run's workers, a worker registered later); or, with ``push_needs_pause``,
    ``BroadcastVersion`` (the workers are paused). Raises ``RollartError`` naming live workers
    the transfer failed on.
    """

    def __init__(self, client: TrainerClientLike, *, version: int = 0,
                 push_needs_pause: bool = False) -> None:
        self.client = client
        self._version = version
        self._push_needs_pause = push_needs_pause
        self._addresses: list[str] | None = None
        #: last ``Published`` reply (bytes and seconds of the transfer)
        self.last_published: m.Published | None = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def push_needs_pause(self) -> bool:
        return self._push_needs_pause

    async def set_workers(self, workers: Sequence[GenerationBackend]) -> None:
        addresses = [w.address for w in workers]
        if self._addresses is None:
            await self.client.register_workers(addresses)
            self._addresses = addresses
        elif addresses != self._addresses:
            await self.client.set_workers(addresses)
            self._addresses = addresses

    async def train(self, samples: Sequence[Sample]) -> TrainResult:
        reply = await self.client.train(self._version, to_train_samples(samples))
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
        if self._push_needs_pause:
            published = await self.client.broadcast_version(version)
        else:
            published = await self.client.wait_published(version, self._addresses or [])
        if published.version != version:
            raise RollartError(f"trainer published version {published.version}, the "
                               f"controller expected {version}")
        self.last_published = published
        # A worker removed or found dead since may be among the failures; only live ones
        # matter (the controller re-routes the dead one's trajectories).
        live = {w.address for w in workers if not w.dead}
        failed = {a: why for a, why in published.failed.items()
                  if a in (self._addresses or []) and a in live}
        if failed:
            raise RollartError(f"weights of version {version} not staged on: {failed}")
