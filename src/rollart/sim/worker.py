"""SIMULATED inference worker: continuous batching timed by the roofline cost model.

``SimInferenceWorker`` has the methods of ``rollart.inference.client.InferenceClient`` and runs
in-process: no engine, no tokens computed. Time passes only through ``asyncio`` sleeps on the
running loop's clock, so under a virtual clock (``rollart.sim.clock``) hours of simulated
generation take seconds, and under a normal loop the same code runs in real time.

Engine model (vLLM V1-like, one iteration at a time):
- admit waiting requests while ``len(running) < max_batch`` and their KV fits the pool; the
  prefix cache lives IN the same KV pool (vLLM's automatic prefix caching keeps freed blocks
  as cache): idle cached sequences are evicted least-recently-used when running requests need
  room, and the hit is looked up at admission, so an evicted prefix is recomputed;
- chunked prefill: while any running request still has prompt tokens to compute, an iteration
  computes up to ``max_num_batched_tokens`` of them together with one decode token of every
  other running request (``costs.step_s``); a request whose prefill completes emits its first
  token;
- otherwise decode: every running request gains one token per ``decode_step_s``. Steps are
  simulated in chunks up to the next finish; an arrival, abort or pause ends the chunk at the
  next step boundary so admission latency is exact to one step;
- when decode growth would overflow the KV pool (after evicting the cache), the latest admitted
  request is preempted back to the waiting queue and recomputed later (recompute preemption);
- ``apply_weights(reprefill=True)``: every running request recomputes its whole KV (prompt and
  generated tokens) before it decodes again (AReaL-style interrupt + re-prefill).

Prompts arrive as deltas on the prefix the worker holds for a trajectory
(``rollart.inference.prefixes.PrefixStore``, as the vLLM worker keeps it).

Response lengths: the prompt's domain (``DomainTable.for_prompt``) gives the distribution; the
draw is seeded by ``(seed, request_id)``, independent of routing and arrival order.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from rollart.inference.prefixes import DEFAULT_MAX_PREFIX_TOKENS, PrefixStore
from rollart.sim import costs
from rollart.sim.hardware import HardwareProfile
from rollart.sim.models import ModelProfile
from rollart.sim.prefix_cache import PrefixCache
from rollart.sim.workload import (
    EOS_TOKEN_ID,
    GEN_TOKEN_ID,
    Dist,
    DomainTable,
    seeded_rng,
)
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import PeerDeadError, RemoteError, RemoteTimeoutError

_GEN_I32 = tb.pack_i32([GEN_TOKEN_ID])
_EOS_I32 = tb.pack_i32([EOS_TOKEN_ID])

_EPS = 1e-9


@dataclass
class _Request:
    rid: str
    prompt: Sequence[int]  # int32 memoryview of prompt_bytes
    target: int  # tokens this request will generate before finishing
    finish: Literal["stop", "length"]
    logprob: float
    fut: asyncio.Future
    generated: int = 0
    to_prefill: int = 0  # tokens the next prefill must compute for this request
    segments: list[list[int]] = field(default_factory=list)  # [version, num_tokens]
    trajectory_id: str = ""
    prompt_bytes: bytes = b""  # the prompt as int32 bytes, kept as the trajectory's prefix
    num_cached: int = 0  # prompt tokens its first admission took from the prefix cache

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt) + self.generated


class SimInferenceWorker:
    """A SIMULATED inference engine on ``tp`` x ``hardware`` serving ``model``.

    Args:
        name: worker name (stats, logs).
        hardware, model, tp: the engine's devices and model (``tp`` devices, tensor parallel).
        domains: task domains; the prompt's domain picks the response-length distribution.
        seed: base seed of response-length draws.
        max_batch: most concurrently running requests (vLLM ``max_num_seqs``).
        eff: achieved fractions of peak (``rollart.sim.costs.Efficiency``).
        memory_utilization: share of device memory for weights + KV cache.
        default_response: response-length distribution for prompts of no known domain.
        prefix_cache: reuse the KV of a previous request's prompt + response when a new prompt
            extends it (multi-turn), as vLLM's automatic prefix caching does; the cache shares
            the KV pool with running requests.
        max_num_batched_tokens: tokens one iteration computes (chunked-prefill budget);
            default 8192, vLLM V1's default for an OpenAI server on >= 70 GiB GPUs
            (``vllm.engine.arg_utils.EngineArgs``, usage-context defaults).
        time_scale: multiplies every simulated duration; 0 makes the engine answer at once
            (the controller-overhead benchmark serves it that way over real ZeroMQ).
        max_prefix_tokens: bound on trajectory prompt tokens held for delta prompts.

    Raises ``ValueError`` if the model does not fit on ``tp`` devices.
    """

    def __init__(self, name: str, *, hardware: HardwareProfile, model: ModelProfile,
                 domains: DomainTable, seed: int = 0, tp: int = 1, max_batch: int = 256,
                 eff: costs.Efficiency = costs.DEFAULT_EFFICIENCY,
                 memory_utilization: float = 0.9,
                 default_response: Dist | None = None, prefix_cache: bool = True,
                 time_scale: float = 1.0, max_num_batched_tokens: int = 8192,
                 max_prefix_tokens: int = DEFAULT_MAX_PREFIX_TOKENS) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got "
                             f"{max_num_batched_tokens}")
        self.max_num_batched_tokens = max_num_batched_tokens
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        self.time_scale = time_scale
        self.prefixes = PrefixStore(max_prefix_tokens)
        self.name = name
        #: where the trainer sends weights: in process, the unique worker name
        self.address = name
        self.hardware, self.model, self.tp, self.eff = hardware, model, tp, eff
        self.domains, self.seed, self.max_batch = domains, seed, max_batch
        self.capacity = costs.kv_capacity_tokens(model, hardware, tp=tp,
                                                 memory_utilization=memory_utilization)
        self.default_response = default_response or Dist("lognormal", 512, 256, 1, 1e9)
        self.prefix_cache = prefix_cache
        self.dead = False
        self.last_stats: m.WorkerStats | None = None
        self.version = 0
        self.paused = False
        self.num_generated_tokens = 0
        self.busy_s = 0.0  # engine time spent in prefill or decode (utilisation)
        self._waiting: collections.deque[_Request] = collections.deque()
        self._ids: set[str] = set()  # request ids pending (waiting or running)
        self._running: dict[str, _Request] = {}
        self._staged: dict[int, float] = {}  # version -> bytes staged
        self._cache = PrefixCache()
        self.prefix_hit_tokens = 0  # prompt tokens served from the prefix cache
        self.prefill_tokens = 0  # tokens computed by prefill (first, re-prefill, preemption)
        self._chunk: tuple[float, float, int] | None = None  # (start, step_s, steps)
        self._wake_fut: asyncio.Future | None = None
        self._parked = asyncio.Event()
        self._engine_task: asyncio.Task | None = None

    @property
    def cache_evicted_tokens(self) -> int:
        """Prefix-cache tokens evicted so far to make room for running requests."""
        return self._cache.evicted_tokens

    # ---------------------------------------------------------------- InferenceClient methods

    async def generate(self, request: m.Generate, *,
                       timeout_s: float | None = None) -> m.GenerateResult:
        """Generate (simulated) tokens for ``request``; see ``m.GenerateResult``.

        Raises ``PeerDeadError`` when the worker was killed, ``RemoteError("bad_request")``
        when the prompt alone exceeds the KV cache (the input's fault, as vLLM refuses it),
        ``RemoteTimeoutError`` after ``timeout_s``
        (the request is aborted). Cancelling the caller aborts the request.
        """
        self._check_alive()
        if request.request_id in self._ids:
            raise RemoteError("bad_request", f"duplicate request_id {request.request_id!r}")
        prompt_bytes = self.prefixes.take_prompt(request)
        # A zero-copy int32 view: a list would cost ~40 bytes and a conversion per prompt token
        # on every turn, and long contexts are held by thousands of waiting requests at once.
        tb.view_i32(prompt_bytes)  # raises ValueError on a ragged length
        prompt = memoryview(prompt_bytes).cast("i")  # native int32: the wire is little-endian
        if len(prompt) + 1 > self.capacity:
            raise RemoteError("bad_request", f"prompt of {len(prompt)} tokens "
                              f"exceeds the KV cache ({self.capacity} tokens) of {self.name}")
        spec = self.domains.for_prompt(prompt)
        dist = spec.response_tokens if spec is not None else self.default_response
        rng = seeded_rng(self.seed, request.request_id)
        wanted = max(1, dist.sample_int(rng))
        max_tokens = request.sampling.max_tokens
        req = _Request(
            rid=request.request_id, prompt=prompt,
            trajectory_id=request.trajectory_id, prompt_bytes=prompt_bytes,
            target=min(wanted, max_tokens), finish="stop" if wanted <= max_tokens else "length",
            logprob=-rng.uniform(0.05, 1.5), fut=asyncio.get_running_loop().create_future(),
        )
        req.to_prefill = len(req.prompt)  # the prefix-cache hit is looked up at admission
        self._ids.add(req.rid)
        self._waiting.append(req)
        self._ensure_engine()
        self._wake()
        try:
            if timeout_s is None:
                return await asyncio.shield(req.fut)
            try:
                return await asyncio.wait_for(asyncio.shield(req.fut), timeout_s)
            except TimeoutError:
                await self.abort(req.rid)
                raise RemoteTimeoutError(f"{self.name}: generate {req.rid} exceeded "
                                         f"timeout_s={timeout_s}") from None
        except asyncio.CancelledError:
            await self.abort(req.rid)
            raise

    async def abort(self, request_id: str) -> None:
        """Abort ``request_id``: its ``generate`` returns ``finish_reason="abort"`` with the
        tokens produced so far. Unknown ids are ignored (it may have just finished)."""
        req = self._running.pop(request_id, None)
        if req is not None:
            self._credit(req, self._chunk_progress())
        else:
            for i, r in enumerate(self._waiting):
                if r.rid == request_id:
                    req = r
                    del self._waiting[i]
                    break
        if req is not None:
            self._resolve(req, "abort")
            self._wake()

    async def pause(self, mode: Literal["keep", "abort"] = "keep") -> None:
        """Stop generating at the next step boundary. ``keep``: requests wait (KV kept);
        ``abort``: every request returns now with ``finish_reason="abort"``."""
        self._check_alive()
        self._set_paused(True)
        if mode == "abort":
            for rid in [*self._running, *(r.rid for r in self._waiting)]:
                await self.abort(rid)
        if self._engine_task is not None and not self._engine_task.done():
            self._wake()
            await self._parked.wait()

    async def resume(self) -> None:
        self._check_alive()
        self._set_paused(False)
        self._wake()

    def _set_paused(self, paused: bool) -> None:
        # ``last_stats`` is what routing reads; a real worker's client updates its flag on
        # Pause / Resume (``rollart.inference.client``), so a pool is not judged paused, and
        # kept from spilling, until its next reply.
        self.paused = paused
        if self.last_stats is not None and self.last_stats.paused != paused:
            self.last_stats = msgspec.structs.replace(self.last_stats, paused=paused)

    async def stats(self) -> m.WorkerStats:
        self._check_alive()
        return self._stats()

    async def push_weights(self, version: int, named_tensors: Iterable[tuple[str, Any]], *,
                           bucket_bytes: int) -> None:
        """Stage ``version``: takes ``sum(t.nbytes) / hardware.link_bytes_per_s`` seconds.

        ``named_tensors`` yields ``(name, tensor)`` with any object that has ``nbytes``
        (``rollart.sim.trainer.SimTensor`` or a real tensor).
        """
        self._check_alive()
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        total = float(sum(t.nbytes for _, t in named_tensors))
        await asyncio.sleep(self.time_scale
                            * costs.transfer_s(total, self.hardware.link_bytes_per_s))
        self.stage(version, total)

    def stage(self, version: int, nbytes: float) -> None:
        """Record ``nbytes`` more bytes of ``version`` as arrived (no time passes)."""
        self._check_alive()
        if version <= self.version:
            raise RemoteError("stale_version", f"{self.name}: version {version} <= current "
                              f"{self.version}")
        self._staged[version] = self._staged.get(version, 0.0) + nbytes

    async def apply_weights(self, version: int, *, reprefill: bool = False) -> m.WeightsApplied:
        """Load staged ``version`` (host -> device copy time; ``tp`` devices in parallel).

        ``reprefill``: running requests recompute their KV at the next iteration.
        Raises ``RemoteError`` with ``stale_version`` or ``incomplete_version``.
        """
        self._check_alive()
        if version <= self.version:
            raise RemoteError("stale_version", f"{self.name}: version {version} <= current "
                              f"{self.version}")
        if version not in self._staged:
            raise RemoteError("incomplete_version", f"{self.name}: version {version} was not "
                              "pushed")
        nbytes = self._staged.pop(version)
        apply_s = self.time_scale * costs.transfer_s(nbytes,
                                                     self.tp * self.hardware.h2d_bytes_per_s)
        await asyncio.sleep(apply_s)
        self.version = version
        self._staged = {v: b for v, b in self._staged.items() if v > version}
        self._cache.clear()  # KV computed by older weights is not reused by new requests
        if reprefill:
            for req in self._running.values():
                req.to_prefill = req.kv_tokens  # KV computed by the old weights is discarded
        self._wake()
        return m.WeightsApplied(version=version, apply_time_s=apply_s, stats=self._stats())

    async def close(self) -> None:
        self.kill("closed")

    def kill(self, reason: str = "killed") -> None:
        """Fault injection: the worker dies; every pending and later call raises
        ``PeerDeadError``."""
        if self.dead:
            return
        self.dead = True
        for req in [*self._running.values(), *self._waiting]:
            if not req.fut.done():
                req.fut.set_exception(PeerDeadError(f"{self.name}: {reason}"))
        self._running.clear()
        self._waiting.clear()
        self._ids.clear()
        if self._engine_task is not None:
            self._engine_task.cancel()

    # ------------------------------------------------------------------------------ engine

    def _check_alive(self) -> None:
        if self.dead:
            raise PeerDeadError(f"simulated worker {self.name} is dead")

    def _stats(self) -> m.WorkerStats:
        self.last_stats = m.WorkerStats(
            worker=self.name, num_running=len(self._running), num_waiting=len(self._waiting),
            version=self.version, paused=self.paused,
            num_generated_tokens=self.num_generated_tokens,
            kv_cache_usage=min(1.0, self._kv_used() / self.capacity) if self.capacity else None,
            kv_capacity_tokens=self.capacity)
        return self.last_stats

    def _ensure_engine(self) -> None:
        if self._engine_task is None or self._engine_task.done():
            self._engine_task = asyncio.get_running_loop().create_task(
                self._engine(), name=f"sim-engine-{self.name}")

    def _wake(self) -> None:
        fut = self._wake_fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _wait(self, timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._wake_fut = fut = loop.create_future()
        handle = None if timeout_s is None else loop.call_later(timeout_s, self._wake)
        try:
            await fut
        finally:
            if handle is not None:
                handle.cancel()
            self._wake_fut = None

    def _chunk_progress(self) -> int:
        if self._chunk is None:
            return 0
        start, step_s, steps = self._chunk
        done = int((asyncio.get_running_loop().time() - start) / step_s + _EPS)
        return min(steps, done)

    def _kv_used(self) -> int:
        return sum(r.kv_tokens for r in self._running.values())

    async def _engine(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self.paused or not (self._waiting or self._running):
                self._parked.set()
                await self._wait(None)
                continue
            self._parked.clear()
            self._admit()
            if not self._running:
                continue
            self._preempt_to_fit()
            if any(r.to_prefill for r in self._running.values()):
                await self._mixed_iteration()
                continue
            batch = len(self._running)
            room = max(0, self.capacity - self._kv_used() - self._cache.tokens) // batch
            steps = max(1, min(min(r.target - r.generated for r in self._running.values()), room))
            kv_mid = self._kv_used() + batch * (steps - 1) / 2.0
            step_s = self.time_scale * costs.decode_step_s(self.model, self.hardware, batch,
                                                           kv_mid, tp=self.tp, eff=self.eff)
            if step_s <= 0.0:
                await asyncio.sleep(0)  # zero-time engine: still yield to the loop
                for req in self._running.values():
                    self._credit(req, steps)
                self._finish_done()
                continue
            start = loop.time()
            self._chunk = (start, step_s, steps)
            await self._wait(steps * step_s)
            done = self._chunk_progress()
            elapsed = loop.time() - start
            if done < steps and elapsed > done * step_s + _EPS:
                # Interrupted mid-step: the step in flight completes first, as in a real engine.
                await asyncio.sleep((done + 1) * step_s - elapsed)
                done += 1
            self._chunk = None
            self.busy_s += loop.time() - start
            for req in self._running.values():
                self._credit(req, done)
            self._finish_done()

    async def _mixed_iteration(self) -> None:
        """One chunked-prefill iteration: prompt tokens of requests still prefilling (oldest
        first, up to the token budget) plus one decode token of every other running request."""
        decoders = [r for r in self._running.values() if not r.to_prefill]
        budget = max(1, self.max_num_batched_tokens - len(decoders))
        chunks: list[tuple[_Request, int]] = []
        keys = kv_read = 0.0
        for req in self._running.values():
            if budget <= 0:
                break
            if not req.to_prefill:
                continue
            n = min(req.to_prefill, budget)
            done_before = req.kv_tokens - req.to_prefill
            keys += n * done_before + n * (n + 1) / 2.0
            kv_read += done_before
            chunks.append((req, n))
            budget -= n
        prefill = sum(n for _, n in chunks)
        dur = self.time_scale * costs.step_s(
            self.model, self.hardware, decode_seqs=len(decoders),
            decode_kv_tokens=sum(r.kv_tokens for r in decoders), prefill_tokens=prefill,
            prefill_keys=keys, prefill_kv_read=kv_read, tp=self.tp, eff=self.eff)
        await asyncio.sleep(dur)
        self.busy_s += dur
        self.prefill_tokens += prefill
        for req in decoders:
            if self._running.get(req.rid) is req:
                self._credit(req, 1)
        for req, n in chunks:
            if self._running.get(req.rid) is req and req.to_prefill:
                req.to_prefill = max(0, req.to_prefill - n)
                if not req.to_prefill:
                    self._credit(req, 1)  # the last prefill chunk emits the next token
        self._finish_done()

    def _admit(self) -> list[_Request]:
        admitted: list[_Request] = []
        kv = self._kv_used()
        while self._waiting and len(self._running) < self.max_batch:
            req = self._waiting[0]
            fresh = req.generated == 0 and req.to_prefill == len(req.prompt)
            hit_key = self._cache.lookup(req.prompt_bytes) if fresh and self.prefix_cache else None
            hit = self._cache.length(hit_key) if hit_key is not None else 0
            # The hit's blocks move from the cache to the request, so they count once.
            need = req.kv_tokens + 1 - hit
            if not self._cache.evict_for(kv + need, self.capacity, keep=hit_key):
                break
            self._waiting.popleft()
            if hit_key is not None:
                self._cache.drop(hit_key)
                # A full hit still recomputes the last prompt token (its logits are not cached).
                req.to_prefill = max(1, len(req.prompt) - hit)
                self.prefix_hit_tokens += hit
                if req.generated == 0 and not req.num_cached:
                    req.num_cached = min(hit, len(req.prompt) - 1)
            self._running[req.rid] = req
            kv += req.kv_tokens
            admitted.append(req)
        return admitted

    def _preempt_to_fit(self) -> None:
        self._cache.evict_for(self._kv_used() + len(self._running), self.capacity)
        while len(self._running) > 1 and self._kv_used() + len(self._running) > self.capacity:
            rid = next(reversed(self._running))
            req = self._running.pop(rid)
            req.to_prefill = req.kv_tokens  # recompute preemption: its KV is gone
            self._waiting.appendleft(req)

    def _credit(self, req: _Request, n: int) -> None:
        n = min(n, req.target - req.generated)
        if n <= 0:
            return
        req.generated += n
        self.num_generated_tokens += n
        if req.segments and req.segments[-1][0] == self.version:
            req.segments[-1][1] += n
        else:
            req.segments.append([self.version, n])

    def _finish_done(self) -> None:
        for rid in [r.rid for r in self._running.values() if r.generated >= r.target]:
            req = self._running.pop(rid)
            self._resolve(req, req.finish)

    def _resolve(self, req: _Request, reason: m.FinishReason) -> None:
        self._ids.discard(req.rid)
        if req.fut.done():
            return
        n = req.generated
        # Repeated int32 / float32 items packed as bytes directly: the same bytes as packing
        # the lists, without n Python ints per request.
        token_bytes = (_GEN_I32 * (n - 1) + _EOS_I32 if reason == "stop" and n
                       else _GEN_I32 * n)
        versions = b"".join(tb.pack_i32([version]) * count for version, count in req.segments)
        if self.prefix_cache and reason != "abort":
            self._cache.add(req.prompt_bytes + token_bytes)
            self._cache.evict_for(self._kv_used(), self.capacity)
        if reason != "abort":
            self.prefixes.keep(req.trajectory_id, req.prompt_bytes, token_bytes)
        req.fut.set_result(m.GenerateResult(
            request_id=req.rid, token_ids=token_bytes,
            logprobs=tb.pack_f32([req.logprob]) * n, versions=versions,
            finish_reason=reason, num_prompt_tokens=len(req.prompt), stats=self._stats(),
            num_cached_tokens=req.num_cached if self.prefix_cache else None))
