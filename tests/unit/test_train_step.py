"""The training-step core on the tiny model: logprobs, packing, gradient accumulation, update."""

from __future__ import annotations

import copy
import math

import msgspec
import pytest
import torch

from rollart.models.tiny import TinyModelSpec, init_tiny_model
from rollart.trainer.step import (
    TrainSample,
    TrainStepConfig,
    accumulate_gradients,
    collate,
    pack_microbatches,
    token_logprobs,
    train_step,
)
from rollart.transport import tokenbytes as tb

SPEC = TinyModelSpec(seed=0, hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128)
# Gradients of one big batch vs. accumulated micro-batches differ only by float32 summation
# order (measured 4e-8 max abs vs. 0.19 max |grad| on the dev machine): rtol 1e-4, atol 1e-6.
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


@pytest.fixture
def model():
    torch.manual_seed(0)
    return init_tiny_model(SPEC)


def make_samples(model, n=6, *, noise=0.0, seed=0):
    """Random sequences of lengths 6..16; the last half of each is 'generated'; behaviour
    logprobs are the model's own logprobs minus `noise` nats (a known train/inference gap)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = 6 + (i * 5) % 11
        ids = torch.randint(5, 102, (length,), generator=g).tolist()
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        with torch.no_grad():
            x = torch.tensor([ids])
            lp = token_logprobs(model, x, torch.ones_like(x))[0]
        blp = [float(v) - noise if m else 0.0 for v, m in zip(lp, mask, strict=True)]
        samples.append(
            TrainSample.from_lists(
                token_ids=ids,
                loss_mask=mask,
                behaviour_logprobs=blp,
                advantage=1.0 if i % 2 == 0 else -1.0,
                sample_id=f"s{i}",
            )
        )
    return samples


def test_token_logprobs_match_log_softmax_and_zero_first_and_padding(model):
    ids = torch.tensor([[5, 9, 12, 40], [7, 8, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    with torch.no_grad():
        out = token_logprobs(model, ids, attn)
        ref = torch.log_softmax(model(input_ids=ids[:1]).logits[0].float(), -1)
        hot = token_logprobs(model, ids, attn, temperature=2.0)
        ref_hot = torch.log_softmax(model(input_ids=ids[:1]).logits[0].float() / 2.0, -1)
    assert out.shape == (2, 4) and out.dtype == torch.float32
    assert torch.equal(out[:, 0], torch.zeros(2))
    assert torch.equal(out[1, 2:], torch.zeros(2))
    torch.testing.assert_close(out[0, 1:], ref[torch.arange(3), ids[0, 1:]])
    torch.testing.assert_close(hot[0, 1:], ref_hot[torch.arange(3), ids[0, 1:]])
    # A padded row's real tokens score as if it were alone.
    with torch.no_grad():
        alone = token_logprobs(model, ids[1:, :2], attn[1:, :2])
    torch.testing.assert_close(out[1, :2], alone[0], rtol=1e-5, atol=1e-6)


def test_pack_microbatches_respects_budget_and_covers_all(model):
    samples = make_samples(model, n=9)
    budget = 40
    mbs = pack_microbatches(samples, budget)
    assert sorted(s.sample_id for mb in mbs for s in mb) == sorted(s.sample_id for s in samples)
    for mb in mbs:
        assert len(mb) * max(s.num_tokens for s in mb) <= budget
    assert len(pack_microbatches(samples, 10_000)) == 1
    with pytest.raises(ValueError, match="s2"):  # s2 has 16 tokens
        pack_microbatches(samples, 15)


def test_collate_pads_right():
    s = TrainSample.from_lists(
        token_ids=[5, 6, 7],
        loss_mask=[0, 1, 1],
        behaviour_logprobs=[0.0, -1.0, -2.0],
        advantage=0.5,
        sample_id="a",
    )
    t = TrainSample.from_lists(
        token_ids=[8, 9],
        loss_mask=[0, 1],
        behaviour_logprobs=[0.0, -3.0],
        advantage=-1.0,
        sample_id="b",
    )
    c = collate([s, t], pad_token_id=0)
    assert c["input_ids"].tolist() == [[5, 6, 7], [8, 9, 0]]
    assert c["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert c["loss_mask"].tolist() == [[False, True, True], [False, True, False]]
    assert c["behaviour_logprobs"].tolist() == [[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]]
    assert c["advantages"].tolist() == [0.5, -1.0]


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def test_microbatching_gives_the_same_gradient_as_one_big_batch(model):
    samples = make_samples(model, n=7, noise=0.1)
    cfg_big = TrainStepConfig(max_tokens_per_microbatch=10_000)
    cfg_small = TrainStepConfig(max_tokens_per_microbatch=32)
    grads = []
    for cfg in (cfg_big, cfg_small):
        mbs = pack_microbatches(samples, cfg.max_tokens_per_microbatch)
        with torch.no_grad():
            prox = []
            for mb in mbs:
                c = collate(mb)
                prox.append(token_logprobs(model, c["input_ids"], c["attention_mask"]))
        model.zero_grad(set_to_none=True)
        metrics = accumulate_gradients(model, mbs, prox, cfg)
        grads.append((_grads(model), metrics, len(mbs)))
    (g_big, m_big, n_big), (g_small, m_small, n_small) = grads
    assert n_big == 1 and n_small >= 3
    for a, b in zip(g_big, g_small, strict=True):
        torch.testing.assert_close(a, b, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    assert m_big["num_tokens"] == m_small["num_tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert m_small["loss"] == pytest.approx(m_big["loss"], rel=1e-5)
    assert m_small["iw_max"] == pytest.approx(m_big["iw_max"], rel=1e-5)


def test_train_step_changes_weights_with_finite_metrics(model):
    noise = 0.05
    samples = make_samples(model, n=6, noise=noise)
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = train_step(model, opt, samples, TrainStepConfig(max_tokens_per_microbatch=40))
    assert all(math.isfinite(v) for v in m.values()), m
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert m["num_tokens"] == sum(sum(s.loss_mask) for s in samples)
    assert m["num_samples"] == 6 and m["num_microbatches"] >= 2 and m["grad_norm"] > 0
    # behaviour = proximal - noise exactly, so w = e^noise on every token.
    assert m["logprob_mismatch"] == pytest.approx(noise, abs=1e-4)
    assert m["iw_mean"] == pytest.approx(math.exp(noise), abs=1e-4)
    # One optimizer step per batch: current == proximal during the forward, r = 1, no clipping.
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clip_fraction"] == 0.0
    assert m["num_skipped_steps"] == 0


def test_positive_advantage_raises_the_sample_likelihood(model):
    s = make_samples(model, n=1)[0]
    x = torch.tensor([tb.view_i32(s.token_ids).tolist()])
    mask = torch.tensor([tb.view_u8(s.loss_mask).tolist()], dtype=torch.bool)

    def generated_logprob():
        with torch.no_grad():
            return token_logprobs(model, x, torch.ones_like(x))[mask].sum().item()

    start = generated_logprob()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, [s], TrainStepConfig())
    assert generated_logprob() > start


def test_several_minibatches_move_away_from_the_proximal_policy(model):
    samples = make_samples(model, n=8)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    m = train_step(model, opt, samples, TrainStepConfig(num_minibatches=4))
    # Minibatches 2..4 are evaluated after earlier updates, so r != 1 there.
    assert abs(m["ratio_mean"] - 1.0) > 1e-4
    assert m["num_samples"] == 8


def test_kl_needs_a_reference_and_is_zero_against_a_copy(model):
    samples = make_samples(model, n=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="ref_model"):
        train_step(model, opt, samples, TrainStepConfig(kl_coef=0.1))
    ref = copy.deepcopy(model).eval()
    m = train_step(model, opt, samples, TrainStepConfig(kl_coef=0.1), ref_model=ref)
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)


def test_non_finite_gradient_skips_the_optimizer_step(model):
    samples = make_samples(model, n=2)
    # Finite loss, but an infinite gradient on one parameter (as an overflow would produce).
    model.lm_head.weight.register_hook(lambda g: g * float("inf"))
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    m = train_step(model, opt, samples, TrainStepConfig())
    assert m["num_skipped_steps"] == 1 and not math.isfinite(m["grad_norm"])
    for k, v in model.state_dict().items():
        assert torch.equal(before[k], v), k


def test_non_finite_current_logprobs_are_rejected(model):
    samples = make_samples(model, n=2)
    with torch.no_grad():
        model.model.norm.weight.fill_(float("nan"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="non-finite"):
        train_step(model, opt, samples, TrainStepConfig())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_mask": [1, 1, 1]}, "loss_mask\\[0\\]"),
        ({"loss_mask": [0, 0, 0]}, "no generated token"),
        ({"loss_mask": [0, 1]}, "lengths"),
        ({"behaviour_logprobs": [0.0, 0.5, -1.0]}, "<= 0"),
        ({"advantage": float("nan")}, "advantage"),
        ({"loss_mask": [0, 2, 1]}, "0 or 1"),
    ],
)
def test_train_sample_validation(kwargs, match):
    base = dict(
        token_ids=[5, 6, 7],
        loss_mask=[0, 1, 1],
        behaviour_logprobs=[0.0, -1.0, -1.0],
        advantage=1.0,
        sample_id="x",
    )
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        TrainSample.from_lists(**base)
    packed = dict(base, token_ids=tb.pack_i32(base["token_ids"]),
                  loss_mask=tb.pack_u8(base["loss_mask"]),
                  behaviour_logprobs=tb.pack_f32(base["behaviour_logprobs"]))
    with pytest.raises(msgspec.ValidationError, match=match):
        msgspec.msgpack.decode(msgspec.msgpack.encode(packed), type=TrainSample)


def test_train_sample_rejects_ragged_bytes():
    with pytest.raises(ValueError, match="not a whole number of 4-byte items"):
        TrainSample(token_ids=b"\x05\x00\x00\x00\x06\x00", loss_mask=b"\x00\x01",
                    behaviour_logprobs=tb.pack_f32([0.0, -1.0]), advantage=1.0, sample_id="r")


def test_train_step_rejects_empty_batch(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="at least one"):
        train_step(model, opt, [], TrainStepConfig())
