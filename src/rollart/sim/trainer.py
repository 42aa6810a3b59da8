"""SIMULATED trainer (the controller's ``TrainerBackend`` port).

A step sleeps ``rollart.sim.costs.train_step_s`` for the batch's tokens and bumps the version;
``push_weights`` streams the model's bytes to every worker as ``SimTensor`` buckets (each worker
charges ``bytes / link_bytes_per_s`` of its own link, in parallel). With ``egress_bytes_per_s``
(the trainer nodes' NICs together) the pushes to simulated workers share that egress fairly
instead: each of ``n`` concurrent pulls gets ``min(worker link, egress / n)``, so pushing to
many engines takes longer than pushing to one (the paper's trainer-side CPU store serves every
worker's pull, §6.3). No tensors exist.

With ``delta_bytes_fraction`` (``[trainer] weight_delta``, ``rollart.weights``) a version after
the first that is not a multiple of ``full_every`` moves only that fraction of the model's bytes
(the fraction is an input: ``benchmarks.weight_transfer`` measures it on real training runs),
after the trainer encoded it at ``delta_encode_bytes_per_s``, while each worker rebuilds it at
``delta_rebuild_bytes_per_s`` (bytes of the whole version per second; XOR + zstd, rates
measured by the caller; transfer and rebuild overlap, bucket by bucket); the apply still loads
the whole version (host to device).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from rollart.controller.ports import GenerationBackend, TrainResult
from rollart.sim import costs
from rollart.sim.hardware import HardwareProfile
from rollart.sim.models import ModelProfile


class _Stager(Protocol):
    """A worker that stages weights itself (``SimWorker``, ``InferenceClient``): the
    controller's ``GenerationBackend`` port does not declare ``push_weights``."""

    async def push_weights(self, version: int, named_tensors: Iterable[tuple[str, Any]], *,
                           bucket_bytes: int) -> None: ...


@dataclass(frozen=True)
class SimTensor:
    """Stands for a weight tensor of ``nbytes`` bytes (SIMULATED; no data)."""

    nbytes: int


class SimTrainer:
    """A SIMULATED trainer on ``num_gpus`` x ``hardware`` training ``model``.

    Args:
        bucket_bytes: weight bucket size (the paper streams ~1 GB buckets, §6.3).
        extra_forward: charge a forward pass for proximal / old logprobs (decoupled PPO):
            only with several optimizer steps per batch; with one (the real trainer's default,
            ``num_minibatches = 1``) it reads them off its training forward and skips the pass
            (``rollart.trainer.step``), hence the default False (6, not 8, FLOPs per parameter
            per token).
        weights: ``() -> [(name, tensor)]`` to push instead of ``SimTensor`` buckets of the
            model's size (real tensors, for workers behind a real ``InferenceClient``).
        time_scale: multiplies the simulated step time (0: train instantly).
        egress_bytes_per_s: shared trainer egress in bytes/s (None: each worker's own link
            alone bounds its push).
        delta_bytes_fraction: bytes of a delta version / bytes of a full one, in (0, 1]
            (None: every version in full); ``full_every``: versions sent in full;
            ``delta_encode_bytes_per_s`` / ``delta_rebuild_bytes_per_s``: the trainer's encode
            and a worker's rebuild rate of a delta version (bytes of the full version per
            second; None: free).
        push_needs_pause: the controller pushes at the pause point, blocking, as for a
            collective broadcast (default: overlapped with rollout).
        ref_forward: charge the reference model's forward pass (a KL term in the loss).
        Each sample is charged its causal attention FLOPs (``costs.train_step_s``).

    Attributes: ``version`` (updates applied), ``step_times_s`` (each step's simulated time),
    ``push_times_s`` (each push's duration, seconds).
    """

    def __init__(self, *, model: ModelProfile, hardware: HardwareProfile, num_gpus: int,
                 bucket_bytes: int = 1 << 30, extra_forward: bool = False,
                 eff: costs.Efficiency = costs.DEFAULT_EFFICIENCY,
                 weights: Callable[[], Iterable[tuple[str, Any]]] | None = None,
                 time_scale: float = 1.0, egress_bytes_per_s: float | None = None,
                 delta_bytes_fraction: float | None = None, full_every: int = 10,
                 delta_encode_bytes_per_s: float | None = None,
                 delta_rebuild_bytes_per_s: float | None = None,
                 push_needs_pause: bool = False, ref_forward: bool = False) -> None:
        if egress_bytes_per_s is not None and egress_bytes_per_s <= 0:
            raise ValueError(f"egress_bytes_per_s must be > 0, got {egress_bytes_per_s}")
        if delta_bytes_fraction is not None and not 0 < delta_bytes_fraction <= 1:
            raise ValueError(f"delta_bytes_fraction must be in (0, 1], got "
                             f"{delta_bytes_fraction}")
        rates = (delta_encode_bytes_per_s, delta_rebuild_bytes_per_s)
        if full_every < 1 or any(r is not None and r <= 0 for r in rates):
            raise ValueError(f"full_every must be >= 1 and the delta codec rates > 0, got "
                             f"{full_every}, {rates}")
        self.delta_bytes_fraction, self.full_every = delta_bytes_fraction, full_every
        self.delta_rebuild_bytes_per_s = delta_rebuild_bytes_per_s
        self.delta_encode_bytes_per_s = delta_encode_bytes_per_s
        #: versions pushed as deltas
        self.delta_versions: list[int] = []
        self.egress_bytes_per_s = egress_bytes_per_s
        if num_gpus < 1 or bucket_bytes < 1:
            raise ValueError(f"num_gpus and bucket_bytes must be >= 1, got {num_gpus}, "
                             f"{bucket_bytes}")
        self.model, self.hardware, self.num_gpus = model, hardware, num_gpus
        self.bucket_bytes, self.extra_forward, self.eff = bucket_bytes, extra_forward, eff
        self._weights, self.time_scale = weights, time_scale
        self.ref_forward = ref_forward
        self._version = 0
        self.step_times_s: list[float] = []
        self.push_times_s: list[float] = []
        self.num_tokens_trained = 0
        self.workers: list[GenerationBackend] = []
        #: True: the controller pushes at the pause point, blocking (not overlapped)
        self.push_needs_pause = push_needs_pause

    @property
    def version(self) -> int:
        return self._version

    async def train(self, samples: Sequence[Any]) -> TrainResult:
        """One simulated update over every token of ``samples`` (objects with ``num_tokens``,
        e.g. ``rollart.controller.buffer.sample.Sample``). Raises ``ValueError`` on an empty batch."""
        if not samples:
            raise ValueError("SimTrainer.train: empty batch")
        seq_lens = [int(s.num_tokens) for s in samples]
        num_tokens = sum(seq_lens)
        dur = self.time_scale * costs.train_step_s(
            self.model, self.hardware, num_tokens, num_gpus=self.num_gpus,
            extra_forward=self.extra_forward, ref_forward=self.ref_forward,
            seq_lens=seq_lens, eff=self.eff)
        await asyncio.sleep(dur)
        self._version += 1
        self.step_times_s.append(dur)
        self.num_tokens_trained += num_tokens
        return TrainResult(version=self._version,
                           metrics={"sim_train_s": dur, "num_tokens": float(num_tokens)})

    async def set_workers(self, workers: Sequence[GenerationBackend]) -> None:
        """Remember the workers later versions go to (``push_weights`` is given them too)."""
        self.workers = list(workers)

    def _buckets(self) -> Iterator[tuple[str, SimTensor]]:
        remaining = int(self.model.weight_bytes)
        i = 0
        while remaining > 0:
            n = min(self.bucket_bytes, remaining)
            yield f"bucket.{i}", SimTensor(n)
            remaining -= n
            i += 1

    async def push_weights(self, version: int, workers: Sequence[GenerationBackend]) -> None:
        """Stage ``version`` (must equal ``self.version``) on every worker, in parallel.

        Raises ``ValueError`` for another version.
        """
        if version != self._version:
            raise ValueError(f"SimTrainer.push_weights: version {version} is not the current "
                             f"{self._version}")
        loop = asyncio.get_running_loop()
        start = loop.time()
        live = [w for w in workers if not w.dead]
        if self._is_delta(version) and all(hasattr(w, "stage") for w in live):
            self.delta_versions.append(version)
            await asyncio.gather(*(self._shared_push(version, w, len(live)) for w in live))
        elif self.egress_bytes_per_s is not None and self._weights is None \
                and all(hasattr(w, "stage") for w in live):
            await asyncio.gather(*(self._shared_push(version, w, len(live)) for w in live))
        else:
            await asyncio.gather(*(
                cast(_Stager, w).push_weights(
                    version, self._weights() if self._weights else self._buckets(),
                    bucket_bytes=self.bucket_bytes)
                for w in live))
        self.push_times_s.append(loop.time() - start)

    def _is_delta(self, version: int) -> bool:
        return (self.delta_bytes_fraction is not None and self._weights is None
                and version > 1 and version % self.full_every != 0)

    async def _shared_push(self, version: int, worker: Any, concurrent: int) -> None:
        """Equal-sized pulls that start together share the egress equally to the end (each
        worker's own link alone without ``egress_bytes_per_s``); a delta version moves its
        fraction of the bytes, then the worker rebuilds the whole version."""
        nbytes = float(self.model.weight_bytes)
        rate = worker.hardware.link_bytes_per_s
        if self.egress_bytes_per_s is not None:
            rate = min(rate, self.egress_bytes_per_s / concurrent)
        seconds = costs.transfer_s(nbytes, rate)
        if self._is_delta(version):
            # As rollart.weights.sender does it: every bucket is encoded first, then buckets
            # travel CODEC_THREADS at a time while the worker rebuilds those that arrived.
            assert self.delta_bytes_fraction is not None
            enc, dec = self.delta_encode_bytes_per_s, self.delta_rebuild_bytes_per_s
            seconds = (nbytes / enc if enc else 0.0) + max(
                costs.transfer_s(nbytes * self.delta_bytes_fraction, rate),
                nbytes / dec if dec else 0.0)
        await asyncio.sleep(self.time_scale * seconds)
        if not worker.dead:
            worker.stage(version, nbytes)
