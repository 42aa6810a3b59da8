"""Trainer side of delta transfer: the base each worker holds, and what each push sends.

The trainer keeps, per worker, the last version it pushed there completely (``held``) and, per
version some worker holds, that version's tensors in the wire dtype (one copy of the weights in
the wire dtype while every worker is on the same base). A version goes to a worker

- in full when delta transfer is off, to a worker without a known base (new, restarted, or
  whose last push failed: a *lagging* worker), every ``full_every``-th version
  (``version % full_every == 0``: bounds how long an undetected divergence could last), or
  when the worker answers ``NeedFullVersion`` / ``checksum_mismatch`` to a delta;
- otherwise as a delta against the worker's held version (``rollart.weights.delta``), encoded
  once per (version, base) and shared by every worker on that base.

A worker reconstructs the delta only on top of the exact base it names (``WorkerBases``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from rollart.transport import messages as m
from rollart.transport.errors import RemoteError
from rollart.weights import delta
from rollart.weights.buckets import crc32_hex, tensor_to_frame

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: buckets encoded at once on the trainer, and delta buckets in flight to one worker (rebuilt
#: concurrently there): zstd and numpy release the GIL, so this many cores work per version.
#: Costs up to this many rebuilt buckets (``bucket_bytes`` each) of transient worker memory.
CODEC_THREADS = 8

DeltaMode = Literal["off", "xor", "sparse"]


@dataclass(frozen=True)
class EncodedBucket:
    """One bucket of a version as a delta: metadata of the rebuilt tensors, its CRC32 and the
    compressed payload (``payload`` bytes on the wire)."""

    metas: list[m.TensorMeta]
    checksum: str
    payload: bytes


def plan(named_tensors: Sequence[tuple[str, Any]], bucket_bytes: int) -> list[list[Any]]:
    """The bucket plan a full push uses (``InferenceClient.push_weights``), so full and delta
    buckets of one version have the same indices and tensor names."""
    from rollart.inference.client import plan_buckets

    return plan_buckets(named_tensors, bucket_bytes)


def encode_version(base: Sequence[tuple[str, torch.Tensor]],
                   new: Sequence[tuple[str, torch.Tensor]], encoding: delta.Encoding,
                   bucket_bytes: int) -> list[EncodedBucket]:
    """Encode every bucket of ``new`` against ``base`` (same names, dtypes and shapes).

    Raises:
        ValueError: a tensor of ``new`` missing from ``base`` or of another dtype / shape.
    """
    base_by_name = dict(base)

    def one(bucket: list[tuple[str, torch.Tensor]]) -> EncodedBucket:
        metas, frames, olds = [], [], []
        for name, t in bucket:
            old = base_by_name.get(name)
            if old is None or old.dtype != t.dtype or old.shape != t.shape:
                raise ValueError(f"tensor {name!r} has no base of the same dtype and shape")
            meta, frame = tensor_to_frame(name, t)
            metas.append(meta)
            frames.append(frame)
            olds.append(delta.tensor_bytes(old))
        itemsize = delta.bucket_itemsize([meta.dtype for meta in metas])
        payload = delta.encode(delta.concat(olds), delta.concat(frames), encoding, itemsize)
        return EncodedBucket(metas, crc32_hex(frames), payload)

    with ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="delta-encode") as pool:
        return list(pool.map(one, plan(new, bucket_bytes)))


class DeltaSender:
    """Chooses full or delta per worker and version, and sends deltas (see the module doc).

    Args:
        mode: ``off`` (always full), ``xor`` or ``sparse``.
        full_every: every version with ``version % full_every == 0`` is sent in full.
        bucket_bytes: bucket size, as the full push's.
    """

    def __init__(self, mode: DeltaMode, *, full_every: int, bucket_bytes: int) -> None:
        if mode not in ("off", "xor", "sparse"):
            raise ValueError(f"weight_delta must be off, xor or sparse, got {mode!r}")
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.mode: DeltaMode = mode
        self.full_every, self.bucket_bytes = full_every, bucket_bytes
        #: worker address -> last version pushed to it completely
        self.held: dict[str, int] = {}
        #: version -> its tensors in the wire dtype (kept while a worker holds it, or latest)
        self._versions: dict[int, Sequence[tuple[str, Any]]] = {}
        self._encoded: dict[tuple[int, int], asyncio.Task[list[EncodedBucket]]] = {}
        #: version -> pushes of it in flight (it becomes a worker's base when one completes)
        self._inflight: dict[int, int] = {}

    def remember(self, version: int, tensors: Sequence[tuple[str, Any]]) -> None:
        """Keep ``version``'s wire tensors as a possible base (called on publish)."""
        if self.mode != "off":
            self._versions[version] = tensors
            self._prune()

    def base_for(self, addr: str, version: int) -> int | None:
        """The base ``version`` goes to ``addr`` against, or ``None``: send it in full."""
        if self.mode == "off" or version % self.full_every == 0:
            return None
        base = self.held.get(addr)
        if base is None or base >= version or base not in self._versions:
            return None
        return base

    def done(self, addr: str, version: int) -> None:
        """``version`` is now complete on ``addr`` (staged)."""
        self.held[addr] = max(version, self.held.get(addr, version))
        self._prune()

    def forget(self, addr: str) -> None:
        """``addr`` holds no known base (failed push, new or removed worker)."""
        self.held.pop(addr, None)
        self._prune()

    def _prune(self) -> None:
        keep = set(self.held.values()) | set(self._inflight)
        if self._versions:
            keep.add(max(self._versions))
        for v in [v for v in self._versions if v not in keep]:
            del self._versions[v]
        for key in [k for k in self._encoded
                    if k[0] not in self._versions or k[1] not in self._versions]:
            self._encoded.pop(key)

    def _encoding(self) -> delta.Encoding:
        mode = self.mode
        if mode == "off":  # a delta is only built when deltas are on
            raise RuntimeError("weight_delta is off: no delta encoding")
        return mode

    def _encode(self, version: int, base: int) -> asyncio.Task[list[EncodedBucket]]:
        key = (version, base)
        task = self._encoded.get(key)
        if task is None:
            encoding = self._encoding()
            task = self._encoded[key] = asyncio.create_task(asyncio.to_thread(
                encode_version, self._versions[base], self._versions[version], encoding,
                self.bucket_bytes))
        return task

    async def push(self, addr: str, sink: Any, version: int,
                   tensors: Sequence[tuple[str, Any]]) -> tuple[int, bool]:
        """Bring ``addr`` to ``version``: a delta when it holds a usable base, else in full
        (also after a refused delta). Returns ``(bytes sent, delta used)``.

        Raises:
            RemoteError / PeerDeadError: the push failed (the worker's base is then unknown).
        """
        self._inflight[version] = self._inflight.get(version, 0) + 1
        try:
            sent = 0
            base = self.base_for(addr, version)
            if base is not None:
                try:
                    n, complete = await self.send_delta(sink, version, base)
                except ValueError as exc:  # a tensor's dtype / shape changed since the base
                    log.warning("version %d cannot be a delta against %d (%s): sending it in "
                                "full", version, base, exc)
                    n, complete = 0, False
                sent += n
                if complete:
                    self.done(addr, version)
                    return sent, True
            if self.mode == "off":
                await sink.push_weights(version, tensors, bucket_bytes=self.bucket_bytes)
            else:
                await sink.push_weights(version, tensors, bucket_bytes=self.bucket_bytes,
                                        keep_as_base=True)
            self.done(addr, version)
            return sent + sum(t.numel() * t.element_size() for _, t in tensors), False
        except BaseException:
            self.forget(addr)
            raise
        finally:
            self._inflight[version] -= 1
            if not self._inflight[version]:
                del self._inflight[version]
            self._prune()

    async def send_delta(self, sink: Any, version: int, base: int) -> tuple[int, bool]:
        """Send ``version`` to ``sink`` as a delta against ``base``.

        Returns ``(payload bytes sent, complete)``; not complete when the worker needs the
        version in full (it answered ``NeedFullVersion`` or ``checksum_mismatch``: its base
        differs from the trainer's).

        Raises:
            RemoteError / PeerDeadError: any other failure of a bucket.
        """
        buckets = await asyncio.shield(self._encode(version, base))
        name = getattr(sink, "name", sink)
        slots = asyncio.Semaphore(CODEC_THREADS)
        refused: list[str] = []

        async def one(index: int, b: EncodedBucket) -> int:
            msg = m.WeightDelta(version=version, base_version=base, bucket_index=index,
                                num_buckets=len(buckets), tensors=b.metas, checksum=b.checksum,
                                encoding=self._encoding())
            async with slots:
                if refused:  # the version goes in full anyway: stop sending deltas
                    return 0
                try:
                    reply = await sink.push_weight_delta(msg, b.payload)
                except RemoteError as exc:
                    if exc.code != "checksum_mismatch":
                        raise
                    refused.append(f"bucket {index} fails its checksum ({exc})")
                    return len(b.payload)
                if isinstance(reply, m.NeedFullVersion):
                    refused.append(reply.reason)
            return len(b.payload)

        sent = sum(await asyncio.gather(*(one(i, b) for i, b in enumerate(buckets))))
        if refused:
            log.warning("%s: delta of version %d against %d refused (%s); sending it in full",
                        name, version, base, refused[0])
        return sent, not refused
