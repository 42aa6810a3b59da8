"""Supervised warm-up (SFT) of a causal LM on (prompt, completion) text pairs.

Used to give the tiny policy the answer format of the environments before RL: a few epochs of
AdamW on the negative log-likelihood of the completion tokens only (prompt tokens are context,
never targets), token-level mean over each batch.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Annotated, Literal

import msgspec
import torch
from torch import nn

log = logging.getLogger(__name__)
#: about this many progress records (INFO, ``progress`` = (step, total)) per warm-up
PROGRESS_RECORDS = 50


class SFTConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Hyper-parameters of `sft_warmup`."""

    epochs: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3
    lr: Annotated[float, msgspec.Meta(gt=0, le=1.0)] = 3e-3
    weight_decay: Annotated[float, msgspec.Meta(ge=0, le=1.0)] = 0.0
    batch_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 16
    max_grad_norm: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0
    # Append the tokenizer's eos id to each completion so the model learns to stop.
    append_eos: bool = True
    max_length: Annotated[int, msgspec.Meta(ge=2)] | None = None
    #: "cosine": linear warm-up over the first 5% of steps, then cosine decay to 0
    #: (Loshchilov & Hutter 2017, SGDR, without restarts); "constant": `lr` throughout.
    lr_schedule: Literal["constant", "cosine"] = "constant"
    #: torch intra-op threads while training (restored after); None leaves torch's setting.
    #: 1 matters on a shared machine: with 2 threads on 2 busy cores a step of 8 x ~600 tokens
    #: of the tiny model took ~6 s instead of ~0.7 s (threads waiting on each other).
    num_threads: Annotated[int, msgspec.Meta(ge=1, le=256)] | None = None
    #: Train each pair whose whole text (prompt, completion, eos) begins the next pair's prompt
    #: inside that next pair's sequence (`pack_turns`): a conversation's turns then cost one
    #: forward/backward pass over the conversation instead of one per turn, with the same
    #: targets and the same per-target losses (causal attention: a prefix's logits do not depend
    #: on what follows it). `batch_size` then counts packed sequences.
    pack_turns: bool = False


#: fields added after checkpoints were cached: left out of `cache_fields` at their defaults, so
#: the cache key of a recipe that does not set them stays what it was.
LATER_FIELDS = {"lr_schedule": "constant", "num_threads": None, "pack_turns": False}

#: an encoded training sequence: token ids and its target spans ``[start, end)`` (completion
#: tokens), or, as `encode_pairs` returns it, the number of prompt tokens (one span to the end)
Encoded = tuple[list[int], int | list[tuple[int, int]]]


def cache_fields(cfg: SFTConfig) -> dict:
    """`cfg` as a dict for cache keys: `LATER_FIELDS` at their defaults omitted."""
    out = msgspec.structs.asdict(cfg)
    for name, default in LATER_FIELDS.items():
        if out[name] == default:
            del out[name]
    return out


def lr_factor(cfg: SFTConfig, step: int, total_steps: int) -> float:
    """Multiplier of `cfg.lr` at optimizer step `step` (0-based) of `total_steps`."""
    if cfg.lr_schedule == "constant":
        return 1.0
    warm = max(1, math.ceil(0.05 * total_steps))
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, total_steps - warm)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def encode_pairs(
    tokenizer, pairs: list[tuple[str, str]], cfg: SFTConfig
) -> list[tuple[list[int], int]]:
    """Encode each pair to (token ids, number of prompt tokens)."""
    out = []
    eos = tokenizer.eos_token_id
    if cfg.append_eos and eos is None:
        raise ValueError("append_eos=True but the tokenizer has no eos_token_id")
    for i, (prompt, completion) in enumerate(pairs):
        p = tokenizer.encode(prompt, add_special_tokens=False)
        c = tokenizer.encode(completion, add_special_tokens=False)
        if cfg.append_eos:
            c = [*c, eos]
        if not c:
            raise ValueError(f"demonstration {i} has an empty completion")
        ids = p + c
        if cfg.max_length is not None and len(ids) > cfg.max_length:
            raise ValueError(
                f"demonstration {i} has {len(ids)} tokens > max_length {cfg.max_length}"
            )
        out.append((ids, len(p)))
    return out


def pack_turns(data: list[tuple[list[int], int]]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Merge each encoded pair whose ids are a prefix of the next pair's prompt into that next
    pair's sequence (see `SFTConfig.pack_turns`), in order.

    Args:
        data: `encode_pairs` output, (ids, number of prompt tokens) per pair.

    Returns:
        (ids, target spans ``[start, end)``) per packed sequence: every pair's completion
        tokens are targets exactly once, at the same positions after the same prefix.
    """
    out: list[tuple[list[int], list[tuple[int, int]]]] = []
    for ids, n_prompt in data:
        span = (n_prompt, len(ids))
        if out:
            prev_ids, prev_spans = out[-1]
            if len(prev_ids) <= n_prompt and ids[: len(prev_ids)] == prev_ids:
                out[-1] = (ids, [*prev_spans, span])
                continue
        out.append((ids, [span]))
    return out


def collate_sft(
    batch: list[Encoded], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad encoded sequences (ids, num_prompt_tokens or target spans; see `Encoded`) into
    `input_ids` [B, T] int64, `attention_mask` [B, T] int64 and `target_mask` [B, T] bool (True
    on completion tokens only; position 0 never, since it has no prefix to be predicted from)."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    target = torch.zeros((len(batch), width), dtype=torch.bool)
    for row, (ids, spans) in enumerate(batch):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attn[row, : len(ids)] = 1
        for start, end in [(spans, len(ids))] if isinstance(spans, int) else spans:
            target[row, max(start, 1) : end] = True
    return input_ids, attn, target


def completion_nll(
    model: nn.Module, input_ids: torch.Tensor, target_mask: torch.Tensor, attention_mask
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood of the masked target tokens.

    Args:
        input_ids: [B, T] int64. target_mask: [B, T] bool, True where token t is a target
            (predicted from tokens < t; position 0 is never a target). attention_mask: [B, T].

    Returns:
        (nll_sum scalar float32 with grad, num_targets scalar int64).
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    targets = input_ids[:, 1:]
    nll = nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    mask = target_mask[:, 1:]
    return (nll * mask).sum(), mask.sum()


def sft_warmup(
    model: nn.Module,
    tokenizer,
    pairs: Iterable[tuple[str, str]],
    cfg: SFTConfig | None = None,
) -> list[float]:
    """Train `model` in place on (prompt, completion) text pairs; return the loss history.

    Args:
        model: a transformers causal LM (any device; batches follow its parameters' device).
        tokenizer: its tokenizer (needs `pad_token_id`; `eos_token_id` when `append_eos`).
        pairs: (prompt, completion) strings; the prompt is used verbatim (render chat templates
            before calling), the completion's tokens (+ eos) are the only targets.
        cfg: hyper-parameters (defaults: 3 epochs, AdamW lr 3e-3, batch 16, grad clip 1.0).

    Progress: about ``PROGRESS_RECORDS`` INFO records on this module's logger, each with
    ``record.progress = (optimizer steps done, total)``.

    Returns:
        Per optimizer step, the mean NLL in nats per completion token, in training order
        (`ceil(n / batch_size) * epochs` entries; n: the number of pairs, or of packed
        sequences with `pack_turns`).

    Raises:
        ValueError: no pairs, an empty completion, a pair longer than `max_length`, or a
            non-finite loss.
    """
    cfg = cfg or SFTConfig()
    encoded = encode_pairs(tokenizer, list(pairs), cfg)
    data: list[Encoded] = list(pack_turns(encoded) if cfg.pack_turns else encoded)
    if not data:
        raise ValueError("sft_warmup needs at least one (prompt, completion) pair")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    history: list[float] = []
    was_training = model.training
    threads = torch.get_num_threads()
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    total = math.ceil(len(data) / cfg.batch_size) * cfg.epochs
    model.train()
    try:
        for _ in range(cfg.epochs):
            order = torch.randperm(len(data), generator=gen).tolist()
            for start in range(0, len(order), cfg.batch_size):
                batch = [data[i] for i in order[start : start + cfg.batch_size]]
                input_ids, attn, target = collate_sft(batch, pad)
                nll, count = completion_nll(
                    model, input_ids.to(device), target.to(device), attn.to(device)
                )
                loss = nll / count.clamp(min=1)
                if not torch.isfinite(loss):
                    raise ValueError(f"non-finite SFT loss at step {len(history)}")
                for group in opt.param_groups:
                    group["lr"] = cfg.lr * lr_factor(cfg, len(history), total)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                opt.step()
                history.append(float(loss.detach()))
                k = len(history)
                if k == total or k % max(1, total // PROGRESS_RECORDS) == 0:
                    log.info("warm-up step %d/%d, loss %.3f", k, total, history[-1],
                             extra={"progress": (k, total)})
    finally:
        model.train(was_training)
        torch.set_num_threads(threads)
    return history
