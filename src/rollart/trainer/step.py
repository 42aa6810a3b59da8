"""The training-step core: per-token logprobs, token-budget micro-batching, one GRPO update.

`train_step` (one call per batch of scored samples):
1. pack the samples into micro-batches of at most `max_tokens_per_microbatch` padded tokens;
2. recompute the proximal logprobs under the current weights with `torch.no_grad()` (the
   decoupled-PPO proximal policy, AReaL Sec. 5.2) and, with a KL term, the reference logprobs;
3. for each of `num_minibatches` optimizer steps: forward/backward every micro-batch of that
   minibatch with the loss normalised by the minibatch's total valid-token count (so the
   accumulated gradient equals that of one big batch), clip the gradient norm, AdamW step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec
import torch
from torch import Tensor, nn

from rollart.trainer.loss import decoupled_ppo_loss
from rollart.transport.messages import TrainSample

__all__ = ["TrainSample", "TrainStepConfig", "token_logprobs", "pack_microbatches", "train_step"]


class TrainStepConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Loss and optimisation settings of `train_step` (see `decoupled_ppo_loss`)."""

    clip_eps: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.2
    clip_eps_high: Annotated[float, msgspec.Meta(gt=0, le=10)] | None = None
    iw_cap: Annotated[float, msgspec.Meta(gt=0)] | None = 5.0
    iw_mode: Literal["truncate", "mask"] = "truncate"
    kl_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    max_grad_norm: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    max_tokens_per_microbatch: Annotated[int, msgspec.Meta(ge=2)] = 8192
    # Optimizer steps per batch; > 1 makes the policy move away from the proximal one, so the
    # PPO clip becomes active on later minibatches.
    num_minibatches: Annotated[int, msgspec.Meta(ge=1)] = 1
    # Sampling temperature of the behaviour policy: logits are divided by it so that the
    # trainer's logprobs are of the same distribution the engine sampled from.
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    pad_token_id: Annotated[int, msgspec.Meta(ge=0)] = 0


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
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask "
            f"{tuple(attention_mask.shape)} must both be [B, T]"
        )
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    # gather - logsumexp avoids materialising a second [B, T, V] tensor (log_softmax).
    lp = torch.gather(logits, -1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    lp = lp * attention_mask[:, 1:].to(lp.dtype)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def pack_microbatches(
    samples: Sequence[TrainSample], max_tokens_per_microbatch: int
) -> list[list[TrainSample]]:
    """Group samples into micro-batches whose padded size (rows x longest row) fits the budget.

    Deterministic greedy packing over samples sorted by length, longest first (ties keep the
    input order), so rows of similar length share a micro-batch and padding stays small.

    Returns:
        Micro-batches covering every sample exactly once.

    Raises:
        ValueError: a sample longer than the budget (named by sample_id), or budget < 1.
    """
    if max_tokens_per_microbatch < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i))
    batches: list[list[TrainSample]] = []
    current: list[TrainSample] = []
    width = 0
    for i in order:
        s = samples[i]
        if s.num_tokens > max_tokens_per_microbatch:
            raise ValueError(
                f"sample {s.sample_id!r} has {s.num_tokens} tokens > "
                f"max_tokens_per_microbatch {max_tokens_per_microbatch}"
            )
        new_width = max(width, s.num_tokens)
        if current and (len(current) + 1) * new_width > max_tokens_per_microbatch:
            batches.append(current)
            current, new_width = [], s.num_tokens
        current.append(s)
        width = new_width
    if current:
        batches.append(current)
    return batches


def collate(
    samples: Sequence[TrainSample], *, pad_token_id: int = 0, device: torch.device | str = "cpu"
) -> dict[str, Tensor]:
    """Right-pad samples into tensors: `input_ids` [B, T] int64, `attention_mask` [B, T] int64,
    `loss_mask` [B, T] bool, `behaviour_logprobs` [B, T] float32, `advantages` [B] float32."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    b, t = len(samples), max(s.num_tokens for s in samples)
    ids = torch.full((b, t), pad_token_id, dtype=torch.long)
    attn = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.bool)
    blp = torch.zeros((b, t), dtype=torch.float32)
    for row, s in enumerate(samples):
        n = s.num_tokens
        ids[row, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        attn[row, :n] = 1
        mask[row, :n] = torch.tensor(s.loss_mask, dtype=torch.bool)
        blp[row, :n] = torch.tensor(s.behaviour_logprobs, dtype=torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    out = {
        "input_ids": ids,
        "attention_mask": attn,
        "loss_mask": mask,
        "behaviour_logprobs": blp,
        "advantages": adv,
    }
    return {k: v.to(device) for k, v in out.items()}


class _MetricAccumulator:
    """Combines per-micro-batch loss metrics: token-weighted means, max of maxima, min of minima."""

    _SUMMED = ("loss", "pg_loss")  # already divided by the minibatch normaliser

    def __init__(self) -> None:
        self.n = 0.0
        self.sums: dict[str, float] = {}
        self.iw_max = -math.inf
        self.iw_min = math.inf

    def add(self, m: dict[str, float]) -> None:
        n = m["num_tokens"]
        self.n += n
        for k, v in m.items():
            if k in ("num_tokens", "iw_max", "iw_min"):
                continue
            self.sums[k] = self.sums.get(k, 0.0) + (v if k in self._SUMMED else v * n)
        self.iw_max = max(self.iw_max, m["iw_max"])
        self.iw_min = min(self.iw_min, m["iw_min"])

    def result(self, num_minibatches: int) -> dict[str, float]:
        out = {
            k: (v / num_minibatches if k in self._SUMMED else v / self.n)
            for k, v in self.sums.items()
        }
        out.update(iw_max=self.iw_max, iw_min=self.iw_min, num_tokens=self.n)
        return out


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def _recompute(
    model: nn.Module, mbs: list[list[TrainSample]], cfg: TrainStepConfig
) -> list[Tensor]:
    device = _model_device(model)
    out = []
    for mb in mbs:
        t = collate(mb, pad_token_id=cfg.pad_token_id, device=device)
        out.append(
            token_logprobs(model, t["input_ids"], t["attention_mask"], temperature=cfg.temperature)
        )
    return out


def accumulate_gradients(
    model: nn.Module,
    microbatches: list[list[TrainSample]],
    proximal: list[Tensor],
    cfg: TrainStepConfig,
    *,
    reference: list[Tensor] | None = None,
) -> dict[str, float]:
    """Forward/backward each micro-batch, adding into `.grad` (not zeroed here).

    The loss of every micro-batch is divided by the total valid-token count of all of
    `microbatches`, so the accumulated gradient is that of the token-mean loss over all of them.
    `proximal[i]` / `reference[i]` are [B_i, T_i] logprobs aligned with `microbatches[i]`.

    Returns:
        Token-weighted loss metrics (see `decoupled_ppo_loss`), `loss` being the total.
    """
    device = _model_device(model)
    total_tokens = sum(sum(s.loss_mask) for mb in microbatches for s in mb)
    acc = _MetricAccumulator()
    for i, mb in enumerate(microbatches):
        t = collate(mb, pad_token_id=cfg.pad_token_id, device=device)
        logp = token_logprobs(
            model, t["input_ids"], t["attention_mask"], temperature=cfg.temperature
        )
        loss, m = decoupled_ppo_loss(
            logp,
            proximal[i],
            t["behaviour_logprobs"],
            t["advantages"],
            t["loss_mask"],
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            iw_cap=cfg.iw_cap,
            iw_mode=cfg.iw_mode,
            kl_coef=cfg.kl_coef,
            ref_logprobs=None if reference is None else reference[i],
            loss_normalizer=float(total_tokens),
        )
        loss.backward()
        acc.add(m)
    return acc.result(num_minibatches=1)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[TrainSample],
    cfg: TrainStepConfig,
    *,
    ref_model: nn.Module | None = None,
) -> dict[str, float]:
    """One GRPO / decoupled-PPO update of `model` on `batch` (see module docstring).

    Args:
        model: transformers causal LM, in train mode on return.
        optimizer: typically `torch.optim.AdamW(model.parameters(), ...)`.
        batch: samples (each with its advantage already set; failed trajectories excluded).
        cfg: loss / optimisation settings.
        ref_model: frozen reference policy, required when `cfg.kl_coef > 0`.

    Returns:
        Floats: loss metrics averaged over tokens (`loss`, `pg_loss`, `kl`, `clip_fraction`,
        `iw_mean`, `iw_max`, `iw_min`, `iw_capped_fraction`, `logprob_mismatch`, `ratio_mean`),
        `num_tokens` (loss tokens), `num_samples`, `num_microbatches`, `grad_norm` (pre-clip
        norm, max over minibatches), `num_skipped_steps` (optimizer steps skipped because the
        gradient norm was not finite).

    Raises:
        ValueError: empty batch, a sample over the micro-batch budget, or kl_coef > 0 without
            `ref_model`.
    """
    if not batch:
        raise ValueError("train_step needs at least one sample")
    if cfg.kl_coef > 0 and ref_model is None:
        raise ValueError("cfg.kl_coef > 0 needs ref_model")
    if cfg.num_minibatches > len(batch):
        raise ValueError(f"num_minibatches {cfg.num_minibatches} > batch size {len(batch)}")
    model.train()
    # Minibatch k takes every num_minibatches-th sample: a fixed, order-preserving partition.
    minibatches = [list(batch[k :: cfg.num_minibatches]) for k in range(cfg.num_minibatches)]
    packed = [pack_microbatches(mb, cfg.max_tokens_per_microbatch) for mb in minibatches]
    # Proximal policy = weights before any update of this batch (AReaL's pi_prox).
    proximal = [_recompute(model, p, cfg) for p in packed]
    reference = [_recompute(ref_model, p, cfg) for p in packed] if cfg.kl_coef > 0 else None

    acc = _MetricAccumulator()
    grad_norm_max = 0.0
    skipped = 0
    for k, mbs in enumerate(packed):
        optimizer.zero_grad(set_to_none=True)
        m = accumulate_gradients(
            model, mbs, proximal[k], cfg, reference=None if reference is None else reference[k]
        )
        acc.add(m)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        if math.isfinite(grad_norm):
            optimizer.step()
            grad_norm_max = max(grad_norm_max, grad_norm)
        else:
            skipped += 1
            grad_norm_max = grad_norm
    optimizer.zero_grad(set_to_none=True)
    out = acc.result(num_minibatches=cfg.num_minibatches)
    out.update(
        grad_norm=grad_norm_max,
        num_samples=float(len(batch)),
        num_microbatches=float(sum(len(p) for p in packed)),
        num_skipped_steps=float(skipped),
    )
    return out
