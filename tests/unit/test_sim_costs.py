"""Cost models of rollart.sim on hand-computed cases (the arithmetic is written out)."""

from __future__ import annotations

import pytest

from rollart.sim import costs
from rollart.sim.hardware import CPU, H20, H800, equal_cost_count, get_hardware
from rollart.sim.models import QWEN3_8B, QWEN3_30B_A3B, QWEN3_32B, get_model


def test_kv_bytes_per_token_by_hand() -> None:
    assert QWEN3_8B.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147_456
    assert QWEN3_32B.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2 == 262_144
    assert QWEN3_30B_A3B.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2 == 98_304


def test_moe_weight_bytes_read() -> None:
    # experts: 48 * 128 * 3 * 2048 * 768 = 28_991_029_248; dense rest 1_508_970_752.
    # batch of 1 token touches 8/128 = 1/16 of the experts: 1_811_939_328.
    assert QWEN3_30B_A3B.weight_bytes_read(1) == pytest.approx(2 * 3_320_910_080)
    # A huge batch touches every expert: all 30.5e9 params.
    assert QWEN3_30B_A3B.weight_bytes_read(100_000) == pytest.approx(61.0e9)
    assert QWEN3_8B.weight_bytes_read(7) == pytest.approx(16.4e9)
    assert QWEN3_8B.weight_bytes_read(0) == 0.0


def test_attention_flops_by_hand() -> None:
    # 8B: q_dim 32 x 128 = 4096; 1000 tokens after none: keys = 1000 * 1001 / 2 = 500_500;
    # 4 * 36 * 4096 * 500_500 = 2.95207e11
    assert QWEN3_8B.q_dim == 4096 and QWEN3_32B.q_dim == 8192
    assert QWEN3_8B.attention_flops(1000, 0) == pytest.approx(2.952069e11, rel=1e-6)
    # One decode token after 9999 cached: keys = 9999 + 1 = 10_000
    assert QWEN3_8B.attention_flops(1, 9999) == pytest.approx(4 * 36 * 4096 * 10_000)


def test_prefill_by_hand() -> None:
    # linear 2 * 8.2e9 * 1000 = 1.64e13, attention 2.952069e11 -> 1.66952e13 / 4.945e14
    assert costs.prefill_s(QWEN3_8B, H800, 1000) == pytest.approx(0.03376179, rel=1e-6)
    # Four devices: a quarter of the compute plus 2 * 36 all-reduces of 1000 * 4096 * 2 B:
    # 1.5 * 8.192e6 / 200e9 + 10e-6 = 7.144e-5 s each -> 5.14368e-3 s.
    assert costs.allreduce_s(QWEN3_8B, H800, 1000, tp=4) == pytest.approx(5.14368e-3)
    assert costs.prefill_s(QWEN3_8B, H800, 1000, tp=4) == pytest.approx(
        0.03376179 / 4 + 5.14368e-3, rel=1e-6)
    assert costs.allreduce_s(QWEN3_8B, H800, 1000, tp=1) == 0.0
    # MoE prefill computes only active params: (2 * 3.3e9 * 1000 + 4 * 48 * 4096 * 500_500)
    # / 4.945e14 = 0.013665 s, but 1000 tokens route to every expert, so reading all 61.0e9 B
    # of weights (61e9 / 2.345e12 = 0.026013 s) bounds it: memory-bound.
    assert costs.prefill_s(QWEN3_30B_A3B, H800, 1000) == pytest.approx(0.02601279, rel=1e-6)
    # 32 tokens touch 1 - (15/16)^32 = 87.4% of experts; compute is tiny: memory-bound too.
    assert costs.prefill_s(QWEN3_30B_A3B, H800, 32) == pytest.approx(
        QWEN3_30B_A3B.weight_bytes_read(32) / 2.345e12, rel=1e-6)
    # A prefix-cache hit of 8000 tokens: 100 new tokens attend 8000 + 50.5 keys each
    # (compute 4.28e-3 s) but the weights and the 8000 cached KV tokens are read once:
    # (16.4e9 + 8000 * 147_456) / 2.345e12 = 7.497e-3 s -> memory-bound.
    hit = costs.prefill_s(QWEN3_8B, H800, 100, context=8000)
    compute = (2 * 8.2e9 * 100 + 4 * 36 * 4096 * (100 * 8000 + 5050)) / 4.945e14
    assert compute == pytest.approx(4.2767e-3, rel=1e-4)
    assert hit == pytest.approx((16.4e9 + 8000 * 147_456) / 2.345e12, rel=1e-6)


def test_mixed_step_is_one_roofline_over_decode_and_prefill() -> None:
    # 10 decoders holding 20_000 KV tokens + a 2000-token prefill chunk (no cache):
    # compute (2 * 8.2e9 * 2010 + 4 * 36 * 4096 * (20_000 + 2000 * 2001 / 2)) / 4.945e14
    mixed = costs.step_s(QWEN3_8B, H800, decode_seqs=10, decode_kv_tokens=20_000,
                         prefill_tokens=2000, prefill_keys=2000 * 2001 / 2)
    flops = 2 * 8.2e9 * 2010 + 4 * 36 * 4096 * (20_000 + 2000 * 2001 / 2)
    assert mixed == pytest.approx(flops / 4.945e14, rel=1e-9)
    # Less than a prefill iteration followed by a decode step.
    assert mixed < costs.prefill_s(QWEN3_8B, H800, 2000) + \
        costs.decode_step_s(QWEN3_8B, H800, 10, 20_000)


def test_decode_memory_bound_by_hand() -> None:
    # batch 1, empty cache: 16.4e9 B / (3.35e12 * 0.7 B/s) = 0.0069936 s
    assert costs.decode_step_s(QWEN3_8B, H800, 1, 0) == pytest.approx(0.00699360341)
    # batch 64 holding 64_000 tokens: (16.4e9 + 9.437184e9) / 2.345e12 = 25.837184e9 / 2.345e12
    assert costs.decode_step_s(QWEN3_8B, H800, 64, 64_000) == pytest.approx(0.0110179889)
    assert costs.decode_step_s(QWEN3_8B, H800, 0, 0) == 0.0


def test_decode_compute_bound_on_h20_by_hand() -> None:
    # batch 256 on H20: memory 16.4e9 / (4.0e12 * 0.34) = 0.01206 s, compute
    # 2 * 8.2e9 * 256 / (148e12 * 0.5) = 4.1984e12 / 7.4e13 = 0.056735 s -> compute wins.
    assert costs.decode_step_s(QWEN3_8B, H20, 256, 0) == pytest.approx(0.0567351351)
    # batch 1 on H20 is memory-bound at its measured 0.34 of 4.0 TB/s = 1.36 TB/s, slower than
    # the H800's 0.7 of 3.35 TB/s = 2.345 TB/s despite the higher peak.
    assert costs.decode_step_s(QWEN3_8B, H20, 1, 0) == pytest.approx(16.4e9 / 1.36e12)
    assert costs.decode_step_s(QWEN3_8B, H20, 1, 0) > costs.decode_step_s(QWEN3_8B, H800, 1, 0)


def test_transfer_over_200gb_ethernet() -> None:
    # 32.8e9 params * 2 B = 65.6e9 B over one 200 Gb/s (25e9 B/s) NIC (paper §7.1) = 2.624 s.
    assert costs.transfer_s(QWEN3_32B.weight_bytes, H800.link_bytes_per_s) == \
        pytest.approx(2.624)
    assert costs.transfer_s(1e9, 1e9, latency_s=0.5) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="bytes_per_s"):
        costs.transfer_s(1.0, 0.0)


def test_train_step_by_hand() -> None:
    # 8 * 8.2e9 * 1e6 / (64 * 989e12 * 0.47) = 6.56e16 / 2.9749e16
    assert costs.train_step_s(QWEN3_8B, H800, 1_000_000, num_gpus=64) == \
        pytest.approx(2.2051072)
    # Without the extra forward: 6/8 of that.
    assert costs.train_step_s(QWEN3_8B, H800, 1_000_000, num_gpus=64, extra_forward=False) == \
        pytest.approx(2.2051072 * 0.75)


def test_kv_capacity_by_hand() -> None:
    # (80e9 * 0.9 - 16.4e9) / 147_456 = 55.6e9 / 147_456 = 377_061.8
    assert costs.kv_capacity_tokens(QWEN3_8B, H800) == 377_061
    with pytest.raises(ValueError, match="does not fit"):
        costs.kv_capacity_tokens(QWEN3_32B, CPU)


def test_bad_inputs_are_named() -> None:
    with pytest.raises(ValueError, match="tp"):
        costs.prefill_s(QWEN3_8B, H800, 10, tp=0)
    with pytest.raises(ValueError, match="num_tokens"):
        costs.prefill_s(QWEN3_8B, H800, -1)
    with pytest.raises(ValueError, match="mfu"):
        costs.Efficiency(mfu=1.5)
    with pytest.raises(KeyError, match="known"):
        get_hardware("a100")
    with pytest.raises(KeyError, match="known"):
        get_model("llama")


def test_equal_cost_pools_from_paper() -> None:
    # 64 H800 + 24 H20 costs the same as 72 H800 (paper Fig. 11a) -> H20 = 1/3 H800.
    assert 64 * H800.relative_cost + 24 * H20.relative_cost == pytest.approx(72.0)
    assert equal_cost_count(72.0, H20) == 216
    assert equal_cost_count(8.0, H20) == 24
    assert get_hardware("H800") is H800
