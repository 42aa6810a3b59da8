"""Worker side of delta transfer: which base versions a worker holds, and rebuilding a bucket.

A worker's bases are the versions whose checked buckets sit in its ``WeightStager`` (staged and
not yet applied, or the version it applied last, which it keeps once deltas are in use). The
bytes of a base are read back from those safetensors files, so no extra copy is held in memory:
the cost of keeping a base is one copy of the weights, in the wire dtype, in the staging
directory (``/dev/shm`` by default) on top of the engine's own. A worker whose trainer does not
send deltas (no ``WeightBucket.keep_as_base``, no ``WeightDelta``) keeps nothing after an
apply, as before delta transfer.

A ``WeightDelta`` is rebuilt only from the exact ``base_version`` it names; when that base (or
one of its tensors) is not held, the reply is ``NeedFullVersion`` and nothing changes. A rebuilt
bucket goes through the same checks as a full one (CRC32 of the rebuilt bytes, names and shapes
against the checkpoint) before it is staged: a wrong base or corrupted payload is refused with
``checksum_mismatch`` and the served weights are untouched. Rebuilding is a pure function of
base and payload, so a duplicated delta bucket stages the same bytes again and is applied at most
once (``ApplyWeights`` refuses a version not newer than the served one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np

from rollart.transport import messages as m
from rollart.transport.errors import RemoteError
from rollart.weights import delta
from rollart.weights.staging import WeightStager


class WorkerBases:
    """The base versions one worker can rebuild deltas from (a view over its stager).

    Args:
        stager: the worker's ``WeightStager``; staged versions are bases as they arrive.
    """

    #: delta buckets rebuilt at once: each holds ~4 copies of a bucket in memory (base read,
    #: decompressed delta, rebuilt bytes, staged tensors), so a trainer sending several buckets
    #: concurrently must not multiply that by its codec threads on the worker.
    REBUILD_SLOTS = 2

    def __init__(self, stager: WeightStager) -> None:
        self.stager = stager
        self._slots = asyncio.Semaphore(self.REBUILD_SLOTS)
        #: keep the applied version as a base (set by a ``WeightBucket.keep_as_base`` or the
        #: first ``WeightDelta`` received)
        self.keep_applied = False

    def note_full_bucket(self, msg: m.WeightBucket) -> None:
        """A full bucket arrived: ``keep_as_base`` says deltas will be rebuilt on its version."""
        self.keep_applied |= msg.keep_as_base

    def after_apply(self, version: int) -> None:
        """Discard staged versions made obsolete by applying ``version``; the applied one stays
        while deltas are in use (it is the base of the next delta)."""
        self.stager.discard_up_to(version - 1 if self.keep_applied else version)

    def read_base(self, version: int, names: Sequence[str]) -> list[np.ndarray] | str:
        """Bytes (``uint8``) of tensors ``names`` of base ``version``, or why they are not held."""
        from safetensors import safe_open

        staged = self.stager._versions.get(version)  # noqa: SLF001 - the stager's own index
        if staged is None:
            return f"base version {version} is not held (held: {self.stager.staged_versions()})"
        where = {n: path for path, ns in staged.buckets.values() for n in ns}
        if absent := [n for n in names if n not in where]:
            return f"tensor {absent[0]!r} of base version {version} is not held"
        found: dict[str, np.ndarray] = {}
        try:
            for path in dict.fromkeys(where[n] for n in names):
                with safe_open(str(path), framework="pt") as f:
                    for name in names:
                        if where[name] == path:
                            found[name] = delta.tensor_bytes(f.get_tensor(name))
        except OSError as exc:  # discarded by a concurrent apply: the base is gone
            return f"base version {version} was discarded ({exc})"
        return [found[n] for n in names]

    async def stage_delta(self, msg: m.WeightDelta, frames: Sequence[memoryview],
                          current: int) -> m.Ack | m.NeedFullVersion:
        """Rebuild one delta bucket against ``msg.base_version`` and stage it (at most
        ``REBUILD_SLOTS`` at once; see ``_stage_delta``)."""
        async with self._slots:
            return await self._stage_delta(msg, frames, current)

    async def _stage_delta(self, msg: m.WeightDelta, frames: Sequence[memoryview],
                           current: int) -> m.Ack | m.NeedFullVersion:
        """Rebuild one delta bucket against ``msg.base_version`` and stage it.

        Returns ``Ack`` once staged, or ``NeedFullVersion`` when the base is not held.

        Raises:
            RemoteError(code="stale_version"): ``msg.version <= current``.
            RemoteError(code="bad_request"): not exactly one frame, a tensor whose byte size
                differs from the base's (a changed dtype of another size or shape; the stager
                then checks names and shapes against the checkpoint), or a payload that does
                not decode.
            RemoteError(code="checksum_mismatch"): the rebuilt bytes do not match
                ``msg.checksum``; nothing is staged.
        """
        self.keep_applied = True
        if msg.version <= current:
            raise RemoteError("stale_version",
                              f"delta of version {msg.version}; serving version {current}")
        if len(frames) != 1:
            raise RemoteError("bad_request", f"WeightDelta carries {len(frames)} frames, not 1")
        names = [t.name for t in msg.tensors]
        base = await asyncio.to_thread(self.read_base, msg.base_version, names)
        if isinstance(base, str):
            return m.NeedFullVersion(version=msg.version, base_version=msg.base_version,
                                     reason=base)
        for meta, buf in zip(msg.tensors, base, strict=True):
            if buf.size != meta.nbytes:
                raise RemoteError("bad_request", f"tensor {meta.name!r}: {meta.nbytes} bytes in "
                                  f"version {msg.version}, {buf.size} in base {msg.base_version}"
                                  " (dtype or shape changed: send it in full)")
        itemsize = delta.bucket_itemsize([t.dtype for t in msg.tensors])
        try:
            rebuilt = await asyncio.to_thread(delta.decode, delta.concat(base), frames[0],
                                              msg.encoding, itemsize)
        except (delta.DeltaError, ValueError) as exc:  # ValueError: sizes not whole elements
            raise RemoteError("bad_request", f"bucket {msg.bucket_index} of version "
                              f"{msg.version}: {exc}") from None
        views, offset = [], 0
        for meta in msg.tensors:
            views.append(rebuilt[offset:offset + meta.nbytes].data)
            offset += meta.nbytes
        bucket = m.WeightBucket(version=msg.version, bucket_index=msg.bucket_index,
                                num_buckets=msg.num_buckets, tensors=msg.tensors,
                                checksum=msg.checksum)
        await self.stager.stage(bucket, views, current)
        return m.Ack(detail=f"rebuilt bucket {msg.bucket_index + 1}/{msg.num_buckets} of "
                     f"version {msg.version} from base {msg.base_version}")
