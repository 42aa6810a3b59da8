"""GRPO advantages and the decoupled PPO loss on hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rollart.controller.buffer.sample import Sample
from rollart.controller.training.advantages import grpo_advantages
from rollart.trainer.loss import decoupled_ppo_loss

EPS = 1e-6


# ---------------------------------------------------------------- grpo_advantages
# The trainer takes the advantages the controller computed (one implementation, numpy):
# the cases below pin it on hand-computed values.


def _batch(*groups: tuple[str, list[float]]) -> list[Sample]:
    return [Sample(sample_id=f"{g}{k}", group_key=g, token_ids=[5, 6], loss_mask=[0, 1],
                   behaviour_logprobs=[-1.0], versions=[0], reward=r)
            for g, rewards in groups for k, r in enumerate(rewards)]


def test_grpo_binary_group():
    # mean 0.5, population std 0.5 -> +-0.5 / (0.5 + eps)
    adv = grpo_advantages(_batch(("g", [1.0, 0.0, 1.0, 0.0])))
    a = 0.5 / (0.5 + EPS)
    assert adv == pytest.approx([a, -a, a, -a], rel=1e-12)


def test_grpo_all_equal_group_is_exactly_zero_not_nan():
    # In float64, (0.1 + 0.1 + 0.1) / 3 = 0.10000000000000002 != 0.1, so a mean/std formula alone
    # would give -1.4e-11 here; equal groups must still give exact zeros.
    adv = grpo_advantages(_batch(("a", [0.1] * 3), ("b", [7.0] * 3), ("c", [0.0] * 3),
                                 ("d", [0.7] * 3)))
    assert adv == [0.0] * 12


def test_grpo_single_member_group_gets_zero():
    assert grpo_advantages(_batch(("g", [5.0]), ("h", [1.0, 2.0])))[0] == 0.0


def test_grpo_groups_keyed_in_any_order():
    # group 7: rewards 1, 0 -> +-1 (std 0.5); group 3: rewards 2, 2 -> 0; group 9: 4, 1, 1
    # (mean 2, var (4 + 1 + 1)/3 = 2, std sqrt 2).
    order = [("7", 1.0), ("3", 2.0), ("7", 0.0), ("3", 2.0), ("9", 4.0), ("9", 1.0), ("9", 1.0)]
    batch = [_batch((g, [r]))[0] for g, r in order]
    adv = grpo_advantages(batch)
    s = math.sqrt(2)
    h = 0.5 / (0.5 + EPS)
    assert adv == pytest.approx([h, 0.0, -h, 0.0, 2 / (s + EPS), -1 / (s + EPS), -1 / (s + EPS)],
                                rel=1e-12)


def test_grpo_rejects_a_non_finite_reward():
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages(_batch(("g", [float("inf"), 0.0])))


# ---------------------------------------------------------------- decoupled_ppo_loss


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_on_policy_loss_is_minus_mean_advantage_with_unit_gradient():
    # r = 1, w = 1 on two valid tokens, A = 2 -> loss = -(2 + 2) / 2 = -2; dloss/dlogp = -A r / 2.
    lp = _t([-1.0, -0.5, -2.0]).requires_grad_()
    loss, m = decoupled_ppo_loss(
        lp, lp.detach(), lp.detach(), torch.tensor([2.0]), torch.tensor([[0, 1, 1]])
    )
    assert loss.item() == pytest.approx(-2.0)
    loss.backward()
    torch.testing.assert_close(lp.grad, _t([0.0, -1.0, -1.0]))
    assert m["clip_fraction"] == 0.0 and m["num_tokens"] == 2.0
    assert m["iw_mean"] == m["iw_max"] == m["iw_min"] == 1.0 and m["logprob_mismatch"] == 0.0


def test_clip_active_and_inactive_cases():
    # ratios 1.5, 1.5, 0.5, 0.5 with A = +1, -1, +1, -1 and eps 0.2:
    #   r=1.5, A=+1: min(1.5, 1.2) = 1.2 -> clipped, pg -1.2, no gradient
    #   r=1.5, A=-1: min(-1.5, -1.2) = -1.5 -> unclipped, pg 1.5
    #   r=0.5, A=+1: min(0.5, 0.8) = 0.5 -> unclipped, pg -0.5
    #   r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> clipped, pg 0.8
    # loss = (-1.2 + 1.5 - 0.5 + 0.8) / 4 = 0.15; clip fraction 2/4.
    prox = _t([-1.0, -1.0, -1.0, -1.0])
    lp = (prox + torch.log(_t([1.5, 1.5, 0.5, 0.5]))).requires_grad_()
    adv = _t([1.0, -1.0, 1.0, -1.0])
    loss, m = decoupled_ppo_loss(lp, prox, prox, adv, torch.ones(1, 4, dtype=torch.bool))
    assert loss.item() == pytest.approx(0.15, abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    # d(-r A)/dlogp = -r A on unclipped tokens, divided by the 4 tokens.
    torch.testing.assert_close(lp.grad, _t([0.0, 1.5 / 4, -0.5 / 4, 0.0]))


def test_asymmetric_upper_clip():
    # r = 1.5, A = 1: eps_high 0.6 -> clip range [0.8, 1.6] contains 1.5 -> pg = -1.5, unclipped.
    prox = _t([-1.0])
    lp = prox + math.log(1.5)
    loss, m = decoupled_ppo_loss(lp, prox, prox, _t([1.0]), torch.ones(1, 1), clip_eps_high=0.6)
    assert loss.item() == pytest.approx(-1.5, abs=1e-6)
    assert m["clip_fraction"] == 0.0


def test_importance_weight_truncate_vs_mask():
    # w = exp(prox - behaviour) = 4 and 0.5; r = 1; A = 1; cap 2.
    #   no cap:   (-4 - 0.5) / 2 = -2.25
    #   truncate: (-2 - 0.5) / 2 = -1.25
    #   mask:     ( 0 - 0.5) / 2 = -0.25 (the masked token still counts in the denominator)
    prox = _t([-1.0, -1.0])
    behaviour = prox - torch.log(_t([4.0, 0.5]))
    args = (prox, prox, behaviour, torch.tensor([1.0]), torch.ones(1, 2))
    none, m = decoupled_ppo_loss(*args)
    trunc, mt = decoupled_ppo_loss(*args, iw_cap=2.0, iw_mode="truncate")
    masked, mm = decoupled_ppo_loss(*args, iw_cap=2.0, iw_mode="mask")
    assert none.item() == pytest.approx(-2.25, abs=1e-6)
    assert trunc.item() == pytest.approx(-1.25, abs=1e-6)
    assert masked.item() == pytest.approx(-0.25, abs=1e-6)
    # Statistics describe the raw weights: mean 2.25, max 4, min 0.5;
    # mismatch = mean(|ln 4|, |ln 0.5|) = (1.386294 + 0.693147) / 2 = 1.039721.
    assert (m["iw_mean"], m["iw_max"], m["iw_min"]) == pytest.approx((2.25, 4.0, 0.5), abs=1e-6)
    assert m["logprob_mismatch"] == pytest.approx(1.039721, abs=1e-5)
    assert m["iw_capped_fraction"] == 0.0
    assert mt["iw_capped_fraction"] == mm["iw_capped_fraction"] == 0.5


def test_importance_weight_is_detached():
    prox = _t([-1.0]).requires_grad_()
    behaviour = _t([-2.0])
    lp = prox.detach().clone().requires_grad_()
    loss, _ = decoupled_ppo_loss(lp, prox, behaviour, _t([1.0]), torch.ones(1, 1))
    loss.backward()
    assert prox.grad is None
    # d(-w r A)/dlogp at r = 1 is -w = -e.
    torch.testing.assert_close(lp.grad, _t([-math.e]))


def test_k3_kl_to_reference():
    # d = ref - logp = ln 2: k3 = e^d - d - 1 = 2 - 0.693147 - 1 = 0.306853; A = 0 so the loss
    # is kl_coef * k3 = 0.0306853 and dloss/dlogp = kl_coef * (1 - e^d) = -0.1.
    lp = _t([-2.0]).requires_grad_()
    ref = lp.detach() + math.log(2.0)
    loss, m = decoupled_ppo_loss(
        lp, lp.detach(), lp.detach(), _t([0.0]), torch.ones(1, 1), kl_coef=0.1, ref_logprobs=ref
    )
    assert loss.item() == pytest.approx(0.0306853, abs=1e-6)
    assert m["kl"] == pytest.approx(0.306853, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, _t([-0.1]))


def test_masked_positions_are_ignored_even_if_garbage():
    lp = _t([float("nan"), -1.0, float("-inf")]).requires_grad_()
    prox = _t([0.0, -1.0, float("inf")])
    loss, m = decoupled_ppo_loss(
        lp, prox, prox, torch.tensor([1.0]), torch.tensor([[False, True, False]])
    )
    assert loss.item() == pytest.approx(-1.0)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert m["num_tokens"] == 1.0


def test_loss_normalizer_divides_the_token_sum():
    lp = _t([-1.0, -1.0])
    loss, _ = decoupled_ppo_loss(
        lp, lp, lp, torch.tensor([1.0]), torch.ones(1, 2), loss_normalizer=8.0
    )
    assert loss.item() == pytest.approx(-2.0 / 8.0)


def test_per_token_advantages_accepted():
    lp = _t([-1.0, -1.0])
    loss, _ = decoupled_ppo_loss(lp, lp, lp, _t([1.0, 3.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-2.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"iw_mode": "drop"}, "iw_mode"),
        ({"iw_cap": 0.0}, "iw_cap"),
        ({"clip_eps": 0.0}, "clip_eps"),
        ({"kl_coef": 0.1}, "ref_logprobs"),
    ],
)
def test_bad_options_rejected(kwargs, match):
    lp = _t([-1.0])
    with pytest.raises(ValueError, match=match):
        decoupled_ppo_loss(lp, lp, lp, _t([1.0]), torch.ones(1, 1), **kwargs)


def test_bad_shapes_and_empty_mask_rejected():
    lp = _t([-1.0, -1.0])
    with pytest.raises(ValueError, match="proximal_logprobs shape"):
        decoupled_ppo_loss(lp, _t([-1.0]), lp, torch.tensor([1.0]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="advantages"):
        decoupled_ppo_loss(lp, lp, lp, _t([1.0, 1.0, 1.0]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="no tokens"):
        decoupled_ppo_loss(lp, lp, lp, torch.tensor([1.0]), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="behaviour_logprobs has non-finite"):
        decoupled_ppo_loss(lp, lp, _t([float("nan"), -1.0]), torch.tensor([1.0]), torch.ones(1, 2))
