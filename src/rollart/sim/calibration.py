"""SIMULATED calibration workloads: one engine serving a fixed batch of requests, compared across
accelerators against the hardware measurements the RollArt paper reports (§3).

The paper's §3 figures, as ratios of the time one workload takes:

- prefill-heavy (agentic: long prompts / observations, short actions): H800 takes ~0.53x the
  time of H20;
- decode-heavy (long chain-of-thought): H20 takes ~0.49-0.79x the time of H800.

Per GPU or per cost? The paper's own pools are equal-cost (64 H800 + 24 H20 = 72 H800, so one
H20 costs 1/3 of an H800; ``rollart.sim.hardware``). Read per GPU, the numbers contradict the
datasheets: a prefill-heavy workload would run only 1.9x faster on an H800 than on an H20
although its dense bf16 peak is 6.7x higher (989 vs 148 TFLOP/s), and a decode-heavy one would
run up to 2x faster on an H20 although its HBM bandwidth is only 1.19x higher (4.0 vs
3.35 TB/s) and it has 6.7x less compute for large decode batches. Read per cost (time on an
equal budget, i.e. per-GPU time x relative cost), both are consistent with the datasheets:
0.53 per cost is 0.18 per GPU (5.6x faster, under the 6.7x FLOP ratio since the workload also
decodes), and 0.49-0.79 per cost is 1.5-2.4x slower per GPU (compute-bound decode batches on
the H20). rollart therefore uses the PER-COST reading:

    per_cost_ratio(a vs b) = (time_a x relative_cost_a) / (time_b x relative_cost_b)

which assumes a workload spread over ``budget / relative_cost`` devices scales linearly.

``makespan_s`` is the measurement: the real ``SimInferenceWorker`` (chunked prefill, prefix
cache in the KV pool, roofline steps) on the virtual clock, so calibration covers the engine
model, not just the cost formulas. ``serve_closed_loop`` serves the same engine at a fixed
number of requests in flight, the load a serving benchmark applies, for the published serving
reference points below (each with its page and table).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from rollart.sim.hardware import H100, TERA, HardwareProfile
from rollart.sim.models import ModelProfile

# Cost constants the simulator reads (``rollart.sim.costs`` takes its defaults from here, so a
# test pinning these pins what runs). Each names its source and conditions, or says it is an
# assumption. None is fitted to the RollArt paper's end-to-end ratios.

#: Training MFU (model FLOPs / peak, bf16). Source: NVIDIA Megatron-LM README
#: (https://github.com/NVIDIA/Megatron-LM, "up to 47% Model FLOP Utilization (MFU) on H100
#: clusters", GPT models 2B-462B, weak scaling); the upper end of a tuned pretraining run, so
#: an RL trainer with variable-length batches reaches at most this. Was 0.4 (assumption).
TRAIN_MFU = 0.47

#: Prefill MFU of the inference engine. ASSUMPTION (no like-for-like public measurement
#: found): Splitwise (ISCA'24) and vLLM report prefill as compute-bound at 40-60% of peak;
#: the middle is used.
PREFILL_MFU = 0.5

#: Share of peak HBM bandwidth a decode step achieves. ASSUMPTION checked against a public
#: measurement: NVIDIA NIM benchmarking, "Performance" page
#: (https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance), Llama-3.1-8B-Instruct on
#: H100 80G, concurrency 1, ITL 4.37-4.63 ms (NIM 1.3.0 / 1.8.0). An 8B model's weights read
#: in 4.4-4.6 ms need 1.7-1.8 TB/s at 1 byte per parameter (fp8; bf16 would exceed the
#: 3.35 TB/s peak), i.e. 0.52-0.55 of peak including per-step overheads the roofline leaves
#: out; 0.7 is the kernels' share, the rest is scheduling overhead the simulator does not
#: model. Kept at 0.7. Checked at 1-100 requests in flight against NIM's Llama-3.3-70B fp8
#: TP2 sweep on H100 (``NIM_LLAMA33_70B_TP2_5000_500``): throughput and request latency
#: within 13% (tests/unit/test_sim_serving_calibration.py). Not the H20's: Qwen's SGLang
#: measurement of Qwen3-8B / 32B at batch 1 (``QWEN_DOCS_H20_SGLANG_BS1``) implies ~1.37 TB/s
#: achieved, 0.34 of its 4.0 TB/s (at 0.7 it decoded ~2x too fast), and the H20 profile
#: carries that measured share (``hardware.H20_DECODE_BW_EFFICIENCY``).
DECODE_BW_EFFICIENCY = 0.7

#: Forward FLOPs per parameter per token (Kaplan et al. 2020, "Scaling Laws", §2.1, C_forward
#: = 2N); backward is twice the forward (C = 6N for forward + backward).
FORWARD_FLOPS_PER_PARAM = 2.0
BACKWARD_OVER_FORWARD = 2.0


@dataclass(frozen=True)
class EngineWorkload:
    """``num_requests`` requests of ``prompt_tokens`` each generating ``response_tokens``,
    all submitted at time 0 to one engine with ``max_batch`` sequences."""

    name: str
    prompt_tokens: int
    response_tokens: int
    num_requests: int = 128
    max_batch: int = 128


#: Paper §2/§3 agentic turn: long context (up to the 32k window of §7.1), short action.
PREFILL_HEAVY = EngineWorkload("prefill-heavy", prompt_tokens=16_000, response_tokens=200)
#: Paper §2/§3 long chain-of-thought reasoning: short prompt, long response.
DECODE_HEAVY = EngineWorkload("decode-heavy", prompt_tokens=512, response_tokens=8_000)


def makespan_s(workload: EngineWorkload, model: str, hardware: HardwareProfile, *,
               tp: int = 1) -> float:
    """Simulated seconds one ``tp`` x ``hardware`` engine serving ``model`` needs to finish
    every request of ``workload`` (all arrive at once). Raises ``ValueError`` if the model does
    not fit on ``tp`` devices."""
    # Imported here: ``rollart.sim.costs`` imports this module's constants, and the worker
    # imports ``costs``.
    from rollart.sim.clock import run_virtual
    from rollart.sim.models import get_model
    from rollart.sim.worker import SimInferenceWorker
    from rollart.sim.workload import DomainSpec, DomainTable, SimTokenizer, const, observation
    from rollart.transport import messages as m
    from rollart.transport import tokenbytes as tb

    table = DomainTable([DomainSpec(workload.name,
                                    response_tokens=const(workload.response_tokens))])
    tok = SimTokenizer(table)
    profile = get_model(model)

    async def main() -> float:
        worker = SimInferenceWorker("calibration", hardware=hardware, model=profile,
                                    domains=table, tp=tp, max_batch=workload.max_batch)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        # observation(n) encodes to n + 1 tokens; distinct tags keep prompts out of each
        # other's prefix cache.
        prompts = [tok.encode(observation(workload.name, workload.prompt_tokens - 1,
                                          tag=f"r{i}")) for i in range(workload.num_requests)]
        await asyncio.gather(*(
            worker.generate(m.Generate(request_id=f"r{i}", new_token_ids=tb.pack_i32(ids),
                                       sampling=m.SamplingParams(
                                           max_tokens=workload.response_tokens + 1)))
            for i, ids in enumerate(prompts)))
        elapsed = loop.time() - t0
        await worker.close()
        return elapsed

    return run_virtual(main)


# ---------------------------------------------------------------- serving reference points
# Published serving measurements the simulated engine is checked against
# (tests/unit/test_sim_serving_calibration.py). Only the H20's measured decode bandwidth share
# (``hardware.H20_DECODE_BW_EFFICIENCY``, from ``QWEN_DOCS_H20_SGLANG_BS1``) feeds a profile.

#: Llama-3.3-70B-Instruct (https://huggingface.co/meta-llama/Llama-3.3-70B-Instruct,
#: config.json: 80 layers, hidden 8192, 64 query heads, 8 KV heads, head_dim 128; 70.6e9
#: parameters) as NVIDIA NIM serves it in its "fp8 TP2" profile: 1-byte
#: weights and, ASSUMED, a 1-byte (fp8) KV cache. The KV dtype is not stated on the page; the
#: table implies it: at concurrency 100 the running batch is throughput x ITL = 917 x 0.0929
#: = 85 sequences of ~5.3k tokens, which fits 2 x 80 GB after the weights with fp8 KV (~81 at
#: 0.9 memory utilisation) but not with bf16 KV (~40). The closest published concurrency sweep
#: to Qwen3-32B on TP > 1 that was found (a dense GQA model, 4k-16k context).
LLAMA33_70B_FP8 = ModelProfile("llama-3.3-70b-fp8", 70.6e9, 70.6e9, num_layers=80,
                               hidden_size=8192, num_kv_heads=8, head_dim=128,
                               num_attention_heads=64, bytes_per_param=1, kv_bytes_per_elem=1)

#: H100 SXM running fp8 GEMMs: 1979 TFLOP/s dense fp8 (NVIDIA H100 datasheet, "FP8 Tensor Core
#: 3,958 TFLOPS*" with *sparsity); bandwidth and memory as ``hardware.H100``. Only for the fp8
#: reference above: rollart's own profiles are bf16.
H100_FP8 = replace(H100, name="h100-fp8", flops=1979 * TERA)

#: NVIDIA NIM LLM benchmarking, "Performance" page
#: (https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance), "Llama-3.3-70b-instruct
#: Results", Version 1.8.0, 2 x H100 80G, fp8 TP2, "5000 Input Tokens / 500 Output Tokens"
#: table: concurrency -> (TTFT ms, ITL ms, output throughput tokens/s). Measured with
#: genai-perf / AIPerf at a fixed concurrency (closed loop). The engine is NIM's
#: (TensorRT-LLM), not vLLM: no vLLM sweep at 4k-16k context with a fixed concurrency was found
#: for Qwen3 on H100 / H800. The same table for NIM 1.5.0 reads 777 tokens/s at concurrency
#: 100 (917 in 1.8.0): one engine's versions differ by ~18% on the same hardware.
NIM_LLAMA33_70B_TP2_5000_500: dict[int, tuple[float, float, float]] = {
    1: (406.77, 18.58, 51.67),
    5: (546.70, 21.83, 218.48),
    25: (688.69, 38.75, 623.40),
    50: (834.51, 59.73, 814.37),
    100: (7996.25, 92.91, 917.26),
}

#: Qwen documentation, "Speed Benchmark" / 效率评估
#: (https://qwen.readthedocs.io/zh-cn/latest/getting_started/speed_benchmark.html; its source,
#: docs/source/getting_started/speed_benchmark.md in github.com/QwenLM/Qwen2.5, reports the
#: Qwen3 series), "Qwen3-8B (SGLang)" and "Qwen3-32B (SGLang)" tables, BF16, 1 GPU:
#: NVIDIA H20 96GB, SGLang 0.4.6.post1, batch size 1, 2048 generated tokens; speed =
#: (prompt + generated tokens) / time. model -> {input length: tokens/s}.
QWEN_DOCS_H20_SGLANG_BS1: dict[str, dict[int, float]] = {
    "qwen3-8b": {1: 81.73, 6144: 296.25, 14336: 524.70},
    "qwen3-32b": {1: 20.72, 6144: 77.82, 14336: 143.08},
}
QWEN_DOCS_GENERATED_TOKENS = 2048


@dataclass(frozen=True)
class ServingResult:
    """What a closed-loop serving run measured (SIMULATED seconds).

    Attributes:
        duration_s: first request sent to last reply.
        output_tokens_per_s: generated tokens / ``duration_s`` (all requests).
        mean_latency_s: mean request latency, send to last token (TTFT + ITL x (n - 1) in a
            serving benchmark's terms).
    """

    duration_s: float
    output_tokens_per_s: float
    mean_latency_s: float


def serve_closed_loop(model: ModelProfile, hardware: HardwareProfile, *, tp: int,
                      concurrency: int, prompt_tokens: int, output_tokens: int,
                      num_requests: int, max_batch: int = 256,
                      prefix_cache: bool = False) -> ServingResult:
    """Serve ``num_requests`` requests of ``prompt_tokens`` in / ``output_tokens`` out on one
    simulated ``tp`` x ``hardware`` engine, ``concurrency`` of them in flight at all times
    (each client sends its next request when its reply arrives), as ``vllm bench serve
    --max-concurrency`` and NVIDIA's genai-perf / AIPerf ``--concurrency`` load a server.

    Prompts are distinct (no prefix-cache hits: random-token benchmark datasets). Raises
    ``ValueError`` for counts below 1 or a model that does not fit on ``tp`` devices.
    """
    from rollart.sim.clock import run_virtual
    from rollart.sim.worker import SimInferenceWorker
    from rollart.sim.workload import DomainSpec, DomainTable, SimTokenizer, const, observation
    from rollart.transport import messages as m
    from rollart.transport import tokenbytes as tb

    for name, value in (("concurrency", concurrency), ("prompt_tokens", prompt_tokens),
                        ("output_tokens", output_tokens), ("num_requests", num_requests)):
        if value < 1:
            raise ValueError(f"serve_closed_loop: {name} must be >= 1, got {value}")
    table = DomainTable([DomainSpec("serve", response_tokens=const(output_tokens))])
    tok = SimTokenizer(table)

    async def main() -> ServingResult:
        worker = SimInferenceWorker("serving", hardware=hardware, model=model, domains=table,
                                    tp=tp, max_batch=max_batch, prefix_cache=prefix_cache)
        loop = asyncio.get_running_loop()
        next_id = iter(range(num_requests))
        latencies: list[float] = []

        async def client() -> None:
            for i in next_id:
                ids = tok.encode(observation("serve", prompt_tokens - 1, tag=f"q{i}"))
                sent = loop.time()
                await worker.generate(m.Generate(
                    request_id=f"q{i}", new_token_ids=tb.pack_i32(ids),
                    sampling=m.SamplingParams(max_tokens=output_tokens + 1)))
                latencies.append(loop.time() - sent)

        t0 = loop.time()
        await asyncio.gather(*(client() for _ in range(min(concurrency, num_requests))))
        duration = loop.time() - t0
        await worker.close()
        return ServingResult(duration, num_requests * output_tokens / duration,
                             sum(latencies) / len(latencies))

    return run_virtual(main)


def per_cost_ratio(workload: EngineWorkload, model: str, a: HardwareProfile,
                   b: HardwareProfile, *, tp: int = 1) -> float:
    """(time on ``a`` x cost of ``a``) / (time on ``b`` x cost of ``b``): below 1 means ``a``
    finishes the workload sooner for the same money (see the module docstring)."""
    return (makespan_s(workload, model, a, tp=tp) * a.relative_cost
            / (makespan_s(workload, model, b, tp=tp) * b.relative_cost))
