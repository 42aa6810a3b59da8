"""The decoupled PPO loss (pure torch, device agnostic).

The advantages it takes come with each sample (``TrainSample.advantage``), computed by the
controller (``rollart.controller.training.advantages``, GRPO of Shao et al. 2024,
"DeepSeekMath", Sec. 4.1): the same advantage for every generated token of a sample.

Sources:
- PPO clipped surrogate: Schulman et al. 2017, "Proximal Policy Optimization Algorithms", Eq. 7.
- Decoupled PPO for asynchronous RL: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous
  Reinforcement Learning System for Language Reasoning", Sec. 5.2 ("Decoupled PPO objective"):
  the trust region is taken around a proximal policy pi_prox (the trainer's weights before the
  update) rather than the behaviour policy mu that generated the tokens (possibly stale weights,
  and a different numerical implementation), and the off-policy gap is corrected by the importance
  weight pi_prox / mu.
- k3 KL estimator: Schulman 2020, "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html),
  as used for GRPO's KL term (DeepSeekMath Eq. 4).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

IWMode = Literal["truncate", "mask"]


def _as_bool_mask(mask: Tensor, name: str, shape: torch.Size) -> Tensor:
    if mask.shape != shape:
        raise ValueError(f"{name} shape {tuple(mask.shape)} != logprobs shape {tuple(shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def decoupled_ppo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    iw_cap: float | None = None,
    iw_mode: IWMode = "truncate",
    kl_coef: float = 0.0,
    ref_logprobs: Tensor | None = None,
    loss_normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO loss (AReaL, Fu et al. 2025, Sec. 5.2; PPO clip from Schulman et al. 2017).

    Per valid token t:
        r_t = exp(logp_t - logp_prox_t)                      (gradient flows through logp_t)
        w_t = exp(logp_prox_t - logp_behaviour_t)            (detached)
        pg_t = -w_t * min(r_t * A_t, clip(r_t, 1 - clip_eps, 1 + clip_eps_high) * A_t)
        kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    (k3 estimator, only if kl_coef > 0)
        loss = sum_t (pg_t + kl_coef * kl_t) / loss_normalizer
    With `iw_cap`, "truncate" uses min(w_t, iw_cap); "mask" drops tokens with w_t > iw_cap from
    the policy-gradient term (they still count in the default normaliser, as in AReaL).

    Args:
        logprobs: [B, T] float, current policy logprobs of the tokens (requires grad to train).
        proximal_logprobs: [B, T] float, logprobs under the weights before this update.
        behaviour_logprobs: [B, T] float, logprobs reported by the inference engine.
        advantages: [B] (one per sequence) or [B, T] float.
        loss_mask: [B, T] bool or 0/1 float; True on generated tokens that enter the loss.
        clip_eps: lower clip range (> 0); clip_eps_high: upper (defaults to clip_eps).
        iw_cap: cap on w (> 0) or None for no cap; iw_mode: "truncate" or "mask".
        kl_coef: weight of the k3 KL to `ref_logprobs` ([B, T], required if kl_coef > 0).
        loss_normalizer: divisor of the token sum; default the number of valid tokens. Gradient
            accumulation passes the whole batch's valid-token count here.

    Returns:
        (loss, metrics): loss a 0-dim tensor; metrics floats over the valid tokens: `loss`,
        `pg_loss`, `kl` (mean k3, 0 without reference), `clip_fraction` (tokens where the clipped
        term is the binding, strictly smaller one), `iw_mean`/`iw_max`/`iw_min` (w before
        capping), `iw_capped_fraction` (tokens truncated or masked by the cap),
        `logprob_mismatch` (mean |logp_prox - logp_behaviour|, nats), `ratio_mean`, `num_tokens`.

    Raises:
        ValueError: shape mismatch, no valid token, non-finite valid inputs, bad clip/cap/mode,
            or kl_coef > 0 without ref_logprobs.
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(shape)}")
    for name, t in (
        ("proximal_logprobs", proximal_logprobs),
        ("behaviour_logprobs", behaviour_logprobs),
    ):
        if t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logprobs shape {tuple(shape)}")
    mask = _as_bool_mask(loss_mask, "loss_mask", shape)
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        advantages = advantages[:, None].expand(shape)
    elif advantages.shape != shape:
        raise ValueError(f"advantages must be [B] or [B, T], got shape {tuple(advantages.shape)}")
    if clip_eps <= 0 or (clip_eps_high is not None and clip_eps_high <= 0):
        raise ValueError(f"clip_eps/clip_eps_high must be > 0, got {clip_eps}/{clip_eps_high}")
    if iw_mode not in ("truncate", "mask"):
        raise ValueError(f"iw_mode must be 'truncate' or 'mask', got {iw_mode!r}")
    if iw_cap is not None and iw_cap <= 0:
        raise ValueError(f"iw_cap must be > 0 or None, got {iw_cap}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if ref_logprobs is not None and ref_logprobs.shape != shape:
        raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} != {tuple(shape)}")
    num_tokens = int(mask.sum())
    if num_tokens == 0:
        raise ValueError("loss_mask selects no tokens")
    if loss_normalizer is not None and loss_normalizer <= 0:
        raise ValueError(f"loss_normalizer must be > 0, got {loss_normalizer}")
    for name, t in (
        ("logprobs", logprobs),
        ("proximal_logprobs", proximal_logprobs),
        ("behaviour_logprobs", behaviour_logprobs),
        ("advantages", advantages),
    ):
        if not torch.isfinite(t.detach()[mask]).all():
            raise ValueError(f"{name} has non-finite values on loss-mask tokens")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high

    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    # Masked positions may hold arbitrary values (padding); zero their log-ratios before exp.
    log_ratio = torch.where(mask, logprobs - proximal_logprobs.detach(), zero)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(logprobs.dtype)
    surr = ratio * adv
    surr_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high) * adv
    pg = -torch.minimum(surr, surr_clipped)

    with torch.no_grad():
        log_w = torch.where(mask, proximal_logprobs - behaviour_logprobs, zero).to(logprobs.dtype)
        w_raw = torch.exp(log_w)
        w = w_raw
        token_on = mask
        capped = torch.zeros_like(mask)
        if iw_cap is not None:
            capped = mask & (w_raw > iw_cap)
            if iw_mode == "truncate":
                w = torch.clamp(w_raw, max=iw_cap)
            else:
                token_on = mask & ~capped
    pg = torch.where(token_on, pg * w, zero)

    total = pg.sum()
    kl_mean = 0.0
    if ref_logprobs is not None:
        d = torch.where(mask, ref_logprobs.detach() - logprobs, zero)
        kl = torch.where(mask, torch.exp(d) - d - 1.0, zero)
        kl_mean = float(kl.detach().sum()) / num_tokens
        if kl_coef > 0:
            total = total + kl_coef * kl.sum()
    denom = float(num_tokens if loss_normalizer is None else loss_normalizer)
    loss = total / denom

    with torch.no_grad():
        m = mask
        metrics = {
            "loss": float(loss.detach()),
            "pg_loss": float(pg.detach().sum()) / denom,
            "kl": kl_mean,
            "clip_fraction": float((m & (surr_clipped < surr)).sum()) / num_tokens,
            "iw_mean": float(w_raw[m].mean()),
            "iw_max": float(w_raw[m].max()),
            "iw_min": float(w_raw[m].min()),
            "iw_capped_fraction": float(capped.sum()) / num_tokens,
            "logprob_mismatch": float(log_w[m].abs().mean()),
            "ratio_mean": float(ratio.detach()[m].mean()),
            "num_tokens": float(num_tokens),
        }
    return loss, metrics
