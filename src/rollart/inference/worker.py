"""The inference worker process (``rollart serve-inference``): vLLM ``AsyncLLM`` behind an RpcServer.

Operations (messages in ``rollart.transport.messages``, inference section):

- ``Generate`` -> ``GenerateResult``: token ids in, generated ids + behaviour logprobs + the policy
  version of every token out; requests run concurrently (vLLM continuous batching). The worker
  keeps each trajectory's tokens (``rollart.inference.prefixes``), so a turn sends only the tokens
  that are new; ``prefix_unknown`` asks for the whole prompt.
- ``Abort`` -> ``Ack``; the aborted ``Generate`` replies ``finish_reason="abort"`` with its tokens.
- ``Pause(keep|abort)`` / ``Resume`` -> ``Ack``; ``GetStats`` -> ``WorkerStats``.
- ``WeightBucket`` -> ``Ack`` (staged, checked); ``ApplyWeights`` -> ``WeightsApplied`` once the
  engine serves the new version (handlers in ``rollart.weights.receiver``).
- Collective weight transfer (``--weight-transfer nccl|gloo``, see ``rollart.weights.vllm_engines``):
  ``WeightTransferInit`` / ``Start`` / ``Update`` / ``Finish`` / ``Shutdown`` -> ``Ack``; the
  trainer broadcasts a version straight into the paused engine's model, and ``ApplyWeights``
  for that version then only relabels tokens and resets the prefix cache.

Weight versions and the KV cache: the engine core labels every step's tokens with the version set
by ``update_weight_version`` (set while paused, right after the reload), which gives exact
per-token versions even for requests that span an update. Each prompt is submitted with
``cache_salt`` = the version current at submission, so a new request never reuses prefix-cache
blocks computed under older weights, even when ``reset_prefix_cache`` cannot drop blocks still
held by in-flight requests (``ApplyWeights(reprefill=False)``, the keep-the-KV mode).

A dead engine core makes the process exit with status 1 and a ``FATAL`` line on stderr; clients
then see ``PeerDeadError``. A failure inside one request replies ``engine_error`` for it only,
with its ``fault``: ``transient`` when the engine refused it for now (overloaded: vLLM's
``GracefulHTTPError``; ``RetryableRequestError``), which the controller retries after a pause
without holding it against the worker, else ``fatal`` (a crashed engine, no output).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Literal

from rollart.filemodes import apply_umask
from rollart.inference.engine import (
    DEFAULT_KV_CACHE_BYTES,
    EngineOptions,
    SchedulerCounts,
    build_engine,
    completion_from_output,
    to_vllm_sampling,
)
from rollart.inference.prefixes import DEFAULT_MAX_PREFIX_TOKENS, PrefixStore
from rollart.inference.toolcalls import parse_tool_calls
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import ConfigError, RemoteError
from rollart.transport.rpc import Handler, RpcServer
from rollart.transport.security import Auth, add_auth_args, service_auth
from rollart.weights.basestate import WorkerBases
from rollart.weights.membership import membership_key
from rollart.weights.receiver import WeightReceiver
from rollart.weights.staging import CheckpointLayout, WeightStager

log = logging.getLogger("rollart.inference.worker")

#: how long an Abort keeps re-issuing the engine abort while the request is still registering
ABORT_GRACE_S = 5.0
ENGINE_POLL_S = 0.5


class _Active:
    """An in-flight Generate: ``done`` is set once its handler has its final output."""

    def __init__(self) -> None:
        self.done = asyncio.Event()


class InferenceWorker(WeightReceiver):
    """The RPC handlers around one ``AsyncLLM`` (the weight handlers are ``WeightReceiver``'s).

    Args:
        engine: a started ``AsyncLLM`` built with ``rollart``'s worker extension.
        name: worker name reported in ``WorkerStats``.
        version: policy version of the weights the engine starts with.
        stager: where weight buckets are staged.
        counts: scheduler counts fed by the engine's stat logger.
        max_prefix_tokens: bound on the trajectory prefix tokens kept (``PrefixStore``).
        membership_key: the run's weight-transfer membership key
            (``rollart.weights.membership.membership_key(auth)``); None joins no collective
            weight-transfer group.
    """

    def __init__(
        self,
        engine,
        *,
        name: str,
        version: int,
        stager: WeightStager,
        counts: SchedulerCounts,
        weight_transfer: Literal["zmq", "nccl", "gloo"] = "zmq",
        num_ranks: int = 1,
        max_prefix_tokens: int = DEFAULT_MAX_PREFIX_TOKENS,
        membership_key: bytes | None = None,
    ) -> None:
        self.engine = engine
        self.membership_key = membership_key
        self.prefixes = PrefixStore(max_prefix_tokens)
        self.weight_transfer: Literal["zmq", "nccl", "gloo"] = weight_transfer
        self.num_ranks = num_ranks
        #: version the model holds after a collective update, not yet applied (labelled)
        self.received_version: int | None = None
        self._updating = False
        self.name = name
        self.version = version
        self.stager = stager
        self.bases = WorkerBases(stager)
        self.counts = counts
        self.paused = False
        self.generated_tokens = 0
        #: requests that ended aborted (``Abort``, ``Pause(abort)``) since start
        self.aborted_requests = 0
        self.fatal = asyncio.Event()
        self.fatal_reason = ""
        self._active: dict[str, _Active] = {}
        # Pause / Resume / ApplyWeights change the engine's pause state: one at a time.
        self._control = asyncio.Lock()

    def handlers(self) -> dict[type, Handler]:
        return {
            m.Generate: self.generate,
            m.Abort: self.abort,
            m.Pause: self.pause,
            m.Resume: self.resume,
            m.GetStats: self.get_stats,
            **self.weight_handlers(),
        }

    def stats(self) -> m.WorkerStats:
        """Counts from this worker's registry, split running/waiting by the scheduler's report."""
        total = len(self._active)
        waiting = min(self.counts.waiting, total)
        return m.WorkerStats(
            worker=self.name,
            num_running=total - waiting,
            num_waiting=waiting,
            version=self.version,
            paused=self.paused,
            num_generated_tokens=self.generated_tokens,
            num_aborted=self.aborted_requests,
            num_ranks=self.num_ranks,
            weight_transfer=self.weight_transfer,
            kv_cache_usage=self.counts.kv_usage,
            kv_capacity_tokens=self.counts.kv_capacity_tokens,
            kv_block_tokens=self.counts.kv_block_tokens,
        )

    def die(self, reason: str) -> None:
        """Mark the worker unusable; ``serve`` exits the process with status 1."""
        if not self.fatal.is_set():
            self.fatal_reason = reason
            self.fatal.set()

    async def watch_engine(self) -> None:
        """Poll the engine's liveness; a dead engine core is fatal for the process."""
        while not self.fatal.is_set():
            if self.engine.errored:
                self.die("the vLLM engine core died (see its log above)")
                return
            await asyncio.sleep(ENGINE_POLL_S)

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, msg: m.Generate, _frames) -> m.GenerateResult:
        from vllm.exceptions import GracefulHTTPError, RetryableRequestError, VLLMClientError
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        rid = msg.request_id
        if rid in self._active:
            raise RemoteError("bad_request", f"request id {rid!r} is already in flight")
        prompt_bytes = self.prefixes.take_prompt(msg)
        # vLLM takes a list of ints: one C-level conversion of the whole prompt, here only
        prompt_ids = tb.view_i32(prompt_bytes).tolist()
        state = self._active[rid] = _Active()
        submitted_version = self.version
        final = None
        try:
            # Rendered synchronously (token ids need no tokenizer): vLLM's raw-prompt path hops
            # to a thread pool first, a window in which an Abort would find no request.
            (prompt,) = self.engine.renderer.render_cmpl(
                [
                    TokensPrompt(
                        prompt_token_ids=prompt_ids,
                        cache_salt=f"v{submitted_version}",
                    )
                ]
            )
            async for out in self.engine.generate(prompt, to_vllm_sampling(msg.sampling), rid):
                final = out
        except EngineDeadError as exc:
            self.die(f"the vLLM engine died during request {rid!r}: {exc}")
            raise RemoteError("engine_error", f"engine dead: {exc}", fault="fatal") from exc
        except (VLLMClientError, ValueError, TypeError) as exc:
            # The input's fault (too long, id out of vocabulary), not the engine's: bad_request
            # does not count towards this worker's quarantine, engine_error does.
            raise RemoteError("bad_request", f"request {rid!r} rejected: {exc}") from exc
        except (GracefulHTTPError, RetryableRequestError) as exc:
            # Overloaded (a full queue, a prefill backlog) or told to retry: a healthy engine,
            # the same request may pass later. The controller retries it after a pause and
            # does not count it towards this worker's quarantine.
            raise RemoteError("engine_error", f"request {rid!r} refused for now: "
                              f"{type(exc).__name__}: {exc}", fault="transient") from exc
        except EngineGenerateError as exc:
            cause = exc.__cause__ or exc
            transient = isinstance(cause, (GracefulHTTPError, RetryableRequestError))
            raise RemoteError(
                "engine_error", f"request {rid!r} failed: {type(cause).__name__}: {cause}",
                fault="transient" if transient else "fatal",
            ) from exc
        finally:
            del self._active[rid]
            state.done.set()
        if final is None:
            raise RemoteError("engine_error", f"request {rid!r}: the engine returned no output",
                              fault="fatal")
        comp = completion_from_output(final, fallback_version=submitted_version)
        self.generated_tokens += len(comp.token_ids)
        token_bytes = tb.pack_i32(comp.token_ids)
        if comp.finish_reason != "abort":
            self.prefixes.keep(msg.trajectory_id, prompt_bytes, token_bytes)
        else:
            self.aborted_requests += 1
        content, tool_calls = None, None
        if msg.tool_parser:
            content, tool_calls = parse_tool_calls(
                msg.tool_parser, self.engine.get_tokenizer(), comp.token_ids)
        return m.GenerateResult(
            request_id=rid,
            token_ids=token_bytes,
            logprobs=tb.pack_f32(comp.logprobs),
            versions=tb.pack_i32(comp.versions),
            finish_reason=comp.finish_reason,
            num_prompt_tokens=len(prompt_ids),
            stats=self.stats(),
            prompt_logprobs=comp.prompt_logprobs,
            tool_calls=tool_calls,
            content=content,
            num_cached_tokens=cached if self.counts.prefix_caching and isinstance(
                cached := getattr(final, "num_cached_tokens", None), int) and cached >= 0
            else None,
        )

    async def abort(self, msg: m.Abort, _frames) -> m.Ack:
        """Abort ``msg.request_id``; idempotent (an unknown or finished id is acknowledged)."""
        state = self._active.get(msg.request_id)
        if state is None:
            return m.Ack(detail=f"request {msg.request_id!r} is not in flight")
        # The Generate handler may still be inside engine.add_request, where vLLM ignores an
        # abort for an id it does not know yet: repeat until the request has finished.
        deadline = time.monotonic() + ABORT_GRACE_S
        while not state.done.is_set() and time.monotonic() < deadline:
            await self.engine.abort(msg.request_id)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.done.wait(), 0.1)
        if not state.done.is_set():
            return m.Ack(detail=f"abort of {msg.request_id!r} requested; still finishing")
        return m.Ack(detail=f"aborted {msg.request_id!r}")

    # -- pause / resume / stats ------------------------------------------------------------------

    async def pause(self, msg: m.Pause, _frames) -> m.Ack:
        """``keep``: in-flight requests wait with their KV cache; ``abort``: they are aborted
        (each replies with the tokens it has). New requests queue until ``Resume``."""
        async with self._control:
            # The prefix cache stays: cache_salt already separates weight versions.
            await self.engine.pause_generation(mode=msg.mode, clear_cache=False)
            self.paused = True
        return m.Ack(detail=f"paused ({msg.mode})")

    async def resume(self, _msg: m.Resume, _frames) -> m.Ack:
        if self._updating:
            # Generating from a half-loaded model would crash the engine (and serve a mix).
            raise RemoteError("bad_request", "Resume refused: a collective weight update is in "
                              "progress (WeightTransferStart without Finish)")
        async with self._control:
            await self.engine.resume_generation()
            self.paused = False
        return m.Ack(detail="resumed")

    async def get_stats(self, _msg: m.GetStats, _frames) -> m.WorkerStats:
        return self.stats()


# -- process ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="rollart serve-inference", description="Serve a vLLM inference worker over ZeroMQ."
    )
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    p.add_argument(
        "--address", default="tcp://127.0.0.1:0", help="ZeroMQ bind address (:0 = any port)"
    )
    p.add_argument("--name", default="inference", help="worker name in stats and logs")
    p.add_argument("--ready-file", help="write the bound address here once serving")
    p.add_argument("--kv-cache-bytes", type=int, default=DEFAULT_KV_CACHE_BYTES)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPU only")
    p.add_argument("--gpu-memory-utilization", type=float,
                   help="GPU only: memory fraction for vLLM (replaces --kv-cache-bytes)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--weight-transfer", choices=["zmq", "nccl", "gloo"], default="zmq",
                   help="how new weights arrive: staged zmq buckets, or a collective group "
                        "with the trainer (nccl on GPU, gloo on CPU)")
    p.add_argument("--version", type=int, default=0, help="policy version of the --model weights")
    p.add_argument("--stage-dir", help="where weight buckets are staged (default /dev/shm)")
    p.add_argument("--max-prefix-tokens", type=int, default=DEFAULT_MAX_PREFIX_TOKENS,
                   help="bound on trajectory prompt tokens kept for delta prompts (4 B each)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_WORKER_MESSAGE_BYTES,
                   help="largest request (all frames): a weight bucket plus its header; "
                        "rollart run passes trainer.weight_bucket_bytes + 64 MiB")
    p.add_argument("--log-level", default="INFO")
    add_auth_args(p)
    args = p.parse_args(argv)
    model = Path(args.model)
    if not (model / "config.json").is_file():
        p.error(f"--model {args.model}: not a checkpoint directory (no config.json)")
    if args.kv_cache_bytes <= 0:
        p.error(f"--kv-cache-bytes must be positive, got {args.kv_cache_bytes}")
    if args.version < 0:
        p.error(f"--version must be >= 0, got {args.version}")
    if args.max_prefix_tokens <= 0:
        p.error(f"--max-prefix-tokens must be positive, got {args.max_prefix_tokens}")
    if not 0 < args.max_message_bytes <= 1 << 40:
        p.error(f"--max-message-bytes must be in (0, 2**40], got {args.max_message_bytes}")
    return args


#: Largest request of a worker run by hand: the trainer's default weight bucket
#: (``trainer.weight_bucket_bytes`` = 1 GiB) plus 64 MiB for the header and a lone tensor's
#: slack.
DEFAULT_WORKER_MESSAGE_BYTES = (1 << 30) + (64 << 20)
#: Frames a worker takes whatever its model: a ``Generate`` body is its prompt delta as int32
#: (4 B per token: 64 MiB = 16M tokens, far above any ``max_model_len``).
_MIN_WORKER_FRAME_BYTES = 64 << 20


def frame_limit(layout: CheckpointLayout | None, max_message_bytes: int) -> int:
    """The worker socket's ``MAXMSGSIZE`` (bytes): its largest legitimate frame.

    A weight bucket carries one frame per tensor, in the trainer's dtype (at most float32: 4 B
    per element), so the largest frame is the checkpoint's largest tensor at 4 B per element;
    other requests need at most ``_MIN_WORKER_FRAME_BYTES``. Without a safetensors layout
    (nothing to size from) the whole ``max_message_bytes``.
    """
    if layout is None or not layout.shapes:
        return max_message_bytes
    largest = max(math.prod(shape) for shape in layout.shapes.values()) * 4
    return max(largest, _MIN_WORKER_FRAME_BYTES)


def _write_ready_file(path: str, address: str) -> None:
    # Atomic: a launcher polling for the file never reads a partial address.
    tmp = f"{path}.tmp{os.getpid()}"
    Path(tmp).write_text(address + "\n")
    os.replace(tmp, path)


async def serve(args: argparse.Namespace, auth: Auth) -> int:
    """Start the engine and the server (only ``auth``'s holders are served); return the
    process exit status (1 on a fatal error)."""
    opts = EngineOptions(
        model=args.model,
        kv_cache_bytes=args.kv_cache_bytes,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        weight_transfer=args.weight_transfer,
    )
    stager = WeightStager(args.stage_dir, CheckpointLayout.from_model_dir(args.model))
    counts = SchedulerCounts()
    counts.prefix_caching = opts.enable_prefix_caching
    engine = None
    server = None
    tasks: list[asyncio.Task] = []
    # Installed before the engine starts: a SIGTERM during start-up (a launcher stopping, or
    # dying) then ends this process through the `finally` below, which shuts the engine core
    # down, instead of killing it at once and leaving the engine core behind.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        engine = build_engine(opts, counts)
        await engine.update_weight_version(str(args.version))
        worker = InferenceWorker(
            engine, name=args.name, version=args.version, stager=stager, counts=counts,
            weight_transfer=args.weight_transfer, num_ranks=args.tensor_parallel_size,
            max_prefix_tokens=args.max_prefix_tokens, membership_key=membership_key(auth),
        )
        frame_bytes = frame_limit(stager.layout, args.max_message_bytes)
        server = RpcServer(args.address, worker.handlers(), name=args.name, auth=auth,
                           max_message_bytes=max(args.max_message_bytes, frame_bytes),
                           max_frame_bytes=frame_bytes)
        tasks = [
            asyncio.create_task(server.serve_forever()),
            asyncio.create_task(worker.watch_engine()),
            asyncio.create_task(worker.fatal.wait()),
            asyncio.create_task(stop.wait()),
        ]
        if args.ready_file:
            _write_ready_file(args.ready_file, server.address)
        log.info(
            "%s: serving %s on %s (version %d)", args.name, args.model, server.address, args.version
        )
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        if worker.fatal.is_set():
            print(
                f"rollart inference worker {args.name}: FATAL: {worker.fatal_reason}",
                file=sys.stderr,
            )
            return 1
        return 0
    finally:
        for t in tasks:
            t.cancel()
        if server is not None:
            await server.close()
        if engine is not None:
            engine.shutdown()
        stager.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``rollart serve-inference``; returns the exit status."""
    apply_umask()  # staged weights are the policy: private (rollart.filemodes)
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; plain asyncio still works without it
        uvloop = None
    run = uvloop.run if uvloop is not None else asyncio.run
    try:
        # Before the engine starts: a bad key file fails in a second, not after the model loads.
        auth = service_auth(args.key_file, args.insecure, args.address)
    except ConfigError as exc:
        print(f"rollart serve-inference: {exc}", file=sys.stderr)
        return 2
    from rollart.inference.companions import check_torch_companions

    try:  # else vLLM fails deep in model inspection, naming none of them
        check_torch_companions()
    except ConfigError as exc:
        print(f"rollart inference worker {args.name}: FATAL: {exc}", file=sys.stderr)
        return 2
    try:
        return run(serve(args, auth))
    except Exception as exc:  # start-up failures (model load, bind) end the process clearly
        log.exception("%s: failed", args.name)
        print(f"rollart inference worker {args.name}: FATAL: {exc!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # The guard matters: vLLM spawns its engine core, which re-imports this module as __mp_main__.
    sys.exit(main())
