"""GRPO pinned to a hand-computed case, independent of the code it checks.

Every expected number below is written out as a literal, worked by hand (the arithmetic is in
the comments; `python -c` with `math` reproduces each), never computed by rollart's code:
- advantages (Shao et al. 2024, DeepSeekMath Sec. 4.1): A_i = (r_i - mean) / (std + 1e-6), the
  population std (divide by n); a group of equal rewards gives 0, never NaN;
- the decoupled PPO loss (Fu et al. 2025, AReaL Sec. 5.2; PPO clip of Schulman et al. 2017,
  Eq. 7): per generated token, w = pi_prox / mu (behaviour), r = pi_theta / pi_prox,
  pg = -w * min(r A, clip(r, 1 - 0.2, 1 + 0.2) A), summed over generated tokens and divided by
  their count; w capped at 5 ("truncate": min(w, 5); "mask": the token leaves the sum but not
  the count); prompt and padding positions add nothing to the loss or the gradient;
- the k3 KL estimator (Schulman 2020, "Approximating KL Divergence"): with x = log pi_ref -
  log pi_theta, k3 = exp(x) - 1 - x, gradient d k3 / d log pi_theta = 1 - exp(x).
"""

from __future__ import annotations

import math

import pytest
import torch

from rollart.controller.buffer.sample import Sample
from rollart.controller.training.advantages import grpo_advantages
from rollart.trainer.loss import decoupled_ppo_loss

LN = math.log

# ------------------------------------------------------------------------- advantages

# Group "a": rewards 1, 0, 0, 0: mean 0.25, population var (0.75^2 + 3 * 0.25^2) / 4 = 0.1875,
#   std 0.4330127019, A = 0.75 / 0.4330137019 = 1.7320468076 (sqrt 3 less the eps),
#   -0.25 / 0.4330137019 = -0.5773489359.
# Group "b": rewards 0.3 x 3 (identical): A = 0 exactly (no NaN from 0 / 0).
# Group "c": rewards 0, 1, 2: mean 1, var 2/3, std 0.8164965809, A = -/+ 1 / 0.8164975809
#   = -/+ 1.2247433714 and 0.
REWARDS = [("a", 1.0), ("a", 0.0), ("a", 0.0), ("a", 0.0),
           ("b", 0.3), ("b", 0.3), ("b", 0.3),
           ("c", 0.0), ("c", 1.0), ("c", 2.0)]
EXPECTED_ADV = [1.7320468076, -0.5773489359, -0.5773489359, -0.5773489359,
                0.0, 0.0, 0.0,
                -1.2247433714, 0.0, 1.2247433714]


def _sample(i: int, group: str, reward: float) -> Sample:
    return Sample(sample_id=f"s{i}", group_key=group, token_ids=[5, 6, 7], loss_mask=[0, 1, 1],
                  behaviour_logprobs=[-1.0, -1.0], versions=[0, 0], reward=reward)


def test_advantages_match_the_hand_computed_groups() -> None:
    got = grpo_advantages([_sample(i, g, r) for i, (g, r) in enumerate(REWARDS)])
    assert got == pytest.approx(EXPECTED_ADV, abs=1e-8)
    assert got[4:7] == [0.0, 0.0, 0.0]  # exactly zero, not merely small


# ---------------------------------------------------------------------------- the loss

# Two rows of 4 positions. Row 0: position 0 is the prompt, 1-3 generated, A = +1.
# Row 1: 0 prompt, 1-2 generated, 3 padding, A = -0.5. Per generated token (prox = log pi_prox,
# beh = log mu, cur = log pi_theta), w = exp(prox - beh), r = exp(cur - prox):
#   (0,1): w = 2, r = 1.1: unclipped, pg = -2 * 1.1 * 1 = -2.2, d pg / d cur = -w r A = -2.2
#   (0,2): w = 8 -> 5 (capped), r = 1.5 > 1.2, A > 0: the clipped 1.2 binds, pg = -5 * 1.2
#          = -6.0, gradient 0
#   (0,3): w = 1, r = 0.5: for A > 0 the lower clip does not bind (min(0.5, 0.8) = 0.5):
#          pg = -0.5, gradient -0.5
#   (1,1): w = 1, r = 1.1, A = -0.5: min(-0.55, -0.55): pg = 0.55, gradient -w r A = 0.55
#   (1,2): w = 0.5, r = 0.5, A = -0.5: min(-0.25, 0.8 * -0.5 = -0.4) = -0.4 (clipped binds):
#          pg = -0.5 * -0.4 = 0.2, gradient 0
# 5 generated tokens: loss = (-2.2 - 6.0 - 0.5 + 0.55 + 0.2) / 5 = -7.95 / 5 = -1.59.
# d loss / d cur = pg gradients / 5: (0,1) -0.44, (0,3) -0.1, (1,1) 0.11, everything else 0.
# clip_fraction 2/5 (the two clipped-binding tokens); iw over the 5 raw weights 2, 8, 1, 1, 0.5:
# mean 2.5, max 8, min 0.5; capped 1/5; logprob_mismatch mean |prox - beh| =
# (ln 2 + ln 8 + 0 + 0 + ln 2) / 5 = 5 ln 2 / 5 = 0.6931471806.
# With iw_mode "mask" token (0,2) leaves the sum (the count stays 5):
# (-2.2 - 0.5 + 0.55 + 0.2) / 5 = -1.95 / 5 = -0.39, and its gradient stays 0.
PROX = [[0.0, -1.0, -2.0, -0.5], [0.0, -1.5, -0.7, 0.0]]
MASK = [[0, 1, 1, 1], [0, 1, 1, 0]]
ADV = [1.0, -0.5]
# Garbage on masked positions: huge weights, ratios and advantages there must change nothing.
GARBAGE_CUR, GARBAGE_PROX, GARBAGE_BEH = 30.0, -40.0, -90.0


def _case():
    prox = torch.tensor(PROX, dtype=torch.float64)
    log_ratio = torch.tensor([[0.0, LN(1.1), LN(1.5), LN(0.5)], [0.0, LN(1.1), LN(0.5), 0.0]],
                             dtype=torch.float64)
    log_w = torch.tensor([[0.0, LN(2), LN(8), 0.0], [0.0, 0.0, LN(0.5), 0.0]],
                         dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.bool)
    cur = torch.where(mask, prox + log_ratio, torch.tensor(GARBAGE_CUR, dtype=torch.float64))
    beh = torch.where(mask, prox - log_w, torch.tensor(GARBAGE_BEH, dtype=torch.float64))
    prox = torch.where(mask, prox, torch.tensor(GARBAGE_PROX, dtype=torch.float64))
    return cur.requires_grad_(True), prox, beh, mask


def test_decoupled_ppo_loss_matches_the_hand_computed_case() -> None:
    cur, prox, beh, mask = _case()
    loss, m = decoupled_ppo_loss(cur, prox, beh, torch.tensor(ADV, dtype=torch.float64), mask,
                                 clip_eps=0.2, iw_cap=5.0, iw_mode="truncate")
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-1.59, abs=1e-12)
    expected_grad = [[0.0, -0.44, 0.0, -0.1], [0.0, 0.11, 0.0, 0.0]]
    assert cur.grad.tolist() == [pytest.approx(row, abs=1e-12) for row in expected_grad]
    assert m["clip_fraction"] == pytest.approx(0.4)
    assert m["iw_mean"] == pytest.approx(2.5) and m["iw_max"] == pytest.approx(8.0)
    assert m["iw_min"] == pytest.approx(0.5) and m["iw_capped_fraction"] == pytest.approx(0.2)
    assert m["logprob_mismatch"] == pytest.approx(0.6931471806, abs=1e-9)
    assert m["num_tokens"] == 5.0


def test_mask_mode_drops_capped_tokens_from_the_sum_not_the_count() -> None:
    cur, prox, beh, mask = _case()
    loss, m = decoupled_ppo_loss(cur, prox, beh, torch.tensor(ADV, dtype=torch.float64), mask,
                                 clip_eps=0.2, iw_cap=5.0, iw_mode="mask")
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.39, abs=1e-12)
    expected_grad = [[0.0, -0.44, 0.0, -0.1], [0.0, 0.11, 0.0, 0.0]]
    assert cur.grad.tolist() == [pytest.approx(row, abs=1e-12) for row in expected_grad]
    assert m["iw_capped_fraction"] == pytest.approx(0.2)


def test_prompt_and_padding_positions_contribute_nothing() -> None:
    # Changing every masked position's inputs (current, proximal, behaviour logprobs, and the
    # per-token advantage there) leaves the loss and every gradient bit-for-bit unchanged.
    cur, prox, beh, mask = _case()
    adv = torch.tensor(ADV, dtype=torch.float64)[:, None].expand(2, 4).clone()
    loss_a, _ = decoupled_ppo_loss(cur, prox, beh, adv, mask, iw_cap=5.0)
    loss_a.backward()
    grad_a = cur.grad.clone()
    other = ~mask
    cur_b = torch.where(other, -cur.detach() * 3 - 7, cur.detach()).requires_grad_(True)
    prox_b = torch.where(other, prox + 11.0, prox)
    beh_b = torch.where(other, beh - 13.0, beh)
    adv_b = torch.where(other, torch.full_like(adv, 1e6), adv)
    loss_b, _ = decoupled_ppo_loss(cur_b, prox_b, beh_b, adv_b, mask, iw_cap=5.0)
    loss_b.backward()
    assert float(loss_b.detach()) == float(loss_a.detach()) == pytest.approx(-1.59, abs=1e-12)
    assert torch.equal(cur_b.grad, grad_a)
    assert torch.equal(grad_a[other], torch.zeros(int(other.sum()), dtype=torch.float64))


def test_uncapped_weights_enter_as_they_are() -> None:
    # Without a cap, token (0,2) weighs 8: pg = -8 * 1.2 = -9.6 and the sum is
    # -2.2 - 9.6 - 0.5 + 0.55 + 0.2 = -11.55, loss -11.55 / 5 = -2.31.
    cur, prox, beh, mask = _case()
    loss, m = decoupled_ppo_loss(cur, prox, beh, torch.tensor(ADV, dtype=torch.float64), mask,
                                 iw_cap=None)
    assert float(loss.detach()) == pytest.approx(-2.31, abs=1e-12)
    assert m["iw_capped_fraction"] == 0.0


# ---------------------------------------------------------------------------------- k3 KL

# Two generated tokens, advantages 0 (no policy-gradient term), kl_coef 0.1:
#   token 1: cur = ref + ln 2, x = ref - cur = -ln 2: k3 = 0.5 - 1 + ln 2 = 0.1931471806,
#            d k3 / d cur = 1 - exp(x) = 0.5
#   token 2: cur = ref - ln 2, x = ln 2: k3 = 2 - 1 - ln 2 = 0.3068528194, gradient 1 - 2 = -1
# mean k3 = (0.1931471806 + 0.3068528194) / 2 = 0.25; loss = 0.1 * 0.5 / 2 = 0.025;
# d loss / d cur = 0.1 * (0.5, -1) / 2 = (0.025, -0.05). Both k3 values are > 0 (k3 >= 0
# always, unlike the naive -x estimator, whose mean here would be 0).
def test_k3_kl_matches_schulman_2020() -> None:
    ref = torch.tensor([[0.0, -2.0, -1.0]], dtype=torch.float64)
    cur = torch.tensor([[5.0, -2.0 + LN(2), -1.0 - LN(2)]], dtype=torch.float64,
                       requires_grad=True)
    mask = torch.tensor([[0, 1, 1]], dtype=torch.bool)
    loss, m = decoupled_ppo_loss(cur, cur.detach(), cur.detach(),
                                 torch.zeros(1, dtype=torch.float64), mask,
                                 kl_coef=0.1, ref_logprobs=ref)
    loss.backward()
    assert m["kl"] == pytest.approx(0.25, abs=1e-12)
    assert float(loss.detach()) == pytest.approx(0.025, abs=1e-12)
    assert cur.grad.tolist() == [pytest.approx([0.0, 0.025, -0.05], abs=1e-12)]
    # The KL is measured (metric) but adds nothing to the loss when its coefficient is 0.
    loss0, m0 = decoupled_ppo_loss(cur, cur.detach(), cur.detach(),
                                   torch.zeros(1, dtype=torch.float64), mask, ref_logprobs=ref)
    assert float(loss0.detach()) == 0.0 and m0["kl"] == pytest.approx(0.25, abs=1e-12)
