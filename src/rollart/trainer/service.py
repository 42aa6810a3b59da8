"""The trainer process (``rollart serve-trainer``): GRPO / decoupled-PPO steps on a Hugging Face
causal LM, versioned weight broadcast to inference workers, DCP checkpoints.

Training runs in a worker thread so the RPC loop keeps answering heartbeats and weight pushes
proceed while the next step computes. After each optimizer step the parameters are snapshotted
as the new version and pushed in the background (``WeightPublisher``); the controller awaits
``WaitPublished`` only when it wants to apply the version (the trainer knows which workers each
push reached and brings the others to it). With a collective ``weight_transfer`` (``nccl`` /
``gloo``) nothing is pushed after the step: ``BroadcastVersion`` broadcasts the current weights
into the (paused) workers' models (``CollectivePublisher``). See ``rollart.weights``.

Under torchrun (``WORLD_SIZE`` > 1) every rank runs this module: rank 0 serves RPC and hands each
train / snapshot / save to the other ranks, which follow (``rollart.trainer.distributed``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from rollart.filemodes import apply_umask
from rollart.transport import messages as m
from rollart.transport.errors import ConfigError, RemoteError
from rollart.transport.rpc import Handler, RpcServer
from rollart.transport.security import INSECURE, Auth, add_auth_args, service_auth

log = logging.getLogger("rollart.trainer")


class TrainerOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Optimizer and broadcast settings of the trainer process (the scenario's ``trainer``)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    bucket_bytes: int = 1 << 30
    seed: int = 0
    num_threads: int = 0  # 0: leave torch's default
    #: torch device of the policy (``cpu``, ``cuda``, ``cuda:1``) and its parameter dtype; under
    #: torchrun ``cpu`` or ``cuda`` (rank r on ``cuda:LOCAL_RANK``).
    device: str = "cpu"
    dtype: str = "float32"
    #: ``zmq``: push each version in the background after its step (``WeightPublisher``);
    #: ``nccl`` / ``gloo``: broadcast it over a process group with the workers when the
    #: controller asks, the workers paused (``CollectivePublisher``).
    weight_transfer: Literal["zmq", "nccl", "gloo"] = "zmq"
    #: host the workers reach the collective group's rendezvous at (the trainer's address).
    weight_transfer_address: str = "127.0.0.1"
    #: rendezvous / per-call limit of a collective broadcast, seconds.
    weight_transfer_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    #: under torchrun: timeout of each training collective (gloo raises, NCCL aborts), seconds.
    collective_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 1800.0
    #: limit of pushing one version to one worker (zmq), seconds; a worker over it, or one
    #: declared dead, is marked unreachable and skipped by later pushes.
    weight_push_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    #: zmq: dtype each version is rounded to before it is sent (``model``: ``dtype``) and
    #: ``off`` / ``xor`` / ``sparse`` delta transfer, a full version every ``weight_full_every``
    #: versions (``rollart.weights.sender``).
    weight_wire_dtype: Literal["model", "bf16", "fp16", "fp32"] = "model"
    weight_delta: Literal["off", "xor", "sparse"] = "off"
    weight_full_every: Annotated[int, msgspec.Meta(ge=1)] = 10


class TrainerService:
    """Holds the model, optimizer and publisher; one RPC handler per trainer message."""

    def __init__(self, model_path: Path, opts: TrainerOptions, step_cfg_json: bytes | None,
                 resume: Path | None, *, auth: Auth, checkpoint_dir: Path | None = None,
                 workers: list[str] | None = None) -> None:
        """``auth``: the run's key (or ``INSECURE``), also used to push weights to workers."""
        import torch
        from transformers import AutoModelForCausalLM

        from rollart.inference.client import InferenceClient
        from rollart.trainer.access import WorkerRegistry
        from rollart.trainer.checkpoint import load_trainer
        from rollart.trainer.distributed import RankGroup, RankRunner, place_model
        from rollart.trainer.step import TrainStepConfig
        from rollart.weights.push import WeightPublisher

        if opts.num_threads:
            torch.set_num_threads(opts.num_threads)
        torch.manual_seed(opts.seed)
        dtype = getattr(torch, opts.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"TrainerOptions.dtype: unknown torch dtype {opts.dtype!r}")
        # Several ranks: the model is FSDP2-sharded over them (None: one process).
        self.ranks = RankGroup.from_env(opts.device, opts.collective_timeout_s)
        self.model = place_model(AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype),
                                 opts.device, self.ranks)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opts.lr,
                                           weight_decay=opts.weight_decay, betas=opts.betas)
        self.step_cfg = (msgspec.json.decode(step_cfg_json, type=TrainStepConfig)
                         if step_cfg_json else TrainStepConfig())
        self.ref_model = None
        if self.step_cfg.kl_coef > 0:
            # The KL term's reference policy is the initial checkpoint (after a resume too):
            # a frozen full copy on each rank's device, costing one more model in memory.
            device = self.ranks.device if self.ranks is not None else opts.device
            # transformers wraps ``PreTrainedModel.to`` in a decorator pyright reads as unbound.
            self.ref_model = AutoModelForCausalLM.from_pretrained(
                model_path, dtype=dtype).to(device).eval().requires_grad_(False)  # pyright: ignore[reportArgumentType]
        self.version = 0
        self.step = 0

        def connect(addr: str) -> InferenceClient:
            return InferenceClient(addr, auth=auth, name=f"worker@{addr}",
                                   default_timeout_s=600.0)

        self.weight_transfer: Literal["zmq", "nccl", "gloo"] = opts.weight_transfer
        from rollart.weights.sender import DeltaSender

        self.wire_dtype = opts.weight_wire_dtype
        self.publisher = WeightPublisher(
            connect, bucket_bytes=opts.bucket_bytes, push_timeout_s=opts.weight_push_timeout_s,
            delta=DeltaSender(opts.weight_delta, full_every=opts.weight_full_every,
                              bucket_bytes=opts.bucket_bytes))
        #: the only workers weights may go to; checkpoints only under checkpoint_dir
        self.registry = WorkerRegistry(workers)
        self.checkpoint_dir = checkpoint_dir
        # Train / snapshot / save go through the runner, which hands them to the other ranks.
        self.runner = RankRunner(self.model, self.optimizer, self.step_cfg, self.ranks,
                                 ref_model=self.ref_model)
        self.collective = None
        kind = opts.weight_transfer
        if kind != "zmq" and (self.ranks is None or self.ranks.rank == 0):
            from rollart.weights.collective import CollectivePublisher
            from rollart.weights.membership import membership_key

            self.collective = CollectivePublisher(
                opts.weight_transfer, self.model, connect,
                address=opts.weight_transfer_address, bucket_bytes=opts.bucket_bytes,
                timeout_s=opts.weight_transfer_timeout_s, membership_key=membership_key(auth),
                run_send=lambda send: self.runner.broadcast_weights(kind, send))
        if resume is not None:  # collective under several ranks: all load at construction
            state = load_trainer(resume, self.model, self.optimizer)
            self.version, self.step = state.version, state.step
            log.info("resumed from %s at version %d", resume, self.version)
        self._resumed = resume is not None and self.version > 0
        self._lock = asyncio.Lock()  # one train step / checkpoint at a time

    async def start(self) -> None:
        """Make a resumed version the publisher's latest, so workers started from the base
        checkpoint can be brought to it (``PublishLatest``)."""
        if self._resumed and self.collective is None:
            self.publisher.publish(self.version, self._wire_snapshot())

    def _wire_snapshot(self) -> list:
        """The parameters as sent: detached CPU copies in the wire dtype."""
        from rollart.weights.delta import to_wire

        return to_wire(self.runner.snapshot(), self.wire_dtype)

    def handlers(self) -> dict[type, Handler]:
        return {
            m.TrainBatch: self.train, m.SetWorkers: self.set_workers,
            m.RegisterWorkers: self.register_workers,
            m.WaitPublished: self.wait_published, m.BroadcastVersion: self.broadcast_version,
            m.PublishLatest: self.publish_latest,
            m.SaveCheckpoint: self.save, m.GetTrainerState: self.status,
        }

    async def train(self, msg: m.TrainBatch, _frames: object) -> m.TrainResult:
        # Each TrainSample validated itself on decode (__post_init__); an invalid one failed
        # the whole batch with a bad_request naming the sample.
        if not msg.samples:
            raise RemoteError("bad_request", "TrainBatch has no samples")
        from rollart.trainer.step import split_batch

        usable, dropped = split_batch(
            msg.samples, self.step_cfg,
            vocab_size=self._vocab_size())
        for sid, why in dropped.items():
            log.warning("version %d: dropped sample %s (%s)", msg.version, sid, why)
        if not usable:
            raise RemoteError("bad_request", f"no sample of the batch can be trained on: "
                              f"{dropped}")
        async with self._lock:
            if msg.version != self.version:
                raise RemoteError("stale_version", f"TrainBatch for version {msg.version}, but "
                                  f"the trainer holds version {self.version}")
            step = self.step
            start = time.perf_counter()
            metrics = await asyncio.to_thread(self.runner.train, usable, self.version)
            agreement = [m.SampleAgreement(*row) for row in self.runner.last_agreement]
            self.version += 1
            self.step = step + 1
            if self.collective is None:
                snapshot = await asyncio.to_thread(self._wire_snapshot)
                self.publisher.publish(self.version, snapshot)
            return m.TrainResult(step=step, version=self.version, metrics=metrics,
                                 train_time_s=time.perf_counter() - start, agreement=agreement,
                                 dropped=dropped)

    async def register_workers(self, msg: m.RegisterWorkers, _frames: object) -> m.Ack:
        """Fix the run's workers (once; ``rollart.trainer.access``) and push to them."""
        self.registry.register(msg.addresses)
        log.info("workers registered for this run: %s", self.registry.registered)
        return await self.set_workers(m.SetWorkers(addresses=msg.addresses), None)

    async def set_workers(self, msg: m.SetWorkers, _frames: object) -> m.Ack:
        self.registry.check(msg.addresses, "SetWorkers")
        if self.collective is not None:
            await self.collective.set_workers(msg.addresses)
        else:
            await self.publisher.set_workers(msg.addresses)
        return m.Ack()

    async def _broadcast(self, version: int) -> m.Published:
        assert self.collective is not None
        if version != self.version:
            raise RemoteError("not_found", f"version {version} is not the trainer's current "
                              f"version {self.version}: a collective broadcast sends only that")
        async with self._lock:  # the parameters must not change during the broadcast
            try:
                report = await self.collective.broadcast(version)
            except RemoteError:
                raise
            except Exception as exc:
                raise RemoteError("internal", f"{self.weight_transfer} broadcast of version "
                                  f"{version} failed: {exc!r}") from exc
        return m.Published(version=report.version, total_s=report.total_s,
                           num_bytes=report.num_bytes, failed=report.failed,
                           wire_bytes=report.wire_bytes, delta_workers=report.delta_workers)

    async def wait_published(self, msg: m.WaitPublished, _frames: object) -> m.Published:
        """Wait for ``msg.version``'s background push; push it to ``msg.addresses`` it missed."""
        if self.collective is not None:
            raise RemoteError("bad_request", f"this trainer broadcasts over "
                              f"{self.weight_transfer}: ask for BroadcastVersion, not "
                              f"WaitPublished")
        self.registry.check(msg.addresses, "WaitPublished")
        try:
            report = await self.publisher.ensure_staged(msg.version, msg.addresses)
        except KeyError:
            raise RemoteError("not_found", f"version {msg.version} was not published "
                              f"(latest: {self.publisher.latest_version})") from None
        except LookupError as exc:
            raise RemoteError("not_found", str(exc)) from None
        return m.Published(version=report.version, total_s=report.total_s,
                           num_bytes=report.num_bytes, failed=report.failed,
                           wire_bytes=report.wire_bytes, delta_workers=report.delta_workers)

    async def broadcast_version(self, msg: m.BroadcastVersion, _frames: object) -> m.Published:
        if self.collective is None:
            raise RemoteError("bad_request", "this trainer pushes over zmq: ask for "
                              "WaitPublished, not BroadcastVersion")
        return await self._broadcast(msg.version)

    async def publish_latest(self, msg: m.PublishLatest, _frames: object) -> m.Published:
        self.registry.check(msg.addresses, "PublishLatest")
        if self.collective is not None:
            # A broadcast reaches the whole group: the addresses must be registered workers.
            await self.collective.set_workers([*self.collective.workers, *msg.addresses])
            return await self._broadcast(self.version)
        if self.publisher.latest_version is None:
            raise RemoteError("not_found", "no version published yet")
        report = await self.publisher.push_latest(msg.addresses)
        return m.Published(version=report.version, total_s=report.total_s,
                           num_bytes=report.num_bytes, failed=report.failed,
                           wire_bytes=report.wire_bytes, delta_workers=report.delta_workers)

    async def save(self, msg: m.SaveCheckpoint, _frames: object) -> m.CheckpointSaved:
        """Save under the checkpoint directory; a path outside it is ``forbidden``."""
        from rollart.trainer.access import CheckpointPathError, forbidden, resolve_checkpoint

        try:
            path = resolve_checkpoint(self.checkpoint_dir, msg.path)
        except CheckpointPathError as exc:
            log.warning("SaveCheckpoint refused: %s", exc)
            raise forbidden(str(exc)) from None
        async with self._lock:
            seconds = await asyncio.to_thread(self.runner.save, path,
                                              version=self.version, step=self.step)
        return m.CheckpointSaved(path=str(path), version=self.version, save_time_s=seconds)

    def _vocab_size(self) -> int:
        # The model is typed nn.Module, whose unknown attributes torch types Tensor | Module;
        # a transformers model has get_input_embeddings, its num_embeddings is an int.
        n = self.model.get_input_embeddings().num_embeddings  # pyright: ignore[reportCallIssue]
        if not isinstance(n, int):
            raise TypeError(f"the model's input embeddings have no integer num_embeddings: {n!r}")
        return n

    async def status(self, _msg: m.GetTrainerState, _frames: object) -> m.TrainerStatus:
        n = sum(p.numel() for p in self.model.parameters())
        return m.TrainerStatus(version=self.version, step=self.step, num_parameters=n,
                               weight_transfer=self.weight_transfer)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollart serve-trainer", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path, help="local Hugging Face checkpoint dir")
    p.add_argument("--address", default="tcp://127.0.0.1:0", help="ZMQ endpoint to bind")
    p.add_argument("--ready-file", type=Path, help="write the bound address here once serving")
    p.add_argument("--options", default="{}", help="TrainerOptions as JSON")
    p.add_argument("--step-config", default="", help="TrainStepConfig as JSON")
    p.add_argument("--resume", type=Path, help="checkpoint dir (step_NNNNNN) to load")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_TRAINER_MESSAGE_BYTES,
                   help="largest request (a TrainBatch); rollart run sizes it from the scenario "
                        "(trainer_message_bytes)")
    p.add_argument("--checkpoint-dir", type=Path,
                   help="the only directory SaveCheckpoint writes under (names are relative to "
                   "it); without it SaveCheckpoint is refused")
    p.add_argument("--worker", action="append", default=None, metavar="ADDRESS",
                   help="register an inference worker at start (repeatable); then no "
                   "RegisterWorkers may add others. Default: the controller registers them")
    add_auth_args(p)
    args = p.parse_args(argv)
    if not 0 < args.max_message_bytes <= 1 << 40:
        p.error(f"--max-message-bytes must be in (0, 2**40], got {args.max_message_bytes}")
    return args


#: Largest request of a trainer started by hand: a ``TrainBatch`` of e.g. 1024 samples of
#: 32k tokens at 9 B per token (int32 id, float32 logprob, uint8 mask) is ~300 MB.
DEFAULT_TRAINER_MESSAGE_BYTES = 1 << 30


def trainer_message_bytes(batch_size: int, max_tokens_per_trajectory: int) -> int:
    """``--max-message-bytes`` for a trainer fed ``batch_size`` samples of at most
    ``max_tokens_per_trajectory`` tokens: 9 B per token on the wire (int32 token id, float32
    behaviour logprob, uint8 loss mask: ``TrainSample``), doubled for msgpack framing and ids,
    plus 16 MiB; at least 64 MiB."""
    return max(64 << 20, 2 * 9 * batch_size * max_tokens_per_trajectory + (16 << 20))


async def _serve(args: argparse.Namespace, auth: Auth) -> int:
    opts = msgspec.json.decode(args.options.encode(), type=TrainerOptions)
    service = TrainerService(args.model, opts, args.step_config.encode() or None, args.resume,
                             auth=auth, checkpoint_dir=args.checkpoint_dir, workers=args.worker)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    exit_code = 0

    def fatal() -> None:  # the ranks failed: stop serving, after a moment to send the error
        nonlocal exit_code
        exit_code = 1
        loop.call_later(1.0, stop.set)

    def on_fatal(_exc: BaseException) -> None:
        loop.call_soon_threadsafe(fatal)

    service.runner.on_fatal = on_fatal
    await service.start()
    server = RpcServer(args.address, service.handlers(), name="trainer",
                       auth=auth, max_message_bytes=args.max_message_bytes)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(server.serve_forever())
    if args.ready_file:
        args.ready_file.write_text(server.address)
    log.info("trainer serving on %s (version %d)", server.address, service.version)
    await stop.wait()
    await server.close()
    serving.cancel()
    await service.publisher.close()
    if service.collective is not None:
        await service.collective.close()
    await asyncio.to_thread(service.runner.stop)
    return exit_code


def _follow(args: argparse.Namespace) -> int:
    # A rank > 0 under torchrun: same construction as rank 0 (collective), then its commands.
    opts = msgspec.json.decode(args.options.encode(), type=TrainerOptions)
    # A follower rank opens no socket, but builds the same service (the key is not used).
    service = TrainerService(args.model, opts, args.step_config.encode() or None, args.resume,
                             auth=INSECURE, checkpoint_dir=args.checkpoint_dir,
                             workers=args.worker)
    return service.runner.follow()


def main(argv: list[str] | None = None) -> int:
    apply_umask()  # checkpoints hold the policy: private (rollart.filemodes)
    rank = os.environ.get("RANK", "0") if "WORLD_SIZE" in os.environ else ""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(name)s{rank and f'[{rank}]'} %(message)s")
    args = _parse(argv)
    from rollart.trainer.distributed import die_with_parent, is_follower

    if rank:
        die_with_parent()  # torchrun put us in our own session: go when it goes
    if is_follower():
        return _follow(args)
    try:
        auth = service_auth(args.key_file, args.insecure, args.address)
    except ConfigError as exc:
        print(f"rollart serve-trainer: {exc}", file=sys.stderr)
        return 2
    import uvloop

    return uvloop.run(_serve(args, auth))


if __name__ == "__main__":
    sys.exit(main())
