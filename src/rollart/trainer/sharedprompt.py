"""Per-token logprobs of a micro-batch whose rows share prompts, each prompt run once.

The samples of one step repeat their prompt: a GRPO group is one prompt played several times,
and a multi-turn game's opening (rules, first observation) is the same text in every episode of
a domain. A plain forward runs the model over every row's prompt. Here the rows with the same
prompt (the tokens before the last one ahead of their first loss token) form a group: the
prompt runs once, as a batch of one, and its keys and values, repeated per row of the group
(`DynamicCache.batch_repeat_interleave`), are the past of one forward over the rows' remaining
tokens. Attention reads exactly the keys and values a full forward would (the same tokens at the
same positions, the same causal order), so every logprob the loss reads is the full forward's
up to float32 rounding; the gradient flows into the prompt's forward through the repeated cache,
where it is summed over the group's rows, as it would be over the rows of a full forward.

Only the tokens from each row's first loss token on are sure to get a logprob (the loss and the
engine/trainer agreement read no other): before it the logprobs are 0 for a row whose prompt
is shared (a row alone with its prompt has the full forward's). On the
quickstart's batches (two prompts of ~450 tokens, ~190 tokens after them) the forward and
backward see ~2.3 times fewer tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from rollart.trainer.logprobs import logprobs_from_logits, token_logprobs_entropy
from rollart.transport import tokenbytes as tb
from rollart.transport.messages import TrainSample

__all__ = ["prompt_groups", "prompt_key", "shared_prompt_logprobs_entropy"]


def _full_attention_cache(model: nn.Module) -> Any:
    """An empty `DynamicCache` for `model`, or None unless every layer is full attention:
    a sliding-window or recurrent layer's cache keeps other state than the prompt's keys and
    values, which this module has not been checked against."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = getattr(model, "config", None)
    if config is None:
        return None
    cache = DynamicCache(config=config)
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    return cache


def prompt_key(sample: TrainSample) -> tuple[int, bytes]:
    """(prompt length, prompt tokens as int32 bytes) of `sample`, as `prompt_groups` groups
    rows: samples with equal keys share their prompt forward in a micro-batch."""
    mask = tb.view_u8(sample.loss_mask)
    p = max(int(mask.argmax()) - 1, 0)  # a TrainSample has a loss token (validated)
    return p, bytes(sample.token_ids[:4 * p])


def prompt_groups(input_ids: Tensor, attention_mask: Tensor,
                  loss_mask: Tensor) -> list[tuple[int, list[int]]]:
    """Rows of a right-padded micro-batch grouped by shared prompt.

    A row's prompt is its tokens before position f - 1, f being its first loss token (the
    logits at f - 1 predict token f, so that position runs with the rest of the row); a row
    without a loss token keeps its last real token out of the prompt.

    Returns:
        (prompt length, rows) per group of two rows or more with equal prompt tokens, in order
        of each group's first row; then, if any, (0, the other rows): a prompt length 0 means
        no prompt forward (a plain forward of those rows).
    """
    lengths = attention_mask.sum(dim=1).tolist()
    has_loss = (loss_mask != 0).any(dim=1).tolist()
    first = (loss_mask != 0).int().argmax(dim=1).tolist()
    ids = input_ids.cpu().numpy()
    groups: dict[tuple[int, bytes], list[int]] = {}
    for b, n in enumerate(lengths):
        p = max((first[b] if has_loss[b] else n) - 1, 0)
        groups.setdefault((p, ids[b, :p].tobytes()), []).append(b)
    shared = [(p, rows) for (p, _), rows in groups.items() if p and len(rows) > 1]
    # A prompt of one row would cost a model call and save nothing: such rows run together.
    alone = sorted(r for (p, _), rows in groups.items() if not p or len(rows) == 1 for r in rows)
    return shared + [(0, alone)] if alone else shared


def shared_prompt_logprobs_entropy(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    loss_mask: Tensor,
    *,
    temperature: float = 1.0,
    entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs_entropy(..., entropy_mask=loss_mask)` on the tokens from each row's
    first loss token on, each distinct prompt run once (module docstring).

    Args:
        model: a transformers causal LM that takes `past_key_values` (a `DynamicCache`); one
            with a layer other than full attention gets `token_logprobs_entropy`'s full
            forward instead.
        input_ids: [B, T] int64, right-padded. attention_mask: [B, T] 0/1 (1 = real token).
        loss_mask: [B, T] bool (or 0/1): the tokens the loss reads (and the entropy measures).
        entropy: False: no entropy (None returned).

    Returns:
        (logprobs [B, T] float32, differentiable, equal to `token_logprobs`'s from each row's
        first loss token on (float32 rounding aside), 0.0 on padding and before it on a row
        whose prompt is shared (`prompt_groups`), the full forward's otherwise; entropy
        [B, T] float32 detached, 0.0 off `loss_mask`, or None).

    Raises:
        ValueError: inputs or `loss_mask` not [B, T] of one shape.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must both be [B, T]")
    if loss_mask.shape != input_ids.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} != input_ids "
                         f"{tuple(input_ids.shape)}")
    if _full_attention_cache(model) is None:  # e.g. sliding-window or linear-attention layers
        return token_logprobs_entropy(model, input_ids, attention_mask, temperature=temperature,
                                      entropy_mask=loss_mask if entropy else None)
    b, t = input_ids.shape
    device = input_ids.device
    lengths = attention_mask.sum(dim=1)
    lp = torch.zeros((b, t), dtype=torch.float32, device=device)
    ent = torch.zeros((b, t), dtype=torch.float32, device=device) if entropy else None
    for p, rows in prompt_groups(input_ids, attention_mask, loss_mask):
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        s = int(lengths[idx].max()) - p  # the group's longest row after its prompt
        cache = None
        if p > 0:
            cache = _full_attention_cache(model)
            # Logits of the prompt's last position only: none of the prompt's are read.
            model(input_ids=input_ids[rows[0], :p][None], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
            cache.batch_repeat_interleave(len(rows))
        rest = input_ids[idx, p:p + s]
        attn = torch.cat([torch.ones((len(rows), p), dtype=attention_mask.dtype, device=device),
                          attention_mask[idx, p:p + s]], dim=1)
        logits = model(input_ids=rest, attention_mask=attn, past_key_values=cache,
                       use_cache=cache is not None).logits
        cols = torch.arange(p + 1, p + s, device=device)
        lp_g, ent_g = logprobs_from_logits(
            logits[:, :-1], rest[:, 1:], attention_mask[idx, p + 1:p + s],
            temperature=temperature,
            entropy_mask=loss_mask[idx, p + 1:p + s] if entropy else None)
        where = (idx[:, None], cols[None, :])
        lp = lp.index_put(where, lp_g)  # out of place: the gradient reaches lp_g
        if ent is not None and ent_g is not None:
            ent[where] = ent_g
    return lp, ent

