"""Client of one inference worker (``rollart serve-inference``), used by the controller.

Failure semantics follow ``rollart.transport.errors``: ``RemoteError`` (this request failed, the
worker keeps serving) vs ``PeerDeadError`` (the worker is gone; every later call fails too).
A ``generate`` whose awaiting task is cancelled, or whose reply times out, sends ``Abort`` for its
request so the worker stops spending compute on a result nobody will read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal, TypeVar

import msgspec

from rollart.transport import messages as m
from rollart.transport.errors import PeerDeadError, RemoteError, RemoteTimeoutError
from rollart.transport.rpc import RpcClient
from rollart.transport.security import Auth
from rollart.weights.buckets import encode_bucket, plan_buckets

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

R = TypeVar("R", bound=m.Msg)


class InferenceClient:
    """Calls one inference worker over ZeroMQ. Create it inside a running event loop.

    Args:
        address: the worker's ZeroMQ endpoint (what it wrote to its ``--ready-file``).
        auth: the run's key (``rollart.transport.security.RunKey``) or ``INSECURE``, as the
            worker was started with (else it never answers).
        name: worker name used in errors and logs.
        default_timeout_s: timeout of a call that gives none (seconds; a ``generate`` waits for
            the whole continuation, so keep this above the longest expected generation).
        heartbeat_interval_s, liveness_timeout_s: see ``RpcClient``; a worker silent for
            ``liveness_timeout_s`` is declared dead (``PeerDeadError``).
        abort_timeout_s: timeout of the background ``Abort`` sent for a cancelled generate.

    Attributes:
        last_stats: the most recent ``WorkerStats`` seen in any reply (``None`` before the first),
            its ``paused`` flag set by an acknowledged ``pause`` and cleared by an acknowledged
            ``resume`` (their replies carry no stats; a pool read as paused after its resume
            would hold online affinity still until the next generate reply).
    """

    def __init__(
        self,
        address: str,
        *,
        auth: Auth,
        name: str,
        default_timeout_s: float = 600.0,
        heartbeat_interval_s: float = 2.0,
        liveness_timeout_s: float = 10.0,
        abort_timeout_s: float = 10.0,
    ) -> None:
        self.name = name
        self.address = address
        self.last_stats: m.WorkerStats | None = None
        self._abort_timeout_s = abort_timeout_s
        self._rpc = RpcClient(
            address,
            auth=auth,
            name=name,
            default_timeout_s=default_timeout_s,
            heartbeat_interval_s=heartbeat_interval_s,
            liveness_timeout_s=liveness_timeout_s,
        )
        self._background: set[asyncio.Task] = set()

    @property
    def dead(self) -> bool:
        """True once the worker was declared dead or the client closed."""
        return self._rpc.dead

    def mark_dead(self, reason: str) -> None:
        """Declare the worker dead (e.g. its process exited): pending and later calls raise
        ``PeerDeadError`` at once instead of after the liveness timeout."""
        self._rpc.mark_dead(reason)

    def _expect(self, msg: m.Msg, reply: m.Msg, expect: type[R]) -> R:
        if not isinstance(reply, expect):
            raise RemoteError(
                "bad_request",
                f"{self.name}: expected {expect.__name__} in reply to {type(msg).__name__}, "
                f"got {type(reply).__name__}",
            )
        stats = reply if isinstance(reply, m.WorkerStats) else getattr(reply, "stats", None)
        if isinstance(stats, m.WorkerStats):
            self.last_stats = stats
        return reply

    async def _call(
        self,
        msg: m.Msg,
        expect: type[R],
        *,
        buffers=(),
        timeout_s: float | None = None,
    ) -> R:
        reply, _ = await self._rpc.call(msg, buffers=buffers, timeout_s=timeout_s)
        return self._expect(msg, reply, expect)

    async def generate(
        self, request: m.Generate, *, timeout_s: float | None = None
    ) -> m.GenerateResult:
        """Generate one continuation.

        Returns:
            ``GenerateResult``: ``token_ids`` / ``logprobs`` / ``versions`` of equal length.
        Raises:
            RemoteError: the worker rejected or failed this request (``engine_error``,
                ``bad_request``); ``RemoteTimeoutError`` after ``timeout_s`` (an ``Abort`` is
                sent in the background).
            PeerDeadError: the worker is dead.
            asyncio.CancelledError: the awaiting task was cancelled (an ``Abort`` is sent in the
                background before it propagates).
        """
        # The RPC future is awaited here, not through ``_call``: a coroutine layer per call
        # is one more GC-tracked object alive for the whole generation (at 10k trajectories these dominated GC time).
        call_id, fut = self._rpc.submit_call(request, timeout_s=timeout_s)
        try:
            reply, _ = await fut
        except asyncio.CancelledError:
            self._rpc.forget(call_id)  # out of the pending table now, not at its reply
            self._abort_in_background(request.request_id)
            raise
        except RemoteTimeoutError:
            self._abort_in_background(request.request_id)
            raise
        finally:
            del fut  # see RpcClient.call: an error is then freed without the cycle collector
        return self._expect(request, reply, m.GenerateResult)

    def _abort_in_background(self, request_id: str) -> None:
        if self.dead:
            return
        task = asyncio.get_running_loop().create_task(self._quiet_abort(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _quiet_abort(self, request_id: str) -> None:
        try:
            await self._call(m.Abort(request_id=request_id), m.Ack, timeout_s=self._abort_timeout_s)
        except (RemoteError, PeerDeadError) as exc:
            log.warning("%s: abort of %s failed: %s", self.name, request_id, exc)

    async def abort(self, request_id: str) -> None:
        """Abort one request (idempotent: a finished or unknown id is fine). Its pending
        ``generate`` returns with ``finish_reason="abort"`` and the tokens it had."""
        await self._call(m.Abort(request_id=request_id), m.Ack)

    async def pause(self, mode: Literal["keep", "abort"] = "keep") -> None:
        """Pause generation. ``keep``: in-flight requests wait with their KV cache; ``abort``:
        they are aborted and return what they produced. New requests queue until ``resume``."""
        await self._call(m.Pause(mode=mode), m.Ack)
        self._set_paused(True)

    async def resume(self) -> None:
        """Resume generation after ``pause``."""
        await self._call(m.Resume(), m.Ack)
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        if self.last_stats is not None and self.last_stats.paused != paused:
            self.last_stats = msgspec.structs.replace(self.last_stats, paused=paused)

    async def stats(self) -> m.WorkerStats:
        """The worker's current ``WorkerStats`` (also stored in ``last_stats``)."""
        return await self._call(m.GetStats(), m.WorkerStats)

    async def push_weights(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        bucket_bytes: int,
        timeout_s: float | None = None,
        keep_as_base: bool = False,
    ) -> None:
        """Send weight version ``version`` in buckets of at most ``bucket_bytes`` bytes.

        Tensors use checkpoint (Hugging Face) names; any dtype, on any device (copied to host
        one bucket at a time). Each bucket carries a CRC32 of its bytes. Nothing is applied
        until ``apply_weights(version)``. ``keep_as_base``: the worker keeps the version after
        applying it, as the base of deltas (``rollart.weights``).

        Raises:
            RemoteError: ``stale_version`` (version not newer than the worker's),
                ``checksum_mismatch``, ``bad_request`` (unknown tensor name or shape).
            ValueError: ``bucket_bytes <= 0`` or no tensors.
        """
        buckets = plan_buckets(named_tensors, bucket_bytes)
        if not buckets:
            raise ValueError(f"push_weights(version={version}): no tensors")
        for index, bucket in enumerate(buckets):
            metas, frames, checksum = encode_bucket(bucket)
            msg = m.WeightBucket(
                version=version,
                bucket_index=index,
                num_buckets=len(buckets),
                tensors=metas,
                checksum=checksum,
                keep_as_base=keep_as_base,
            )
            await self._call(msg, m.Ack, buffers=frames, timeout_s=timeout_s)

    async def push_weight_delta(self, msg: m.WeightDelta, payload: bytes, *,
                                timeout_s: float | None = None) -> m.Ack | m.NeedFullVersion:
        """Send one delta bucket (``rollart.weights.sender``); its payload is the one frame.

        Returns ``Ack`` (rebuilt and staged) or ``NeedFullVersion`` (base not held).

        Raises:
            RemoteError: ``checksum_mismatch`` (rebuilt bytes differ: nothing staged),
                ``stale_version``, ``bad_request``.
        """
        reply, _ = await self._rpc.call(msg, buffers=[payload], timeout_s=timeout_s)
        if not isinstance(reply, m.Ack | m.NeedFullVersion):
            raise RemoteError("bad_request", f"{self.name}: expected Ack or NeedFullVersion in "
                              f"reply to WeightDelta, got {type(reply).__name__}")
        return reply

    async def apply_weights(
        self, version: int, *, reprefill: bool = False, timeout_s: float | None = None
    ) -> m.WeightsApplied:
        """Apply the staged ``version``; returns once the engine serves it.

        ``reprefill``: recompute in-flight requests' KV cache under the new weights.

        Raises:
            RemoteError: ``stale_version``, ``incomplete_version`` (a bucket or tensor missing),
                ``engine_error`` (the reload failed; the worker then exits).
        """
        return await self._call(
            m.ApplyWeights(version=version, reprefill=reprefill),
            m.WeightsApplied,
            timeout_s=timeout_s,
        )

    async def weight_transfer(
        self,
        msg: m.WeightTransferInit | m.WeightTransferStart | m.WeightTransferUpdate
        | m.WeightTransferFinish | m.WeightTransferShutdown,
        *,
        timeout_s: float,
    ) -> m.Ack:
        """One step of a collective weight update (see ``rollart.weights.collective``).

        Raises:
            RemoteError: the worker refused or failed that step (``engine_error`` after a
                partial load is also fatal for the worker: it exits).
            PeerDeadError: the worker is gone.
        """
        return await self._call(msg, m.Ack, timeout_s=timeout_s)

    async def close(self) -> None:
        """Give pending background aborts a moment, then close the connection."""
        if self._background:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    asyncio.gather(*self._background, return_exceptions=True),
                    self._abort_timeout_s,
                )
        await self._rpc.close()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
