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
model, not just the cost formulas.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from rollart.sim.hardware import HardwareProfile

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
#: model. Kept at 0.7.
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


def per_cost_ratio(workload: EngineWorkload, model: str, a: HardwareProfile,
                   b: HardwareProfile, *, tp: int = 1) -> float:
    """(time on ``a`` x cost of ``a``) / (time on ``b`` x cost of ``b``): below 1 means ``a``
    finishes the workload sooner for the same money (see the module docstring)."""
    return (makespan_s(workload, model, a, tp=tp) * a.relative_cost
            / (makespan_s(workload, model, b, tp=tp) * b.relative_cost))
