"""Each cited cost constant of ``rollart.sim.calibration`` is the one the simulator uses, the
training cost counts attention and the reference forward, and the simulated decode step stays
within a stated band of a public serving measurement."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest

from rollart.sim import calibration, costs
from rollart.sim.hardware import H100, H800
from rollart.sim.harness import SimScenario
from rollart.sim.models import QWEN3_8B, ModelProfile
from rollart.sim.trainer import SimTrainer


def test_cited_constants_are_the_ones_used() -> None:
    assert calibration.TRAIN_MFU == 0.47  # Megatron-LM README, H100
    assert calibration.PREFILL_MFU == 0.5
    assert calibration.DECODE_BW_EFFICIENCY == 0.7
    eff = costs.DEFAULT_EFFICIENCY
    assert (eff.mfu, eff.bw_efficiency, eff.train_mfu) == (
        calibration.PREFILL_MFU, calibration.DECODE_BW_EFFICIENCY, calibration.TRAIN_MFU)
    assert costs.Efficiency() == eff
    assert SimScenario.__dataclass_fields__["eff"].default == eff


def test_training_mfu_drives_the_step_time() -> None:
    # The cost scales as 1 / train_mfu: the constant is read, not copied.
    base = costs.train_step_s(QWEN3_8B, H800, 10_000, num_gpus=8)
    half = costs.train_step_s(QWEN3_8B, H800, 10_000, num_gpus=8,
                              eff=replace(costs.DEFAULT_EFFICIENCY,
                                          train_mfu=calibration.TRAIN_MFU / 2))
    assert half == pytest.approx(2 * base)


def test_train_step_counts_attention_and_reference_forward() -> None:
    n = 16_384
    attn = QWEN3_8B.attention_flops(n, 0)
    dense = 2.0 * QWEN3_8B.active_params * n
    denom = 8 * H800.flops * calibration.TRAIN_MFU
    lean = costs.train_step_s(QWEN3_8B, H800, n, num_gpus=8, extra_forward=False,
                              seq_lens=[n])
    assert lean == pytest.approx(3 * (dense + attn) / denom)
    with_ref = costs.train_step_s(QWEN3_8B, H800, n, num_gpus=8, extra_forward=False,
                                  ref_forward=True, seq_lens=[n])
    assert with_ref == pytest.approx(4 * (dense + attn) / denom)
    # At 16k tokens attention is a visible share of training FLOPs (> 10% for Qwen3-8B).
    assert attn / dense > 0.1
    with pytest.raises(ValueError, match="seq_lens"):
        costs.train_step_s(QWEN3_8B, H800, n, num_gpus=8, seq_lens=[-1])


def test_sim_trainer_charges_attention_per_sample_and_the_reference_forward() -> None:
    scale = 1e-9
    batch = [SimpleNamespace(num_tokens=8_000), SimpleNamespace(num_tokens=24_000)]
    plain = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8, time_scale=scale)
    kl = SimTrainer(model=QWEN3_8B, hardware=H800, num_gpus=8, time_scale=scale,
                    ref_forward=True)
    for t in (plain, kl):
        asyncio.run(t.train(batch))
    want = costs.train_step_s(QWEN3_8B, H800, 32_000, num_gpus=8, extra_forward=False,
                              seq_lens=[8_000, 24_000])
    assert plain.step_times_s[0] == pytest.approx(scale * want)
    # Attention is per sample (two short sequences cost less than one long one).
    assert want < costs.train_step_s(QWEN3_8B, H800, 32_000, num_gpus=8,
                                     extra_forward=False, seq_lens=[32_000])
    assert kl.step_times_s[0] / plain.step_times_s[0] == pytest.approx(4 / 3)


#: Llama-3.1-8B (config.json: 32 layers, hidden 4096, 8 KV heads, head_dim 128, 32 query
#: heads), served with fp8 weights as in the NIM measurement below.
LLAMA31_8B_FP8 = ModelProfile("llama-3.1-8b-fp8", 8.03e9, 8.03e9, num_layers=32,
                              hidden_size=4096, num_kv_heads=8, head_dim=128,
                              num_attention_heads=32, bytes_per_param=1)


def test_single_stream_decode_within_band_of_nim_h100_measurement() -> None:
    """Target: NVIDIA NIM benchmarking "Performance" page, Llama-3.1-8B-Instruct on one H100
    80G, concurrency 1: inter-token latency 4.37 ms (NIM 1.3.0) / 4.63 ms (1.8.0). The roofline
    omits scheduling and sampling overhead, so the simulated step is a lower bound: it must lie
    within [0.6, 1.0] x the measured ITL at a 4k-token context."""
    measured_s = 4.37e-3
    sim = costs.decode_step_s(LLAMA31_8B_FP8, H100, 1, 4096)
    assert 0.6 * measured_s <= sim <= 1.0 * measured_s, sim
