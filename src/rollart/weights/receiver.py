"""The inference worker's weight handlers: stage buckets, apply a version, receive a broadcast.

``WeightReceiver`` is mixed into ``rollart.inference.worker.InferenceWorker`` (the process that
serves vLLM over ZeroMQ); it holds every request handler of the weight path on the worker side:

- ``WeightBucket`` -> ``Ack``: CRC-checked and staged as a safetensors file
  (``rollart.weights.staging``), nothing applied;
- ``WeightDelta`` -> ``Ack`` or ``NeedFullVersion``: a bucket rebuilt from the exact base
  version it names (``rollart.weights.basestate``), CRC-checked, then staged like a full one;
- ``ApplyWeights`` -> ``WeightsApplied``: pause (keep), reload the staged version in the engine
  (``rollart.weights.vllm_ext``), reset the prefix cache, label new tokens with the version,
  resume;
- ``WeightTransferInit`` / ``Start`` / ``Update`` / ``Finish`` / ``Shutdown`` -> ``Ack``: the
  collective path (``rollart.weights.vllm_engines``): the trainer broadcasts a version straight
  into the paused engine's model, and ``ApplyWeights`` of that version then only relabels tokens
  and resets the prefix cache. ``WeightTransferInit`` carries the group's nonce: the worker
  computes every rank's expected membership proof with the run key (``membership``) and its
  engine ranks refuse the group unless every rank proves it.

A reload or broadcast that fails part-way leaves a model holding no one version: the worker
``die``s (exits with status 1) rather than serve it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from rollart.transport import messages as m
from rollart.transport.errors import RemoteError
from rollart.transport.rpc import Handler
from rollart.weights.basestate import WorkerBases
from rollart.weights.staging import TIED_LM_HEAD, WeightStager

# The handlers run in the worker process: their lines belong to the worker's log.
log = logging.getLogger("rollart.inference.worker")


class WeightReceiver:
    """Weight handlers of an inference worker; the worker provides the state below.

    ``engine``: the vLLM ``AsyncLLM`` (built with ``rollart.weights.vllm_ext``); ``version``:
    the version it serves; ``received_version``: the version a collective update loaded, not yet
    applied; ``paused``: paused by a client; ``_control``: the lock over pause state;
    ``_active``: in-flight requests; ``die(reason)``: make the process exit;
    ``membership_key``: the run's membership key (``membership.membership_key``), None when
    the worker was given none (then it joins no weight-transfer group).
    """

    engine: Any
    name: str
    version: int
    received_version: int | None
    paused: bool
    stager: WeightStager
    bases: WorkerBases
    weight_transfer: str
    num_ranks: int
    membership_key: bytes | None
    _updating: bool
    _control: asyncio.Lock
    _active: dict[str, Any]

    if TYPE_CHECKING:  # provided by the worker

        def die(self, reason: str) -> None: ...

        def stats(self) -> m.WorkerStats: ...

    def weight_handlers(self) -> dict[type, Handler]:
        return {
            m.WeightBucket: self.weight_bucket,
            m.WeightDelta: self.weight_delta,
            m.ApplyWeights: self.apply_weights,
            m.WeightTransferInit: self.transfer_init,
            m.WeightTransferStart: self.transfer_start,
            m.WeightTransferUpdate: self.transfer_update,
            m.WeightTransferFinish: self.transfer_finish,
            m.WeightTransferShutdown: self.transfer_shutdown,
        }

    # -- weights ---------------------------------------------------------------------------------

    async def weight_bucket(self, msg: m.WeightBucket, frames) -> m.Ack:
        self.bases.note_full_bucket(msg)
        nbytes = await self.stager.stage(msg, frames, self.version)
        return m.Ack(
            detail=f"staged bucket {msg.bucket_index + 1}/{msg.num_buckets} of version "
            f"{msg.version} ({nbytes} bytes)"
        )

    async def weight_delta(self, msg: m.WeightDelta, frames) -> m.Ack | m.NeedFullVersion:
        """Rebuild a delta bucket on the exact base it names (``rollart.weights.basestate``)."""
        return await self.bases.stage_delta(msg, frames, self.version)

    async def apply_weights(self, msg: m.ApplyWeights, _frames) -> m.WeightsApplied:
        """Pause (keep), reload in the engine, reset the prefix cache (``reprefill``: also
        recompute in-flight requests' KV), label new tokens with the version, resume. A worker
        that was paused by a client stays paused."""
        async with self._control:
            staged = None
            if self.received_version != msg.version:
                staged = self.stager.take(msg.version, self.version)
            start = time.perf_counter()
            was_paused = self.paused
            if not was_paused:
                await self.engine.pause_generation(mode="keep", clear_cache=False)
            if staged is not None:
                await self._reload(msg.version, staged.paths())
            await self._reset_prefix_cache(msg.version, msg.reprefill)
            await self.engine.update_weight_version(str(msg.version))
            self.version = msg.version
            self.received_version = None
            self.bases.after_apply(msg.version)
            if not was_paused:
                await self.engine.resume_generation()
            elapsed = time.perf_counter() - start
        log.info("%s: applied weight version %d in %.3f s", self.name, msg.version, elapsed)
        return m.WeightsApplied(version=msg.version, apply_time_s=elapsed, stats=self.stats())

    async def _reset_prefix_cache(self, version: int, reprefill: bool) -> None:
        """Drop the prefix cache's blocks computed under older weights.

        vLLM answers False when blocks could not be freed. That is expected only while
        in-flight requests hold blocks in the keep-the-KV mode (``cache_salt`` then keeps new
        requests off them). Otherwise (``reprefill`` resets running requests too, or nothing
        is in flight) False on a second try, like an exception, means the engine kept KV of
        older weights: the update fails and the worker exits, as after a failed reload (issue
        13), so it never serves a prompt from a stale cache.

        Raises:
            RemoteError: ``engine_error`` naming the version and cause (the worker then exits).
        """
        why = ""
        for _attempt in range(2):  # once more: an abort just before may still hold blocks
            try:
                ok = await self.engine.reset_prefix_cache(reset_running_requests=reprefill)
            except Exception as exc:
                why = f"raised {exc!r}"
                break
            if ok or (not reprefill and self._active):
                return
            why = "returned False twice"
        reason = (f"resetting the prefix cache after loading weight version {version} {why} "
                  f"({len(self._active)} requests in flight, reprefill={reprefill})")
        log.error("%s: %s", self.name, reason)
        self.die(reason)
        raise RemoteError("engine_error", f"{self.name}: {reason}; the worker exits")

    async def _reload(self, version: int, paths: list[str]) -> None:
        layout = self.stager.layout
        skip = [TIED_LM_HEAD] if layout is not None and layout.tied else []
        try:
            await self.engine.collective_rpc("rollart_reload_weights", args=(paths, skip))
        except Exception as exc:
            # Part of the model may hold new weights: it no longer serves any one version.
            self.die(f"reloading weight version {version} failed part-way: {exc!r}")
            raise RemoteError("engine_error", f"weight reload failed: {exc}") from exc

    # -- collective weight transfer (vLLM weight-transfer engine) ---------------------------------

    def _require_collective(self, what: str) -> None:
        if self.weight_transfer == "zmq":
            raise RemoteError("bad_request", f"{what}: this worker receives weights over zmq "
                              "(start it with --weight-transfer nccl or gloo)")

    async def transfer_init(self, msg: m.WeightTransferInit, _frames) -> m.Ack:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        from rollart.weights.membership import expected_proofs
        from rollart.weights.vllm_engines import init_info_dict

        self._require_collective("WeightTransferInit")
        if self.membership_key is None:
            raise RemoteError("bad_request", "WeightTransferInit: this worker has no run key "
                              "to prove its weight-transfer group with")
        if msg.rank_offset + self.num_ranks > msg.world_size:
            raise RemoteError("bad_request", f"WeightTransferInit: ranks {msg.rank_offset}.."
                              f"{msg.rank_offset + self.num_ranks - 1} do not fit a group of "
                              f"{msg.world_size}")
        info = init_info_dict(
            self.weight_transfer, master_address=msg.master_address,
            master_port=msg.master_port, rank_offset=msg.rank_offset,
            world_size=msg.world_size, timeout_s=msg.timeout_s, packed=msg.packed,
            packed_buffer_size_bytes=msg.packed_buffer_size_bytes,
            packed_num_buffers=msg.packed_num_buffers,
            membership_proofs=expected_proofs(self.membership_key, msg.nonce, msg.world_size))
        try:
            await self.engine.init_weight_transfer_engine(WeightTransferInitRequest(info))
        except Exception as exc:
            raise RemoteError("engine_error", f"joining the {self.weight_transfer} group at "
                              f"{msg.master_address}:{msg.master_port} failed: {exc}") from exc
        return m.Ack(detail=f"joined {self.weight_transfer} group as ranks "
                     f"{msg.rank_offset}..{msg.rank_offset + self.num_ranks - 1} "
                     f"of {msg.world_size}")

    async def transfer_start(self, _msg: m.WeightTransferStart, _frames) -> m.Ack:
        self._require_collective("WeightTransferStart")
        async with self._control:
            if not self.paused:
                # Loading into a model that is generating would mix versions inside one step.
                raise RemoteError("bad_request", "WeightTransferStart: pause the worker first")
            try:
                await self.engine.start_weight_update()
            except Exception as exc:
                raise RemoteError("engine_error", f"start_weight_update failed: {exc}") from exc
            self._updating = True
        return m.Ack(detail="receiving weights")

    async def transfer_update(self, msg: m.WeightTransferUpdate, _frames) -> m.Ack:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._require_collective("WeightTransferUpdate")
        if not self._updating:
            raise RemoteError("bad_request", "WeightTransferUpdate before WeightTransferStart")
        info = {"names": msg.names, "dtype_names": msg.dtype_names, "shapes": msg.shapes}
        try:
            async with self._control:  # no Resume while the model is half loaded
                await self.engine.update_weights(WeightTransferUpdateRequest(info))
        except Exception as exc:
            self.die(f"receiving weights over {self.weight_transfer} failed part-way: {exc!r}")
            raise RemoteError("engine_error", f"update_weights failed: {exc}") from exc
        return m.Ack(detail=f"received {len(msg.names)} tensors")

    async def transfer_finish(self, msg: m.WeightTransferFinish, _frames) -> m.Ack:
        self._require_collective("WeightTransferFinish")
        if not self._updating:
            raise RemoteError("bad_request", "WeightTransferFinish before WeightTransferStart")
        try:
            async with self._control:
                await self.engine.finish_weight_update()
                await self.engine.collective_rpc("rollart_refresh_tied_lm_head")
        except Exception as exc:
            self.die(f"finishing the weight update to version {msg.version} failed: {exc!r}")
            raise RemoteError("engine_error", f"finish_weight_update failed: {exc}") from exc
        self._updating = False
        self.received_version = msg.version
        return m.Ack(detail=f"holds version {msg.version} (apply to serve it)")

    async def transfer_shutdown(self, _msg: m.WeightTransferShutdown, _frames) -> m.Ack:
        self._require_collective("WeightTransferShutdown")
        if self._updating:
            # vLLM's layerwise reload was started on this model and never finished: which of
            # its weights are loaded is unknown, so it no longer serves any one version.
            self.die("a collective weight update was abandoned before WeightTransferFinish")
            raise RemoteError("engine_error", "weight update abandoned part-way; worker exits")
        await self.engine.shutdown_weight_transfer_engine()
        return m.Ack(detail="left the weight-transfer group")
