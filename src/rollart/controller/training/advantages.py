"""The controller's side of training: GRPO advantages and the trainer-service adapter.

:func:`grpo_advantages` turns a batch of scored samples (whole groups) into per-sample
advantages (numpy: the controller process never imports torch), and :class:`RemoteTrainer`
adapts ``rollart.trainer.client.TrainerClient`` (the ``rollart serve-trainer`` process) to the
controller's ``TrainerBackend`` port: ``train`` sends the samples as ``TrainSample`` with their
advantages, ``push_weights`` returns once the trainer says the new version is ready on the workers
(the trainer pushes by itself after each step, so the transfer overlaps rollout, paper §6.3, and
it alone knows which workers each push reached).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np

from rollart.controller.buffer.sample import Sample
from rollart.controller.ports import GenerationBackend, TrainResult
from rollart.transport import messages as m
from rollart.transport.errors import RollartError


def grpo_advantages(samples: Sequence[Sample], eps: float = 1e-6) -> list[float]:
    """GRPO advantages of a batch of whole groups, one per sample, in ``samples`` order.

    ``(r - mean_g) / (std_g + eps)`` per group (Shao et al. 2024, DeepSeekMath §4.1), with the
    population std (divide by n) in float64; a group whose rewards are all equal (or of one
    member) gets exactly 0. The same values as ``rollart.trainer.loss.grpo_advantages`` (the
    trainer's torch version, which also handles invalid members); here every sample is valid:
    the batch holds only kept samples, so failed or cancelled members never enter a group's
    baseline. Groups are keyed by ``sample.group_key``.

    Raises:
        ValueError: a reward is NaN or infinite.
    """
    keys: dict[str, int] = {}
    n = len(samples)
    inverse = np.fromiter((keys.setdefault(s.group_key, len(keys)) for s in samples),
                          dtype=np.intp, count=n)
    r = np.fromiter((s.reward for s in samples), dtype=np.float64, count=n)
    if not np.isfinite(r).all():
        raise ValueError("rewards of valid members must be finite")
    num_groups = len(keys)
    count = np.bincount(inverse, minlength=num_groups).astype(np.float64)
    mean = np.bincount(inverse, weights=r, minlength=num_groups) / np.maximum(count, 1.0)
    centered = r - mean[inverse]
    var = np.bincount(inverse, weights=centered * centered, minlength=num_groups) \
        / np.maximum(count, 1.0)
    std = np.sqrt(var)
    # "All equal" is decided exactly (max == min), as the trainer's version does: rounding of
    # the mean could otherwise leave a tiny r - mean divided by a tiny std.
    gmax = np.full(num_groups, -np.inf)
    gmin = np.full(num_groups, np.inf)
    np.maximum.at(gmax, inverse, r)
    np.minimum.at(gmin, inverse, r)
    informative = (count >= 2) & (gmax > gmin)
    adv = np.where(informative[inverse], centered / (std[inverse] + eps), 0.0)
    return [float(a) for a in adv]


def to_train_samples(samples: Sequence[Sample]) -> list[m.TrainSample]:
    """The wire form of a batch, with GRPO advantages and each sample's domain. Raises
    ValueError (from ``TrainSample``) for a sample the trainer cannot use (e.g. no generated
    token)."""
    advantages = grpo_advantages(samples)
    out = []
    for s, a in zip(samples, advantages, strict=True):
        checked = s.__dict__.get(_CHECKED)
        if checked is not None and math.isfinite(a):
            # The arrays passed TrainSample's validation at completion and never change;
            # ``replace`` does not run it again (one pass over 32k tokens saved per sample,
            # on the event loop, while the batch is assembled).
            out.append(msgspec.structs.replace(checked, advantage=a))
        else:
            out.append(m.TrainSample(token_ids=s.token_ids, loss_mask=s.loss_mask,
                                     behaviour_logprobs=s.behaviour_logprobs, advantage=a,
                                     sample_id=s.sample_id, behaviour_versions=s.versions,
                                     domain=s.domain))
    return out


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
        checked = m.TrainSample(token_ids=sample.token_ids, loss_mask=sample.loss_mask,
                                behaviour_logprobs=sample.behaviour_logprobs, advantage=0.0,
                                sample_id=sample.sample_id, behaviour_versions=sample.versions,
                                domain=sample.domain)
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
