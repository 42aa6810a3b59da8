"""Calibration of the simulated engine against the hardware measurements of the RollArt paper
(§3) and the datasheets. Each test names its target and tolerance; the model's constants are
datasheet / paper values (``rollart.sim.hardware``, ``.models``, ``.costs``), never fitted to
these targets, so a failure here means the cost model drifted.

Per-cost reading of the paper's ratios: see ``rollart.sim.calibration``.
"""

from __future__ import annotations

import pytest

from rollart.sim import costs
from rollart.sim.calibration import (
    DECODE_HEAVY,
    PREFILL_HEAVY,
    EngineWorkload,
    makespan_s,
    per_cost_ratio,
)
from rollart.sim.hardware import H20, H20_DECODE_BW_EFFICIENCY, H800
from rollart.sim.models import QWEN3_8B, QWEN3_30B_A3B

#: (model, tp) pairs the paper trains (§7): Qwen3-8B on one GPU, Qwen3-32B on four.
DENSE = (("qwen3-8b", 1), ("qwen3-32b", 4))


@pytest.mark.parametrize(("model", "tp"), DENSE)
def test_prefill_heavy_h800_vs_h20_per_cost(model: str, tp: int) -> None:
    """Target: paper §3, a prefill-heavy workload takes ~0.53x the time on H800 as on H20 (per
    cost). Tolerance +-0.08 (15%). Measured when written: 0.57 (8B), 0.59 (32B, TP 4)."""
    ratio = per_cost_ratio(PREFILL_HEAVY, model, H800, H20, tp=tp)
    assert ratio == pytest.approx(0.53, abs=0.08)


@pytest.mark.parametrize(("model", "tp"), DENSE)
def test_decode_heavy_h20_vs_h800_per_cost(model: str, tp: int) -> None:
    """Target: paper §3, a decode-heavy workload takes ~0.49-0.79x the time on H20 as on H800
    (per cost). Tolerance: the band. Measured when written: 0.60 (8B), 0.51 (32B, TP 4), with
    the H20's measured decode bandwidth share (``hardware.H20_DECODE_BW_EFFICIENCY``, from a
    batch-1 measurement, not from this ratio); with the 0.7 of the other GPUs it was 0.36 / 0.42,
    below the band."""
    ratio = per_cost_ratio(DECODE_HEAVY, model, H20, H800, tp=tp)
    assert 0.49 <= ratio <= 0.79


def test_per_gpu_h20_is_slower_on_prefill_and_decodes_at_its_achieved_bandwidth() -> None:
    """Datasheet bounds per GPU (8B): prefill cannot beat the 989/148 = 6.7x FLOP ratio, and a
    bandwidth-bound decode cannot beat the 4.0/3.35 = 1.19x HBM ratio (the H20's larger memory
    allows bigger batches, so allow 1.3x). At a small batch the decode speed ratio is the ratio
    of ACHIEVED bandwidths, 4.0 x 0.34 / (3.35 x 0.7) = 0.58 (the H20's measured share against
    the engine's): the H20 is the slower decoder per GPU, as the paper's §3 per-GPU reading of
    its decode-heavy ratio (1.5-2.4x slower) also says. Measured when written: 0.57."""
    pre = makespan_s(PREFILL_HEAVY, "qwen3-8b", H20) / makespan_s(PREFILL_HEAVY, "qwen3-8b",
                                                                   H800)
    assert 1.0 < pre <= 989 / 148
    small = EngineWorkload("decode-small-batch", 512, 2000, num_requests=8, max_batch=8)
    dec = makespan_s(small, "qwen3-8b", H800) / makespan_s(small, "qwen3-8b", H20)
    achieved = (H20.hbm_bytes_per_s * H20_DECODE_BW_EFFICIENCY
                / (H800.hbm_bytes_per_s * costs.DEFAULT_EFFICIENCY.bw_efficiency))
    assert dec == pytest.approx(achieved, rel=0.05)
    assert dec <= 1.3


def test_moe_decode_reads_only_routed_experts() -> None:
    """Qwen3-30B-A3B (3.3B active of 30.5B, report Table 2): a batch of one token reads 1/16 of
    the expert weights (8 of 128 experts), so a batch-1 decode step is ~9x cheaper than the
    same step of a dense model of equal size would be."""
    moe = costs.decode_step_s(QWEN3_30B_A3B, H800, 1, 0)
    dense_equal = QWEN3_30B_A3B.weight_bytes / (H800.hbm_bytes_per_s * 0.7)
    assert dense_equal / moe == pytest.approx(30.5e9 / 3.32e9, rel=0.01)
    assert costs.decode_step_s(QWEN3_30B_A3B, H800, 1, 0) < costs.decode_step_s(
        QWEN3_8B, H800, 1, 0)


def test_attention_makes_long_context_decode_slower() -> None:
    """Decode cost grows with context (KV reads and attention FLOPs): a 32k-token context
    (paper §7.1 window) costs more per step than a 1k one, by the KV bytes read."""
    short = costs.decode_step_s(QWEN3_8B, H800, 64, 64 * 1024)
    long = costs.decode_step_s(QWEN3_8B, H800, 64, 64 * 32_768)
    extra_bytes = 64 * (32_768 - 1024) * QWEN3_8B.kv_bytes_per_token
    assert long - short == pytest.approx(extra_bytes / (H800.hbm_bytes_per_s * 0.7), rel=1e-6)
