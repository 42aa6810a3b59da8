"""Collective weight transfer on the inference side: vLLM's weight-transfer engines.

With ``weight_transfer = "nccl"`` (GPU) the worker's engine is built with vLLM's own
``WeightTransferConfig(backend="nccl")``: the trainer joins one NCCL group with every worker rank
and broadcasts each new version straight into the engines' models (vLLM's
``NCCLWeightTransferEngine``; layerwise reload). ``weight_transfer = "gloo"`` is the same
protocol over a torch gloo group of CPU tensors, for CPU clusters and for exercising the whole
collective path where no GPU exists: ``GlooWeightTransferEngine`` below subclasses vLLM's NCCL
engine and replaces only the communicator (the handshake, the update metadata and the layerwise
reload are vLLM's).

Registration: vLLM creates the engine in its worker (the engine-core process) from a name in
``WeightTransferEngineFactory``. ``register_engines()`` adds ``rollart_gloo``; it runs when
``rollart.weights.vllm_ext`` is imported, which vLLM does in the worker before it loads the
model (``worker_extension_cls``), and in the frontend before the engine is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

log = logging.getLogger(__name__)

#: rollart's name of a collective weight transfer -> vLLM's backend name.
VLLM_BACKENDS: dict[str, str] = {"nccl": "nccl", "gloo": "rollart_gloo"}

_registered = False


def register_engines() -> None:
    """Register ``rollart_gloo`` with vLLM's weight-transfer factory (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(
            "rollart_gloo", __name__, "GlooWeightTransferEngine")
    except ValueError:  # registered by an earlier import of this module under another name
        pass
    _registered = True


def init_info_dict(kind: str, *, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, timeout_s: float, packed: bool,
                   packed_buffer_size_bytes: int, packed_num_buffers: int) -> dict[str, Any]:
    """The ``init_info`` dict vLLM's ``init_weight_transfer_engine`` takes for backend ``kind``.

    Raises:
        ValueError: ``kind`` is not a collective transfer (``nccl`` or ``gloo``).
    """
    common = {"master_address": master_address, "master_port": master_port,
              "rank_offset": rank_offset, "world_size": world_size}
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
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's dense NCCL weight-transfer engine with a gloo communicator (CPU tensors).

    Tensors are broadcast one by one from group rank 0 (the trainer) in the order of the update
    info and loaded with the model's ``load_weights`` inside vLLM's layerwise reload
    (``start_weight_update`` / ``finish_weight_update`` are inherited).
    """

    init_info_cls = GlooWeightTransferInitInfo

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        self.model_update_group = open_gloo_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size,
            init_info.timeout_s)
        log.info("rollart_gloo: joined weight-transfer group as rank %d of %d",
                 rank, init_info.world_size)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a machine
        # without an accelerator; gloo broadcasts are complete once wait() returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: Any) -> None:
        if self.model_update_group is None:
            raise RuntimeError("rollart_gloo: init_weight_transfer_engine was not called")
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names,
                                           update_info.shapes, strict=True):
            buf = torch.empty(shape, dtype=getattr(torch, dtype_name), device="cpu")
            self.model_update_group.broadcast(buf, 0).wait()
            self.model.load_weights([(name, buf.to(self.device))])

    def shutdown(self) -> None:
        self.model_update_group = None

