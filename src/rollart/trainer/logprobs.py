"""Per-token logprobs and policy entropy of a causal LM from one forward pass.

`token_logprobs` is what the trainer's proximal, reference and training forwards compute;
`token_logprobs_entropy` adds, from the same logits, the entropy of each measured token's
next-token distribution (the trainer's `entropy_mean` metric), without an extra forward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["logprobs_from_logits", "token_logprobs", "token_logprobs_entropy"]


def token_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, *, temperature: float = 1.0
) -> Tensor:
    """Logprob of each token given its prefix under `model` (a transformers causal LM).

    Args:
        input_ids: [B, T] int64, right-padded. attention_mask: [B, T] 0/1 (1 = real token).
        temperature: logits are divided by it before normalising.

    Returns:
        [B, T] float32: out[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) for t >= 1;
        out[:, 0] = 0 and padded positions are 0. Differentiable when grad is enabled.
    """
    return token_logprobs_entropy(model, input_ids, attention_mask, temperature=temperature)[0]


#: rows of logits whose entropy is computed at once: bounds the temporary [rows, V] tensors
#: (~3 of them: 256 x 152k float32 x 3 = 0.47 GB at Qwen3's vocabulary)
_ENTROPY_CHUNK = 256


def token_logprobs_entropy(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    entropy_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` and, from the same forward, the policy's entropy at chosen tokens.

    Entropy of the next-token distribution p = softmax(z / temperature) that token t was drawn
    from (the one whose logprob is out[b, t]): H = logsumexp(z') - sum_v p_v z'_v with
    z' = z / temperature, in nats. Computed without grad, only on `entropy_mask`'s tokens, in
    chunks of rows (no extra forward; temporaries of a few 256 x V floats).

    Args:
        entropy_mask: [B, T] bool (or 0/1), the tokens to measure (e.g. the loss mask; t = 0
            has no distribution and is never measured); None: no entropy.

    Returns:
        (logprobs [B, T] float32 as `token_logprobs`, entropy [B, T] float32 detached, 0.0 off
        the mask; None without `entropy_mask`).

    Raises:
        ValueError: inputs not [B, T], or `entropy_mask` of another shape.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [B, T]"
        )
    if entropy_mask is not None and entropy_mask.shape != input_ids.shape:
        raise ValueError(f"entropy_mask {tuple(entropy_mask.shape)} != input_ids "
                         f"{tuple(input_ids.shape)}")
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    lp, ent = logprobs_from_logits(logits, input_ids[:, 1:], attention_mask[:, 1:],
                                   temperature=temperature,
                                   entropy_mask=None if entropy_mask is None
                                   else entropy_mask[:, 1:])
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    if ent is None:
        return lp, None
    return lp, torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)


def logprobs_from_logits(
    logits: Tensor,
    targets: Tensor,
    valid: Tensor,
    *,
    temperature: float = 1.0,
    entropy_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Logprob (and entropy) of each target from the logits that predict it.

    Args:
        logits: [B, S, V], logits[b, s] the distribution `targets[b, s]` was drawn from.
        targets: [B, S] int64. valid: [B, S] 0/1, the real targets (0: padding).
        entropy_mask: [B, S] bool (or 0/1), where to measure the entropy; None: nowhere.

    Returns:
        (logprobs [B, S] float32, 0.0 where not `valid`; entropy [B, S] float32 detached, 0.0
        off `entropy_mask`, or None), as `token_logprobs_entropy` without its column 0.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    # gather - logsumexp avoids materialising a second [B, S, V] tensor (log_softmax).
    lse = torch.logsumexp(logits, dim=-1)
    lp = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1) - lse
    lp = lp * valid.to(lp.dtype)
    if entropy_mask is None:
        return lp, None
    with torch.no_grad():
        rows, cols = (entropy_mask != 0).nonzero(as_tuple=True)
        z, z_lse = logits.detach(), lse.detach()[rows, cols]
        h = torch.empty_like(z_lse)
        for i in range(0, rows.numel(), _ENTROPY_CHUNK):
            sl = slice(i, i + _ENTROPY_CHUNK)
            zc, lc = z[rows[sl], cols[sl]], z_lse[sl]  # [chunk, V], gathered per chunk
            h[sl] = lc - (torch.exp(zc - lc[:, None]) * zc).sum(-1)
        ent = torch.zeros_like(lp)
        ent[rows, cols] = h
    return lp, ent
