"""Collective weight broadcast from the trainer (GPU path: NCCL; CPU: gloo).

The trainer joins one process group with every engine rank of every inference worker and
broadcasts each new version from group rank 0 straight into the workers' models, through vLLM's
weight-transfer engines: ``NCCLTrainerWeightTransferEngine`` (vLLM's own, packed broadcast
buffers of ``bucket_bytes``) or ``GlooTrainerWeightTransferEngine`` below (same protocol, CPU
tensors, one broadcast per tensor). vLLM drives the handshake through a ``VLLMWeightSyncClient``;
``WorkerGroupClient`` is that client over rollart's ZeroMQ RPC.

Unlike the ZeroMQ push (``push.py``), nothing can be staged: a broadcast writes into the
serving model, so the controller pauses the workers first and asks for the broadcast
(``WaitPublished``) at its pause point. The group is formed lazily at the first broadcast and
re-formed when the set of workers changes (a worker died or was added) or after a failed
broadcast; a worker that dies mid-broadcast fails that broadcast, and the controller stops the
run (a failed push is fatal there).

The rendezvous authenticates nobody, so each new group proves its membership before its first
broadcast (``rollart.weights.membership``): the publisher draws a fresh nonce, sends it to each
worker inside ``WeightTransferInit`` (over the CURVE-authenticated RPC), and trainer and worker
ranks all-gather their HMAC proofs over the new group. A rank that fails it makes the trainer
drop the group and raise ``MembershipError`` ("rank 3 of the weight-transfer group did not
prove the run key: refusing to broadcast"); no weights are sent. Both trainer engines
(``GlooTrainerWeightTransferEngine``, ``RollartNCCLTrainerWeightTransferEngine``) join through
``_join_as_sender``, which runs the proof.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import ModuleSource, TrainerInitInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLTrainerInitInfo,
    NCCLTrainerWeightTransferEngine,
)

from rollart.inference.client import InferenceClient
from rollart.transport import messages as m
from rollart.weights.membership import (
    MembershipError,
    expected_proofs,
    new_nonce,
    prove_membership,
)
from rollart.weights.push import PushReport
from rollart.weights.vllm_engines import open_gloo_group

log = logging.getLogger(__name__)


#: what ``InferenceClient.weight_transfer`` sends: one message of vLLM's weight-transfer protocol
_TransferMsg = (m.WeightTransferInit | m.WeightTransferStart | m.WeightTransferUpdate
                | m.WeightTransferFinish | m.WeightTransferShutdown)


class WorkerGroupClient:
    """vLLM's ``VLLMWeightSyncClient`` over rollart RPC: every call fans out to all workers.

    vLLM's trainer engines call these methods synchronously from the thread running
    ``send_weights``; each call runs the RPCs on the trainer's event loop ``loop`` and blocks
    that thread until every worker answered (or ``timeout_s`` passed).

    ``rank_offsets[i]``: group rank of worker ``i``'s first engine rank (the trainer is 0).
    ``version``: the version ``finish_weight_update`` announces (set before each broadcast).
    ``nonce``: the group's membership nonce (``membership``), sent in ``WeightTransferInit``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, workers: list[InferenceClient],
                 rank_offsets: list[int], *, timeout_s: float, nonce: bytes) -> None:
        self.loop, self.workers, self.rank_offsets = loop, workers, rank_offsets
        self.timeout_s, self.nonce = timeout_s, nonce
        self.version = 0

    def _each(self, make: Callable[[int], _TransferMsg]) -> None:
        async def all_workers() -> None:
            await asyncio.gather(*(w.weight_transfer(make(i), timeout_s=self.timeout_s)
                                   for i, w in enumerate(self.workers)))

        self._run(all_workers())

    def _run(self, coro: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout_s + 5.0)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        base = {k: init_info[k] for k in ("master_address", "master_port", "world_size")}
        extra = {k: init_info[k] for k in ("timeout_s", "packed", "packed_buffer_size_bytes",
                                           "packed_num_buffers") if k in init_info}
        self._each(lambda i: m.WeightTransferInit(**base, **extra, nonce=self.nonce,
                                                  rank_offset=self.rank_offsets[i]))

    def start_weight_update(self) -> None:
        self._each(lambda _i: m.WeightTransferStart())

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        if isinstance(update_info, list):
            raise ValueError("per-rank update infos are not used by rollart's workers")
        self._each(lambda _i: m.WeightTransferUpdate(**update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each(lambda _i: m.WeightTransferFinish(version=self.version))

    def shutdown_weight_transfer_engine(self) -> None:
        self._each(lambda _i: m.WeightTransferShutdown())


#: what the trainer refuses when a rank of its group fails the membership proof
REFUSING = "refusing to broadcast"


def _join_as_sender(client: Any, worker_info: dict[str, Any], open_group: Callable[[], Any],
                    drop: Callable[[Any], None], proofs: list[bytes]) -> Any:
    """Open group rank 0 while the workers join (they block in the rendezvous until it opens),
    then prove the group's membership before anything is sent; return the group.

    Raises:
        MembershipError: a rank failed the proof, or ``proofs`` is empty; the group is dropped.
        RemoteError / TimeoutError: a worker failed to join.
    """
    if not proofs:
        raise MembershipError(f"no membership proofs for the weight-transfer group: {REFUSING}")
    with ThreadPoolExecutor(max_workers=1) as exe:
        joined = exe.submit(client.init_weight_transfer_engine, worker_info)
        group = open_group()
        try:
            prove_membership(group, 0, proofs, refusing=REFUSING)
        except BaseException:
            drop(group)
            raise
        joined.result()
    return group


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side of ``rollart_gloo``: rendezvous at ``master_address:master_port`` with
    ``world_size`` ranks; ``timeout_s`` bounds the rendezvous and each broadcast;
    ``membership_proofs``: every rank's expected proof (``membership.expected_proofs``)."""

    backend: ClassVar[str] = "rollart_gloo"

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 600.0
    membership_proofs: list[bytes] = field(default_factory=list, repr=False)


@dataclass
class RollartNCCLTrainerInitInfo(NCCLTrainerInitInfo):
    """vLLM's NCCL trainer init info plus ``membership_proofs`` (as ``GlooTrainerInitInfo``)."""

    membership_proofs: list[bytes] = field(default_factory=list, repr=False)


class RollartNCCLTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine whose ``trainer_init`` proves the group's membership (vLLM's
    joins the same way, without the proof); ``send_weights`` is vLLM's."""

    init_info_cls = RollartNCCLTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: RollartNCCLTrainerInitInfo, *, client: Any,
                     source: Any = None) -> Self:
        from vllm.distributed.weight_transfer.nccl_common import (
            NCCLWeightTransferInitInfo,
            worker_init_payload,
        )
        from vllm.distributed.weight_transfer.nccl_common import trainer_init as open_endpoint

        if source is None:
            raise ValueError("NCCL trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     packed=init_info.packed,
                     packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
                     packed_num_buffers=init_info.packed_num_buffers)
        if not engine.is_sender:
            return engine
        worker_info = worker_init_payload(NCCLWeightTransferInitInfo(
            master_address=init_info.master_address, master_port=init_info.master_port,
            rank_offset=1, world_size=init_info.world_size, packed=init_info.packed,
            packed_buffer_size_bytes=init_info.packed_buffer_size_bytes,
            packed_num_buffers=init_info.packed_num_buffers))
        engine.model_update_group = _join_as_sender(
            client, worker_info, lambda: open_endpoint(init_info), lambda g: g.destroy(),
            init_info.membership_proofs)
        return engine


class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """vLLM's NCCL trainer engine with a gloo communicator: CPU tensors, one broadcast each.

    ``send_weights`` (start -> update concurrently with the broadcast -> finish) is vLLM's.
    """

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any,
                     source: Any = None, listen_socket: socket.socket | None = None) -> Self:
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        worker_info = {"master_address": init_info.master_address,
                       "master_port": init_info.master_port, "rank_offset": 1,
                       "world_size": init_info.world_size, "timeout_s": init_info.timeout_s}
        engine.model_update_group = _join_as_sender(
            client, worker_info,
            lambda: open_gloo_group(init_info.master_address, init_info.master_port, 0,
                                    init_info.world_size, init_info.timeout_s,
                                    listen_socket=listen_socket),
            lambda _g: None, init_info.membership_proofs)
        return engine

    def _broadcast(self, source: Any, meta: Any) -> None:
        if not self.is_sender:
            for _ in source:
                pass
            return
        # A gloo ProcessGroup (its broadcast returns a Work to wait on), not the NCCL
        # communicator vLLM's base class declares.
        group: Any = self.model_update_group
        for _name, tensor in self._checked_iter(source, meta):
            group.broadcast(tensor.detach().to("cpu").contiguous(), 0).wait()

    def _post_send_sync(self) -> None:
        pass  # gloo broadcasts are complete when wait() returns

    def shutdown(self) -> None:
        self.model_update_group = None


def non_sender_engine(kind: str, model: Any) -> Any:
    """The engine of a trainer rank > 0 (FSDP2 data parallel): its ``send_weights`` only joins
    the ``full_tensor()`` gathers of rank 0's broadcast, in the same parameter order."""
    cls = (GlooTrainerWeightTransferEngine if kind == "gloo"
           else RollartNCCLTrainerWeightTransferEngine)
    # vLLM types ``client`` as required; a non-sender engine never calls it.
    return cls(client=None, source=ModuleSource(model),  # pyright: ignore[reportArgumentType]
               is_sender=False)


def _listen_socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


class CollectivePublisher:
    """Broadcasts the trainer's current weights as a version, on request (workers paused).

    Args:
        kind: ``"nccl"`` (trainer parameters on a CUDA device) or ``"gloo"`` (CPU).
        model: the trainer's module (``named_parameters()`` names are the checkpoint's; FSDP
            ``DTensor`` parameters are gathered with ``full_tensor()``).
        connect: ``address -> InferenceClient``.
        address: host the workers reach the trainer's rendezvous at.
        bucket_bytes: NCCL packed-buffer size in bytes (two such buffers per GPU).
        timeout_s: limit of each worker call, and of the gloo rendezvous and broadcasts
            (vLLM's NCCL rendezvous and broadcast take no timeout from here).
        run_send: ``run_send(send)`` runs the sender's ``send_weights`` (blocking, in a worker
            thread); with several trainer ranks it makes the others join the gathers first.
        membership_key: the run's membership key (``membership.membership_key(auth)``): every
            new group's ranks must prove it before the first broadcast.
    """

    def __init__(self, kind: str, model: Any, connect: Callable[[str], InferenceClient], *,
                 address: str, bucket_bytes: int, timeout_s: float, membership_key: bytes,
                 run_send: Callable[[Callable[[], None]], None] | None = None) -> None:
        if kind not in ("nccl", "gloo"):
            raise ValueError(f"collective weight transfer must be nccl or gloo, got {kind!r}")
        self.kind, self.model, self._connect = kind, model, connect
        self.address, self.bucket_bytes, self.timeout_s = address, bucket_bytes, timeout_s
        self._membership_key = membership_key
        self._workers: dict[str, InferenceClient] = {}
        self._engine: Any = None
        self._group_addresses: list[str] = []
        self._wanted: list[str] = []
        self._client: WorkerGroupClient | None = None
        self.latest_version: int | None = None
        self._run_send = run_send or (lambda send: send())

    @property
    def workers(self) -> list[str]:
        """Addresses of the registered workers."""
        return list(self._wanted)

    async def set_workers(self, addresses: Iterable[str]) -> None:
        """Workers to broadcast to; a changed set re-forms the group at the next broadcast."""
        wanted = list(dict.fromkeys(addresses))
        for addr in list(self._workers):
            if addr not in wanted and addr not in self._group_addresses:
                await self._workers.pop(addr).close()
        for addr in wanted:
            if addr not in self._workers:
                self._workers[addr] = self._connect(addr)
        self._wanted = wanted

    async def broadcast(self, version: int) -> PushReport:
        """Send the current weights as ``version`` to every registered (paused) worker.

        Raises:
            RuntimeError: no workers registered, or a worker is not set up for ``kind``.
            MembershipError: a rank of the new group did not prove the run key (nothing sent).
            RemoteError / TimeoutError: a worker refused or the group broke mid-transfer.
        """
        wanted = self._wanted
        if not wanted:
            raise RuntimeError("no inference workers registered for the weight broadcast")
        # Checked before any rank enters a collective, so a refusal stays a per-request error
        # (under FSDP ranks a failure inside the broadcast is fatal for the trainer).
        stats = await asyncio.gather(*(self._workers[a].stats() for a in wanted))
        running = [a for a, s in zip(wanted, stats, strict=True) if not s.paused]
        if running:
            raise RuntimeError(f"workers {running} are not paused: pause them before a "
                               f"{self.kind} broadcast (it writes into the serving model)")
        if self._engine is None or wanted != self._group_addresses:
            await self._form_group(wanted, stats)
        assert self._client is not None and self._engine is not None  # set by _form_group
        self._client.version = version
        start = time.perf_counter()
        try:
            await asyncio.to_thread(self._run_send, self._engine.send_weights)
        except BaseException:
            # The group may be mid-collective on some ranks: never reuse it.
            await self._leave_group()
            raise
        num_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.latest_version = version
        return PushReport(version=version, total_s=time.perf_counter() - start,
                          num_bytes=num_bytes, workers=list(wanted),
                          wire_bytes=num_bytes * len(wanted))  # a broadcast: full to each

    async def _form_group(self, wanted: list[str], stats: list[m.WorkerStats]) -> None:
        await self._leave_group()
        workers = [self._workers[a] for a in wanted]
        wrong = {w.name: s.weight_transfer for w, s in zip(workers, stats, strict=True)
                 if s.weight_transfer != self.kind}
        if wrong:
            raise RuntimeError(f"the trainer broadcasts over {self.kind}, but these workers "
                               f"receive weights otherwise: {wrong} (start them with "
                               f"--weight-transfer {self.kind})")
        offsets, rank = [], 1
        for s in stats:
            offsets.append(rank)
            rank += s.num_ranks
        loop = asyncio.get_running_loop()
        nonce = new_nonce()  # per group: a proof never carries over to another group
        proofs = expected_proofs(self._membership_key, nonce, rank)
        self._client = WorkerGroupClient(loop, workers, offsets, timeout_s=self.timeout_s,
                                         nonce=nonce)
        source = ModuleSource(self.model)
        if self.kind == "gloo":
            sock = _listen_socket(self.address)
            info: Any = GlooTrainerInitInfo(
                master_address=self.address, master_port=sock.getsockname()[1],
                world_size=rank, timeout_s=self.timeout_s, rank=0, membership_proofs=proofs)
            self._engine = await asyncio.to_thread(
                GlooTrainerWeightTransferEngine.trainer_init, info, client=self._client,
                source=source, listen_socket=sock)
        else:
            sock = _listen_socket(self.address)
            port = sock.getsockname()[1]
            sock.close()  # vLLM's NCCL rendezvous binds the port itself
            info = RollartNCCLTrainerInitInfo(
                master_address=self.address, master_port=port, world_size=rank, rank=0,
                packed=True, packed_buffer_size_bytes=self.bucket_bytes,
                membership_proofs=proofs)
            self._engine = await asyncio.to_thread(
                RollartNCCLTrainerWeightTransferEngine.trainer_init, info, client=self._client,
                source=source)
        self._group_addresses = list(wanted)
        for addr in [a for a in self._workers if a not in wanted]:
            await self._workers.pop(addr).close()
        log.info("formed %s weight-transfer group of %d ranks with %d workers",
                 self.kind, rank, len(workers))

    async def _leave_group(self) -> None:
        if self._engine is None:
            return
        live = [a for a in self._group_addresses if a in self._workers
                and not self._workers[a].dead]
        replies = await asyncio.gather(
            *(self._workers[a].weight_transfer(m.WeightTransferShutdown(),
                                               timeout_s=min(self.timeout_s, 30.0))
              for a in live), return_exceptions=True)
        for addr, reply in zip(live, replies, strict=True):
            if isinstance(reply, BaseException):  # the group is being replaced either way
                log.warning("leaving the weight-transfer group on %s failed: %r", addr, reply)
        self._engine.shutdown()
        self._engine = None
        self._group_addresses = []

    async def close(self) -> None:
        """Close the clients. The workers are not told to leave the group: at the end of a run
        they are being stopped too, and a new trainer re-forms the group (init replaces it)."""
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        for client in self._workers.values():
            await client.close()
        self._workers.clear()
