"""The simulated engine served at a fixed concurrency (8-128 in flight, 4k-16k context) against
published serving measurements (``rollart.sim.calibration``: each reference names its page and
table). Nothing here is fitted: the simulator's constants come from datasheets and the sources
in ``rollart.sim.calibration``; a failure means the engine model drifted from the measurements.

Why 1-128 in flight: the benchmarks' paper cluster (``benchmarks.workloads.paper_cluster``,
batch 512, half agentic, half reasoning) keeps at least 256 trajectories of each domain in
flight per step: 4 per H800 engine and 8 per H20 engine for Qwen3-8B (64 / 32 engines), 16 and
32 for Qwen3-32B (TP 4: 16 / 8 engines), more with alpha > 1 and the regime sweep's load x8.

Tolerance on the H100 references: +-20% of the measured value. Why that much: the reference
runs a different engine (NIM / TensorRT-LLM) and model (Llama-3.3-70B fp8 standing in for
Qwen3-32B on TP > 1), and the same table measured one NIM version earlier differs by ~18% at
concurrency 100 (777 vs 917 tokens/s), which bounds how closely a roofline model can be asked to
agree with any one engine version. Measured when written (simulated / measured): throughput
1.10, 1.06, 0.98, 0.94, 0.87 and request latency 0.91, 0.94, 1.02, 1.06, 1.11 at concurrency
1, 5, 25, 50, 100.

H20 (``test_h20_matches_qwen_speed_benchmark``): Qwen's own SGLang measurement of Qwen3-8B / 32B
at batch size 1 implies ~1.37 TB/s achieved on the H20 for both models (16.4 GB of bf16 weights
per token in 12.2 ms; 65.6 GB in 48.3 ms; a per-layer overhead fitted to both is ~8 us,
negligible): 0.34 of the 4.0 TB/s peak, where the other GPUs use ``DECODE_BW_EFFICIENCY`` = 0.7
(NIM's H100 figures imply 0.55-0.57). The H20 profile carries that measured share
(``hardware.H20_DECODE_BW_EFFICIENCY``, derived from the input-length-1 points only); with 0.7
it decoded ~2x too fast (simulated / measured time 0.48-0.58). Measured when written
(simulated / measured): 0.994, 1.005, 1.028 (8B) and 1.003, 1.022, 1.052 (32B) at 1, 6144,
14336 tokens of input.

KNOWN MISS (``test_h20_context_increment_matches_qwen_speed_benchmark``, strict xfail for
Qwen3-32B): what 8k more tokens of input add is overestimated, 1.20x (8B, within the 25% band)
and 1.39x (32B: +12.9 s simulated vs +9.2 s measured). The prefill of those 8k tokens at
``PREFILL_MFU`` = 0.5 of the H20's 148 TFLOP/s alone takes ~9.6 s for 32B, as long as the whole
measured increment, so the H20's prefill reaches more than the assumed MFU in SGLang, or its KV
reads a larger bandwidth share than its weight reads; solving both increments for the two
unknowns gives an implausible MFU (~0.9), so neither constant is fitted to them.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from rollart.sim import calibration, costs, hardware
from rollart.sim.calibration import (
    H100_FP8,
    LLAMA33_70B_FP8,
    NIM_LLAMA33_70B_TP2_5000_500,
    QWEN_DOCS_GENERATED_TOKENS,
    QWEN_DOCS_H20_SGLANG_BS1,
    EngineWorkload,
    makespan_s,
    serve_closed_loop,
)
from rollart.sim.hardware import H20, H20_DECODE_BW_EFFICIENCY, H800
from rollart.sim.models import get_model

#: +-20%: see the module docstring
TOLERANCE = 0.20
NIM_INPUT, NIM_OUTPUT = 5000, 500


def _nim_run(concurrency: int):
    # Three rounds of requests per client: the first round's simultaneous prefills are a
    # transient the steady-state genai-perf measurement does not weigh much either.
    return serve_closed_loop(LLAMA33_70B_FP8, H100_FP8, tp=2, concurrency=concurrency,
                             prompt_tokens=NIM_INPUT, output_tokens=NIM_OUTPUT,
                             num_requests=max(3 * concurrency, 4))


@pytest.mark.parametrize("concurrency", sorted(NIM_LLAMA33_70B_TP2_5000_500))
def test_throughput_and_latency_within_band_of_nim_h100_sweep(concurrency: int) -> None:
    ttft_ms, itl_ms, tokens_per_s = NIM_LLAMA33_70B_TP2_5000_500[concurrency]
    sim = _nim_run(concurrency)
    assert sim.output_tokens_per_s == pytest.approx(tokens_per_s, rel=TOLERANCE)
    # A request's latency is TTFT + ITL x (tokens - 1) in the benchmark's terms.
    measured_latency_s = (ttft_ms + itl_ms * (NIM_OUTPUT - 1)) / 1000
    assert sim.mean_latency_s == pytest.approx(measured_latency_s, rel=TOLERANCE)


def test_concurrency_sweep_8_to_128_has_the_measured_shape() -> None:
    """Across concurrency 8-128 at a 5k context: throughput rises and flattens once the KV
    cache bounds the running batch (NIM: +2.85x from 5 to 25, +1.13x from 50 to 100, flat from
    100 to 250), and per-request latency rises with it."""
    sweep = {c: _nim_run(c) for c in (8, 16, 32, 64, 128)}
    thr = [sweep[c].output_tokens_per_s for c in sorted(sweep)]
    lat = [sweep[c].mean_latency_s for c in sorted(sweep)]
    assert all(b > a for a, b in zip(thr[:4], thr[1:4], strict=False)), thr
    assert all(b > a for a, b in zip(lat, lat[1:], strict=False)), lat
    # Saturation: doubling 8 -> 16 gains > 25%; 64 -> 128 is a plateau within 5% (NIM reads
    # 917, 921, 921, 920 tokens/s at 100-250; measured when written: 810 -> 800 here).
    assert thr[1] / thr[0] > 1.25
    assert thr[4] / thr[3] == pytest.approx(1.0, abs=0.05)
    # Bounded by the measured plateau (920 tokens/s at 100-250) within the tolerance.
    assert thr[4] <= 920.0 * (1 + TOLERANCE)


def _h20_times(model: str, inputs) -> dict[int, tuple[float, float]]:
    """(simulated, measured) seconds of each Qwen docs point at ``inputs`` tokens of input."""
    out = {}
    for inp in inputs:
        measured = (inp + QWEN_DOCS_GENERATED_TOKENS) / QWEN_DOCS_H20_SGLANG_BS1[model][inp]
        sim = makespan_s(EngineWorkload("h20-bs1", max(inp, 2), QWEN_DOCS_GENERATED_TOKENS,
                                        num_requests=1, max_batch=1), model, H20)
        out[inp] = (sim, measured)
    return out


@pytest.mark.parametrize("model", sorted(QWEN_DOCS_H20_SGLANG_BS1))
def test_h20_matches_qwen_speed_benchmark(model: str) -> None:
    """Every point within the tolerance; the 6k and 14k points are out of sample (the H20's
    bandwidth share comes from the input-length-1 points; prefill and KV reads come on top)."""
    for sim, measured in _h20_times(model, QWEN_DOCS_H20_SGLANG_BS1[model]).values():
        assert sim == pytest.approx(measured, rel=TOLERANCE)


@pytest.mark.parametrize("model", [
    "qwen3-8b",
    pytest.param("qwen3-32b", marks=pytest.mark.xfail(
        strict=True, reason="known miss: the 8k-token context increment is overestimated "
        "1.39x on the H20 (module docstring)")),
])
def test_h20_context_increment_matches_qwen_speed_benchmark(model: str) -> None:
    """What 8k more tokens of input add (their prefill on the H20's 148 TFLOP/s plus 8k more KV
    read per decode step) matches the measured increment within 25%. Measured when written:
    +4.3 s simulated vs +3.6 s measured (8B), +12.9 s vs +9.2 s (32B)."""
    times = _h20_times(model, (6144, 14336))
    sim_added = times[14336][0] - times[6144][0]
    measured_added = times[14336][1] - times[6144][1]
    assert sim_added == pytest.approx(measured_added, rel=0.25)


def test_a_gpu_measured_bandwidth_share_overrides_the_engine_default() -> None:
    qwen8b = get_model("qwen3-8b")
    measured = costs.decode_step_s(qwen8b, H20, 1, 0)
    engine_default = costs.decode_step_s(qwen8b, dataclasses.replace(H20, bw_efficiency=None),
                                         1, 0)
    assert H20.bw_efficiency == H20_DECODE_BW_EFFICIENCY == 0.34  # Qwen docs, SGLang on H20
    assert measured / engine_default == pytest.approx(
        calibration.DECODE_BW_EFFICIENCY / H20_DECODE_BW_EFFICIENCY)
    with pytest.raises(ValueError, match="bw_efficiency"):
        dataclasses.replace(H20, bw_efficiency=1.5)


def test_h20_bandwidth_share_names_its_measurement() -> None:
    source = inspect.getsource(hardware)
    comment = source[:source.index("\nH20_DECODE_BW_EFFICIENCY = ")].rsplit("\n\n", 1)[-1]
    assert "https://qwen.readthedocs.io" in comment and "SGLang" in comment


@pytest.mark.parametrize(("model", "tp"), [("qwen3-8b", 1), ("qwen3-32b", 4)])
def test_benchmark_engines_over_8_to_128_in_flight(model: str, tp: int) -> None:
    """The benchmarks' engines (H800, TP as in ``benchmarks.workloads.TP``) at the agentic
    domain's context (6k prompt + observations, ~8k per turn) and 8-128 in flight: throughput
    does not fall with concurrency, and at 8 in flight stays under the roofline ceiling
    (weights read once per step at peak bandwidth). No published Qwen3 sweep on H800 was found,
    so this checks shape only; the H100 references above check magnitude."""
    profile = get_model(model)
    sweep = {c: serve_closed_loop(profile, H800, tp=tp, concurrency=c, prompt_tokens=8000,
                                  output_tokens=200, num_requests=2 * c)
             for c in (8, 16, 32, 64, 128)}
    thr = [sweep[c].output_tokens_per_s for c in sorted(sweep)]
    assert all(b >= a for a, b in zip(thr, thr[1:], strict=False)), thr
    floor_step_s = profile.weight_bytes / (tp * H800.hbm_bytes_per_s)
    assert thr[0] < 8 / floor_step_s
