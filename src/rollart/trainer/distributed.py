"""Data-parallel FSDP2 trainer ranks under torchrun (``[trainer] num_processes > 1``).

Layout: ``torchrun --standalone --nproc-per-node N -m rollart.trainer.service ...`` starts N
copies of the trainer. Each builds the same model, shards it with FSDP2 (``fully_shard`` per
decoder layer, then the root) over all ranks and builds AdamW over its shards. Rank 0 alone binds
the RPC server and writes the ready file; every other rank runs `RankRunner.follow`, executing
the commands rank 0 hands out. A command is a msgspec Struct, msgpack-encoded and broadcast from
rank 0 as a uint8 tensor (its length first) over a gloo group, so control traffic stays on the
CPU when the model is on GPUs (NCCL). Every rank then runs the same collective code: one
`train_step` on its share of the batch (``dp=``), a snapshot (every rank all-gathers each
parameter in ``named_parameters`` order; rank 0 keeps the CPU copies), a DCP save, or stop.

Failures (no rank hangs forever; the whole trainer exits and the launcher reports it):
- torchrun (default ``--max-restarts 0``): when any rank exits, it sends SIGTERM (then, after
  30 s, SIGKILL) to the others and exits non-zero itself.
- A follower whose command raises exits non-zero (traceback in the log), which triggers the
  above. Rank 0 blocked in a collective with it gets an error at once with gloo ("Connection
  closed by peer"); under NCCL (untested here) torchrun's SIGTERM / SIGKILL ends it, or the NCCL
  watchdog after ``collective_timeout_s``.
- On rank 0 a failed command (its own exception or a collective error) is fatal: the caller gets
  an ``internal`` error whose message starts with ``fatal:``, later commands are refused, and the
  service stops with exit code 1 (`RankRunner.on_fatal`). A bad batch is rejected on rank 0
  (`check_batch`) before any rank sees it, so it stays a per-request error.
- Collectives of the default group time out after ``collective_timeout_s``; followers wait for
  the next command with no practical timeout (an idle trainer is normal), relying on torchrun to
  end them if rank 0 dies.
- Each rank asks the kernel to SIGKILL it when its parent (torchrun) dies (`die_with_parent`):
  torchrun starts ranks in their own sessions, so a SIGKILL of torchrun's process group would
  otherwise leave them running.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from rollart.transport.errors import RemoteError
from rollart.transport.messages import TrainSample

if TYPE_CHECKING:
    import torch
    import torch.distributed
    from torch import nn

    from rollart.trainer.step import ReduceOp, TrainStepConfig

log = logging.getLogger("rollart.trainer")

# Followers wait this long for the next command: effectively forever, since between steps the
# trainer may idle for as long as rollout takes; a dead rank 0 is torchrun's to notice.
_IDLE_TIMEOUT = timedelta(days=30)


class _Command(msgspec.Struct, tag=True, forbid_unknown_fields=True, kw_only=True):
    """Base of the commands rank 0 hands to the other ranks (never on the ZMQ wire)."""


class TrainCommand(_Command):
    """Run `train_step` on the whole batch (each rank trains its share)."""

    samples: list[TrainSample]
    #: the policy version of the weights before this step (``train_step``'s)
    weights_version: int | None = None


class SnapshotCommand(_Command):
    """All-gather every parameter, in ``named_parameters`` order."""


class SaveCommand(_Command):
    """DCP-save model + optimizer under ``path`` (collective; rank 0 writes trainer.json)."""

    path: str
    version: int
    step: int


class BroadcastCommand(_Command):
    """Join rank 0's collective weight broadcast (``nccl`` / ``gloo``) as a non-sender: gather
    every parameter in ``named_parameters`` order while rank 0 sends (vLLM's
    ``send_weights`` on a non-sender rank)."""

    kind: Literal["nccl", "gloo"]


class StopCommand(_Command):
    """Leave the follower loop and the process group."""


Command = TrainCommand | SnapshotCommand | SaveCommand | BroadcastCommand | StopCommand
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Command)


def encode_command(cmd: Command) -> bytes:
    return _encoder.encode(cmd)


def decode_command(data: bytes) -> Command:
    """Raises msgspec.ValidationError / DecodeError on bytes that are not a Command."""
    return _decoder.decode(data)


def is_follower() -> bool:
    """True in a torchrun rank other than 0 (``WORLD_SIZE`` > 1 and ``RANK`` != 0)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and int(os.environ.get("RANK", "0")) != 0


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``), and exit now if
    the parent died before that was set. No-op where prctl is unavailable."""
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    # Compared with the pid read before prctl, not with 1: torchrun may itself be pid 1 (the
    # entry point of a container), and a re-parented orphan's new parent need not be pid 1.
    if os.getppid() != parent:
        os._exit(1)


class RankGroup:
    """This process's place among the trainer ranks, with the process groups they share.

    Build with `from_env`. ``device``: ``cuda:LOCAL_RANK`` (NCCL default group) or ``cpu``
    (gloo). ``mesh``: the 1-D device mesh FSDP2 shards over. Control commands and metric
    reductions use separate gloo groups (CPU tensors), so they work under NCCL too.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 collective_timeout_s: float) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.rank = rank
        self.world_size = world_size
        self.device = device
        timeout = timedelta(seconds=collective_timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timeout)
        # new_group is collective: every rank creates the same groups in the same order.
        self._control = _member_group(dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT))
        self._cpu = _member_group(dist.new_group(backend="gloo", timeout=timeout))
        self.mesh = init_device_mesh(device.type, (world_size,))

    @classmethod
    def from_env(cls, device: str, collective_timeout_s: float) -> RankGroup | None:
        """The rank group torchrun's environment describes, or None for a single process.

        Args:
            device: ``"cpu"`` or ``"cuda"`` (each rank takes ``cuda:LOCAL_RANK``).
            collective_timeout_s: timeout of every training collective, seconds.
        Raises:
            ValueError: several ranks with a device other than ``cpu`` / ``cuda``.
            RuntimeError: fewer visible CUDA devices than local ranks.
        """
        import torch

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        if device == "cpu":
            return cls(rank, world, torch.device("cpu"), collective_timeout_s)
        if device != "cuda":
            raise ValueError(f"device {device!r}: with several trainer processes use 'cpu' or "
                             "'cuda' (each rank takes cuda:LOCAL_RANK)")
        visible = torch.cuda.device_count()
        if local_rank >= visible:
            raise RuntimeError(
                f"rank {rank}: LOCAL_RANK {local_rank} but only {visible} CUDA device(s) visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                "trainer.num_processes needs one GPU per process")
        torch.cuda.set_device(local_rank)
        return cls(rank, world, torch.device("cuda", local_rank), collective_timeout_s)

    def all_reduce(self, values: list[float], op: ReduceOp) -> list[float]:
        """Element-wise sum / max of ``values`` over every rank (float64, gloo)."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
                        group=self._cpu)
        return t.tolist()

    def send(self, cmd: Command) -> None:
        """Rank 0: broadcast ``cmd`` to every other rank (they are in `receive`)."""
        import torch
        import torch.distributed as dist

        payload = encode_command(cmd)
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), 0, group=self._control)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0,
                       group=self._control)

    def receive(self) -> Command:
        """Ranks > 0: wait for rank 0's next command."""
        import torch
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self._control)
        buf = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self._control)
        return decode_command(buf.numpy().tobytes())

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers",
                "layers")


def _member_group(group: object) -> torch.distributed.ProcessGroup:
    """``group`` (from ``dist.new_group`` over all ranks), checked to be one this rank is in:
    torch types the result ``ProcessGroup | int | None`` (a marker for non-members)."""
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"torch.distributed.new_group gave {group!r}, not a process group")
    return group


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers (a non-empty ModuleList at a usual transformers path).

    Raises:
        ValueError: none of ``model.layers``, ``model.decoder.layers``, ``transformer.h``,
            ``gpt_neox.layers``, ``layers`` is a non-empty ModuleList.
    """
    from torch import nn

    for path in _LAYER_PATHS:
        mod: Any = model
        for part in path.split("."):
            mod = getattr(mod, part, None)
        if isinstance(mod, nn.ModuleList) and len(mod):
            return mod
    raise ValueError(f"cannot shard {type(model).__name__} with FSDP2: no decoder layers found "
                     f"at any of {', '.join(_LAYER_PATHS)}")


def place_model(model: nn.Module, device: str, ranks: RankGroup | None) -> nn.Module:
    """Move ``model`` to ``device`` (one process) or FSDP2-shard it over ``ranks``.

    Sharding: one FSDP unit per decoder layer plus the root (embeddings, final norm, a tied
    ``lm_head``). ``fully_shard`` moves each unit to the mesh device as it shards it, so a GPU
    never holds more than one unit unsharded (but every rank first loads the whole checkpoint
    into host memory: N copies in RAM). Gradients are reduce-scattered as a plain sum (the
    default divides by the world size): `train_step` normalises the loss by the whole minibatch's
    token count, so the sum over ranks is the one-process gradient.
    """
    if ranks is None:
        return model.to(device)
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=ranks.mesh)
    fully_shard(model, mesh=ranks.mesh)
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            mod.set_gradient_divide_factor(1.0)
            # Sum as the reduction itself (not PREMUL_SUM, which gloo lacks).
            mod.set_force_sum_reduction_for_comms(True)
    return model


def gather_parameters(model: nn.Module, *, keep: bool) -> list[tuple[str, torch.Tensor]]:
    """Full CPU copies of the parameters, names as in the HF checkpoint (collective).

    Every rank must call it: each sharded (DTensor) parameter is all-gathered in
    ``named_parameters`` order. Returns the copies where ``keep`` (rank 0), else ``[]``.
    """
    from torch.distributed.tensor import DTensor

    out = []
    for name, p in model.named_parameters():
        t = p.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if keep:
            out.append((name, t.to("cpu", copy=True)))
    return out


class RankRunner:
    """Runs trainer commands on this rank's model; on rank 0 hands each to the other ranks first.

    Rank 0 (or the single process, ``ranks`` None) calls `train`, `snapshot`, `save`, `stop`
    from worker threads, one at a time (a lock serialises them); other ranks call `follow`.
    ``on_fatal(exc)`` is called (in the calling thread) when a command fails under several ranks.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 step_cfg: TrainStepConfig, ranks: RankGroup | None, *,
                 ref_model: nn.Module | None = None) -> None:
        self.model = model
        self.ref_model = ref_model  # the KL reference (``kl_coef`` > 0): a full copy per rank
        self.optimizer = optimizer
        self.step_cfg = step_cfg
        self.ranks = ranks
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.failure: BaseException | None = None
        self._lock = threading.Lock()
        self._transfer: Any = None  # a follower's non-sender weight-transfer engine
        #: per-sample engine/trainer agreement of the last train (``sample_agreement``)
        self.last_agreement: list[tuple[float, float, float, int, float, float, float]] = []

    def train(self, samples: Sequence[TrainSample], weights_version: int | None = None
              ) -> dict[str, float]:
        """One `train_step` over all ranks; metrics of the whole batch. `weights_version`:
        the policy version of the weights before the step (`train_step`'s).

        Raises:
            ValueError: a bad batch (`check_batch`), before any rank sees it.
            RemoteError: ``internal``, ``fatal: ...`` when the ranks failed (see module doc).
        """
        from rollart.trainer.step import check_batch

        check_batch(samples, self.step_cfg)
        return self._run(TrainCommand(samples=list(samples), weights_version=weights_version))

    def snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """Detached full CPU copies of the parameters (as ``snapshot_parameters``)."""
        return self._run(SnapshotCommand())

    def save(self, path: Path, *, version: int, step: int) -> float:
        """`save_trainer` on every rank; returns seconds taken."""
        return self._run(SaveCommand(path=str(path), version=version, step=step))

    def stop(self, timeout_s: float = 60.0) -> None:
        """Release the other ranks (StopCommand) and leave the process group. Never raises.

        Waits at most ``timeout_s`` for an in-flight command; after a failure sends nothing.
        """
        if self.ranks is None:
            return
        if not self._lock.acquire(timeout=timeout_s):
            log.warning("a command is still running after %.0f s; not stopping the ranks",
                        timeout_s)
            return
        try:
            if self.failure is None:
                self.ranks.send(StopCommand())
                self.ranks.close()
        except Exception as exc:
            # The usual case on shutdown: torchrun sent SIGTERM to every rank, and followers
            # end at once, so there is no one left to tell.
            log.info("the other trainer ranks are gone already: %r", exc)
        finally:
            self._lock.release()

    def broadcast_weights(self, kind: Literal["nccl", "gloo"], send: Callable[[], None]) -> None:
        """Rank 0: run ``send`` (the sender's ``send_weights``) while the other ranks join its
        parameter gathers (``BroadcastCommand``). Raises as `train` does."""
        self._run(BroadcastCommand(kind=kind), local=send)

    def _run(self, cmd: Command, local: Callable[[], Any] | None = None) -> Any:
        with self._lock:
            if self.failure is not None:
                raise RemoteError("internal", f"fatal: the trainer ranks failed earlier "
                                  f"({self.failure!r}); the trainer is exiting")
            if self.ranks is None:  # one process: failures stay per request, as before
                return local() if local is not None else self.execute(cmd)
            try:
                self.ranks.send(cmd)
                return local() if local is not None else self.execute(cmd)
            except BaseException as exc:
                self.failure = exc
                log.exception("%s failed on rank 0; the trainer ranks cannot continue",
                              type(cmd).__name__)
                if self.on_fatal is not None:
                    try:
                        self.on_fatal(exc)
                    except Exception:  # e.g. the event loop closed during shutdown
                        log.exception("on_fatal failed")
                raise RemoteError("internal", f"fatal: {type(cmd).__name__} failed across the "
                                  f"trainer ranks ({exc!r}); the trainer is exiting") from exc

    def execute(self, cmd: Command) -> Any:
        """Run ``cmd`` on this rank (collective under several ranks)."""
        from rollart.trainer.checkpoint import save_trainer
        from rollart.trainer.step import train_step
        from rollart.weights.push import snapshot_parameters

        if isinstance(cmd, TrainCommand):
            agreement: list[tuple[float, float, float, int, float, float, float]] = []
            out = train_step(self.model, self.optimizer, cmd.samples, self.step_cfg,
                             ref_model=self.ref_model, dp=self.ranks, agreement=agreement,
                             weights_version=cmd.weights_version)
            self.last_agreement = agreement
            return out
        if isinstance(cmd, SnapshotCommand):
            if self.ranks is None:
                return snapshot_parameters(self.model)
            return gather_parameters(self.model, keep=self.ranks.rank == 0)
        if isinstance(cmd, SaveCommand):
            return save_trainer(Path(cmd.path), self.model, self.optimizer,
                                version=cmd.version, step=cmd.step)
        if isinstance(cmd, BroadcastCommand):
            from rollart.weights.collective import non_sender_engine

            if self._transfer is None:
                self._transfer = non_sender_engine(cmd.kind, self.model)
            return self._transfer.send_weights()
        raise ValueError(f"command {type(cmd).__name__} cannot be executed")

    def follow(self) -> int:
        """Ranks > 0: execute rank 0's commands until StopCommand; returns the exit status 0.

        An exception propagates (the process exits non-zero and torchrun ends the others).
        SIGTERM / SIGINT end the process at once: a follower holds no state of its own to save.
        """
        assert self.ranks is not None and self.ranks.rank > 0
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        while True:
            cmd = self.ranks.receive()
            if isinstance(cmd, StopCommand):
                self.ranks.close()
                return 0
            self.execute(cmd)
