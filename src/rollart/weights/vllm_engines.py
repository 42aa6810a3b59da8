"""Collective weight transfer on the inference side: vLLM's weight-transfer engines.

With ``weight_transfer = "nccl"`` (GPU) the worker's engine is built with vLLM's own
``WeightTransferConfig(backend="nccl")``: the trainer joins one NCCL group with every worker rank
and broadcasts each new version straight into the engines' models (vLLM's
``NCCLWeightTransferEngine``; layerwise reload). ``weight_transfer = "gloo"`` is the same
protocol over a torch gloo group of CPU tensors, for CPU clusters and for exercising the whole
collective path where no GPU exists: ``GlooWeightTransferEngine`` below subclasses vLLM's NCCL
engine and replaces only the communicator (the handshake, the update metadata and the layerwise
reload are vLLM's). vLLM's NCCL engine itself is used through
``RollartNCCLWeightTransferEngine``, which adds only the membership proof.

Membership: right after joining the group, before receiving anything, every engine rank takes
part in the proof of ``rollart.weights.membership`` (the init info carries the expected proofs
for this group's nonce, computed by the worker's RPC process, which holds the run key); a group
in which any rank fails it is dropped and the init fails, so no weights are ever loaded from it.

Registration: vLLM creates the engine in its worker (the engine-core process) from a name in
``WeightTransferEngineFactory``. ``register_engines()`` adds ``rollart_gloo`` and
``rollart_nccl``; it runs when ``rollart.weights.vllm_ext`` is imported, which vLLM does in the
worker before it loads the model (``worker_extension_cls``), and in the frontend before the
engine is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
)

from rollart.weights.membership import MembershipError, prove_membership

log = logging.getLogger(__name__)

#: rollart's name of a collective weight transfer -> vLLM's backend name.
VLLM_BACKENDS: dict[str, str] = {"nccl": "rollart_nccl", "gloo": "rollart_gloo"}
#: what a worker rank refuses when a rank of its group fails the membership proof
REFUSING = "refusing to load weights from this group"

_registered = False


def register_engines() -> None:
    """Register ``rollart_gloo`` and ``rollart_nccl`` with vLLM's weight-transfer factory
    (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls in (("rollart_gloo", "GlooWeightTransferEngine"),
                      ("rollart_nccl", "RollartNCCLWeightTransferEngine")):
        try:
            WeightTransferEngineFactory.register_engine(name, __name__, cls)
        except ValueError:  # registered by an earlier import of this module under another name
            pass
    _registered = True


def init_info_dict(kind: str, *, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, timeout_s: float, packed: bool,
                   packed_buffer_size_bytes: int, packed_num_buffers: int,
                   membership_proofs: list[bytes]) -> dict[str, Any]:
    """The ``init_info`` dict vLLM's ``init_weight_transfer_engine`` takes for backend ``kind``.

    ``membership_proofs``: the expected proof of every group rank (``membership``), sent as
    hex strings (the dict crosses vLLM's process boundary).

    Raises:
        ValueError: ``kind`` is not a collective transfer (``nccl`` or ``gloo``).
    """
    common = {"master_address": master_address, "master_port": master_port,
              "rank_offset": rank_offset, "world_size": world_size,
              "membership_proofs": [p.hex() for p in membership_proofs]}
    if kind == "nccl":
        return {**common, "packed": packed, "packed_buffer_size_bytes": packed_buffer_size_bytes,
                "packed_num_buffers": packed_num_buffers}
    if kind == "gloo":
        return {**common, "timeout_s": timeout_s}
    raise ValueError(f"weight transfer {kind!r} is not collective (expected nccl or gloo)")


def open_gloo_group(master_address: str, master_port: int, rank: int, world_size: int,
                    timeout_s: float, listen_socket: Any = None) -> Any:
    """A gloo ``ProcessGroup`` of ``world_size`` ranks outside torch's default group (vLLM
    already owns that one in the worker). Rank 0 hosts the TCP store (on ``listen_socket`` if
    given, which avoids a race for the port). Blocks until every rank joined or ``timeout_s``.
    """
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        master_address, master_port, rank, world_size, "gloo",
        listen_socket=listen_socket, timeout=timedelta(seconds=timeout_s))


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init info of ``rollart_gloo``: the rendezvous of the trainer's group.

    ``rank_offset``: the group rank of this engine's first worker rank (the trainer is 0).
    ``timeout_s``: how long a rank waits for the others in the rendezvous and each broadcast.
    ``membership_proofs``: hex of every group rank's expected proof (``membership``).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    membership_proofs: list[str]
    timeout_s: float = 600.0


def group_rank(parallel_config: Any, rank_offset: int) -> int:
    """Group rank of this engine rank: its rank across data-parallel groups + ``rank_offset``
    (the formula of vLLM's ``worker_init_process_group``)."""
    pc = parallel_config
    return pc.data_parallel_index * pc.world_size + pc.rank + rank_offset


def prove_worker_membership(group: Any, rank: int, proofs_hex: list[str],
                            drop: Any) -> None:
    """Run the membership proof as worker rank ``rank``; on failure ``drop()`` the group and
    raise.

    Raises:
        MembershipError: a rank failed the proof, or the proofs do not fit the group.
    """
    try:
        proofs = [bytes.fromhex(p) for p in proofs_hex]
        if not 0 < rank < len(proofs):
            raise MembershipError(f"group rank {rank} has no proof among {len(proofs)}: "
                                  f"{REFUSING}")
        prove_membership(group, rank, proofs, refusing=REFUSING)
    except BaseException:
        drop()
        raise


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's dense NCCL weight-transfer engine with a gloo communicator (CPU tensors).

    Tensors are broadcast one by one from group rank 0 (the trainer) in the order of the update
    info and loaded with the model's ``load_weights`` inside vLLM's layerwise reload
    (``start_weight_update`` / ``finish_weight_update`` are inherited).
    """

    init_info_cls = GlooWeightTransferInitInfo

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        rank = group_rank(self.parallel_config, init_info.rank_offset)
        self.model_update_group = open_gloo_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size,
            init_info.timeout_s)
        prove_worker_membership(self.model_update_group, rank, init_info.membership_proofs,
                                self.shutdown)
        log.info("rollart_gloo: joined weight-transfer group as rank %d of %d",
                 rank, init_info.world_size)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a machine
        # without an accelerator; gloo broadcasts are complete once wait() returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: Any) -> None:
        if self.model_update_group is None:
            raise RuntimeError("rollart_gloo: init_weight_transfer_engine was not called")
        # vLLM's base class declares an NCCL communicator and a plain nn.Module; here they are a
        # gloo ProcessGroup (broadcast returns a Work) and a vLLM model (has load_weights).
        group: Any = self.model_update_group
        model: Any = self.model
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names,
                                           update_info.shapes, strict=True):
            buf = torch.empty(shape, dtype=getattr(torch, dtype_name), device="cpu")
            group.broadcast(buf, 0).wait()
            model.load_weights([(name, buf.to(self.device))])

    def shutdown(self) -> None:
        self.model_update_group = None



@dataclass(kw_only=True)
class RollartNCCLWeightTransferInitInfo(NCCLWeightTransferInitInfo):
    """vLLM's NCCL init info plus ``membership_proofs`` (hex of every group rank's expected
    proof; ``membership``). Only the TCP rendezvous (``master_address``/``master_port``) is used.
    """

    membership_proofs: list[str] = field(default_factory=list)


class RollartNCCLWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's NCCL weight-transfer engine that proves the group's membership after joining it.

    An empty ``membership_proofs`` fails the proof (no rank can match), so a group is never
    used unchecked.
    """

    init_info_cls = RollartNCCLWeightTransferInitInfo

    def init_transfer_engine(self, init_info: RollartNCCLWeightTransferInitInfo) -> None:
        super().init_transfer_engine(init_info)
        prove_worker_membership(self.model_update_group,
                                group_rank(self.parallel_config, init_info.rank_offset),
                                init_info.membership_proofs, self.shutdown)
