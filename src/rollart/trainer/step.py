"""The training-step core: per-token logprobs, token-budget micro-batching, one GRPO update.

`train_step` (one call per batch of scored samples):
1. pack the samples into micro-batches of at most `max_tokens_per_microbatch` padded tokens;
2. with more than one optimizer step per batch (`num_minibatches` > 1), recompute the proximal
   logprobs under the current weights with `torch.no_grad()` (the decoupled-PPO proximal
   policy, AReaL Sec. 5.2); with a KL term, the reference logprobs;
3. for each of `num_minibatches` optimizer steps: forward/backward every micro-batch of that
   minibatch with the loss normalised by the minibatch's total valid-token count (so the
   accumulated gradient equals that of one big batch), clip the gradient norm, AdamW step.

With one optimizer step per batch the weights do not move before the only training forward,
so the proximal logprobs are that forward's own, detached: the no-grad pass of step 2 would
recompute the same numbers, and is skipped (about 1/4 of the step's FLOPs: a forward is ~2
FLOPs per parameter per token, forward + backward ~6; Kaplan et al. 2020, Sec. 2.1). The loss
and gradients are those of the recompute path (r = 1 on every token either way). The policy's
entropy per generated token is read from the same training forward's logits (`entropy_mean`).

In one process every forward runs each distinct prompt of a micro-batch once
(`rollart.trainer.sharedprompt`; micro-batches packed by prompt): a GRPO group repeats its
prompt in every sample, and the loss reads no logprob of a prompt token. The loss and gradients
are the full forward's up to float32 rounding; on the quickstart's batches (two prompts of ~450
tokens, ~190 more per sample) a step computes ~2.2 times fewer tokens.

Data parallel (``dp`` given: FSDP2 ranks, see `rollart.trainer.distributed`): every rank holds the
whole batch and takes a fixed share of each minibatch (`shard_samples`). The normaliser stays the
whole minibatch's valid-token count, and the FSDP gradient reduction is a plain sum (no division
by the world size), so the summed gradient is the one-process gradient. FSDP collectives need the
same number of forward/backward passes on every rank: a rank with fewer micro-batches than the
busiest one runs zero-weight padding passes (`plan_microbatches`). Metrics are summed / maxed over
ranks before they are returned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Annotated, Literal, Protocol

import msgspec
import numpy as np
import torch
from torch import Tensor, nn

from rollart.trainer.logprobs import token_logprobs, token_logprobs_entropy
from rollart.trainer.loss import decoupled_ppo_loss
from rollart.trainer.sharedprompt import prompt_key, shared_prompt_logprobs_entropy
from rollart.transport import tokenbytes as tb
from rollart.transport.messages import TrainSample

__all__ = [
    "DataParallel",
    "TrainSample",
    "TrainStepConfig",
    "check_batch",
    "pack_microbatches",
    "plan_microbatches",
    "shard_samples",
    "token_logprobs",
    "token_logprobs_entropy",
    "train_step",
]

ReduceOp = Literal["sum", "max"]


class DataParallel(Protocol):
    """What `train_step` needs from a group of data-parallel ranks (`RankGroup` fits)."""

    rank: int
    world_size: int

    def all_reduce(self, values: list[float], op: ReduceOp) -> list[float]:
        """Element-wise reduction of `values` (same length on every rank) over all ranks."""
        ...


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
    # PPO clip becomes active on later minibatches, and needs the no-grad proximal pass (with
    # 1 the training forward gives the proximal logprobs).
    num_minibatches: Annotated[int, msgspec.Meta(ge=1)] = 1
    # Sampling temperature of the behaviour policy: logits are divided by it so that the
    # trainer's logprobs are of the same distribution the engine sampled from.
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    pad_token_id: Annotated[int, msgspec.Meta(ge=0)] = 0


def pack_microbatches(
    samples: Sequence[TrainSample], max_tokens_per_microbatch: int, *, by_prompt: bool = False
) -> list[list[TrainSample]]:
    """Group samples into micro-batches whose padded size (rows x longest row) fits the budget.

    Deterministic greedy packing over samples sorted by length, longest first (ties keep the
    input order), so rows of similar length share a micro-batch and padding stays small.
    `by_prompt`: samples of one prompt (`rollart.trainer.sharedprompt.prompt_key`) are taken
    together, longest first, prompts in the order of their longest sample, so that a
    shared-prompt forward runs each prompt in as few micro-batches as the budget allows.

    Returns:
        Micro-batches covering every sample exactly once.

    Raises:
        ValueError: a sample longer than the budget (named by sample_id), or budget < 1.
    """
    if max_tokens_per_microbatch < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens_per_microbatch}")
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i))
    if by_prompt:
        keys = {i: prompt_key(samples[i]) for i in order}
        rank: dict[tuple[int, bytes], int] = {}
        for i in order:
            rank.setdefault(keys[i], len(rank))
        order.sort(key=lambda i: rank[keys[i]])  # stable: longest first within a prompt
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


def shard_samples(samples: Sequence[TrainSample], rank: int,
                  world_size: int) -> list[TrainSample]:
    """Rank `rank`'s share of `samples`: every `world_size`-th sample in longest-first order.

    Dealing by length balances padded tokens across ranks; the shares partition `samples` and a
    rank's share is empty when `len(samples) < world_size` (it then only runs padding passes).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i))
    return [samples[i] for i in order[rank::world_size]]


def plan_microbatches(
    minibatch: Sequence[TrainSample], rank: int, world_size: int, max_tokens_per_microbatch: int,
    *, by_prompt: bool = False,
) -> tuple[list[list[TrainSample]], int]:
    """Rank `rank`'s micro-batches of `minibatch` and how many padding passes it adds
    (`by_prompt`: as `pack_microbatches`).

    Every rank computes every rank's packing (cheap, deterministic), so all agree on the count
    of forward/backward passes (the busiest rank's) without a collective.

    Returns:
        (micro-batches of this rank's share, number of zero-weight padding passes).
    Raises:
        ValueError: as `pack_microbatches` (a sample over the budget), on every rank alike.
    """
    per_rank = [
        pack_microbatches(shard_samples(minibatch, r, world_size), max_tokens_per_microbatch,
                          by_prompt=by_prompt)
        for r in range(world_size)
    ]
    mine = per_rank[rank]
    return mine, max(len(p) for p in per_rank) - len(mine)


def collate(
    samples: Sequence[TrainSample], *, pad_token_id: int = 0, device: torch.device | str = "cpu"
) -> dict[str, Tensor]:
    """Right-pad samples into tensors: `input_ids` [B, T] int64, `attention_mask` [B, T] int64,
    `loss_mask` [B, T] bool, `behaviour_logprobs` [B, T] float32 (0.0 off the generated
    tokens, from either form of `TrainSample.behaviour_logprobs`), `advantages` [B] float32."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    b, t = len(samples), max(s.num_tokens for s in samples)
    # Filled from zero-copy views of the wire bytes, one vectorised copy per field and row.
    ids = np.full((b, t), pad_token_id, dtype=np.int64)
    attn = np.zeros((b, t), dtype=np.int64)
    mask = np.zeros((b, t), dtype=np.bool_)
    blp = np.zeros((b, t), dtype=np.float32)
    for row, s in enumerate(samples):
        n = s.num_tokens
        ids[row, :n] = tb.view_i32(s.token_ids)
        attn[row, :n] = 1
        mask[row, :n] = tb.view_u8(s.loss_mask)
        blp[row, :n] = s.full_logprobs()
    adv = np.array([s.advantage for s in samples], dtype=np.float32)
    out = {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(attn),
        "loss_mask": torch.from_numpy(mask),
        "behaviour_logprobs": torch.from_numpy(blp),
        "advantages": torch.from_numpy(adv),
    }
    return {k: v.to(device) for k, v in out.items()}


class _MetricAccumulator:
    """Combines per-micro-batch loss metrics: token-weighted means, max of maxima, min of minima;
    and the policy's entropy summed per domain of `domains` (every rank passes the same list,
    so the all-reduced vectors line up)."""

    _SUMMED = ("loss", "pg_loss")  # already divided by the minibatch normaliser
    # Every key of `decoupled_ppo_loss`'s metrics that is averaged; fixed so that ranks with no
    # sample reduce the same vector as the others.
    _KEYS = ("loss", "pg_loss", "kl", "clip_fraction", "iw_mean", "iw_capped_fraction",
             "logprob_mismatch", "ratio_mean")

    def __init__(self, domains: Sequence[str] = ()) -> None:
        self.n = 0.0
        self.sums: dict[str, float] = {}
        self.iw_max = -math.inf
        self.iw_min = math.inf
        self.domains = list(domains)
        self._domain_index = {d: i + 1 for i, d in enumerate(self.domains)}
        # [0]: every measured token; [i + 1]: those of domains[i]. Nats and token counts.
        self.entropy_sum = [0.0] * (1 + len(self.domains))
        self.entropy_tokens = [0.0] * (1 + len(self.domains))

    def add_entropy(self, mb: Sequence[TrainSample], entropy: Tensor, mask: Tensor) -> None:
        """Add a micro-batch's per-token entropy ([B, T], 0 off `mask`) by sample domain."""
        sums = entropy.double().sum(dim=1).tolist()
        counts = mask.sum(dim=1).tolist()
        for row, sample in enumerate(mb):
            self.entropy_sum[0] += sums[row]
            self.entropy_tokens[0] += counts[row]
            i = self._domain_index.get(sample.domain)
            if i is not None:
                self.entropy_sum[i] += sums[row]
                self.entropy_tokens[i] += counts[row]

    def add(self, m: dict[str, float]) -> None:
        n = m["num_tokens"]
        self.n += n
        for k, v in m.items():
            if k in ("num_tokens", "iw_max", "iw_min"):
                continue
            self.sums[k] = self.sums.get(k, 0.0) + (v if k in self._SUMMED else v * n)
        self.iw_max = max(self.iw_max, m["iw_max"])
        self.iw_min = min(self.iw_min, m["iw_min"])

    def all_reduce(self, dp: DataParallel) -> None:
        """Replace the local sums by the sums (maxima, minima) over every rank."""
        keys = self._KEYS
        nd = len(self.entropy_sum)
        summed = dp.all_reduce([*self.entropy_sum, *self.entropy_tokens, self.n,
                                *(self.sums.get(k, 0.0) for k in keys)], "sum")
        self.entropy_sum, self.entropy_tokens = summed[:nd], summed[nd:2 * nd]
        self.n = summed[2 * nd]
        self.sums = dict(zip(keys, summed[2 * nd + 1:], strict=True))
        # min(x) = -max(-x): one collective for both extremes.
        self.iw_max, neg_min = dp.all_reduce([self.iw_max, -self.iw_min], "max")
        self.iw_min = -neg_min

    def result(self, num_minibatches: int) -> dict[str, float]:
        out = {
            k: (v / num_minibatches if k in self._SUMMED else v / self.n)
            for k, v in self.sums.items()
        }
        out.update(iw_max=self.iw_max, iw_min=self.iw_min, num_tokens=self.n)
        if self.entropy_tokens[0]:
            out["entropy_mean"] = self.entropy_sum[0] / self.entropy_tokens[0]
        for i, d in enumerate(self.domains, start=1):
            if self.entropy_tokens[i]:
                out[f"entropy_mean/{d}"] = self.entropy_sum[i] / self.entropy_tokens[i]
        return out


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _padding_pass(model: nn.Module, cfg: TrainStepConfig) -> None:
    """One forward (and, with grad enabled, backward) on a 2-token dummy row with loss weight 0.

    It adds exactly 0 to every gradient but runs the model's FSDP all-gathers and
    reduce-scatters, keeping this rank in step with ranks that have one more micro-batch.
    """
    ids = torch.full((1, 2), cfg.pad_token_id, dtype=torch.long, device=_model_device(model))
    logp = token_logprobs(model, ids, torch.ones_like(ids), temperature=cfg.temperature)
    if torch.is_grad_enabled():
        (logp.sum() * 0.0).backward()


def _logprobs_entropy(model: nn.Module, t: dict[str, Tensor], cfg: TrainStepConfig,
                      share_prompts: bool, entropy: bool) -> tuple[Tensor, Tensor | None]:
    # Every reader of these logprobs (loss, agreement) reads the loss-mask tokens only, which
    # the shared-prompt forward gives as the full one does (`rollart.trainer.sharedprompt`).
    if share_prompts:
        return shared_prompt_logprobs_entropy(
            model, t["input_ids"], t["attention_mask"], t["loss_mask"],
            temperature=cfg.temperature, entropy=entropy)
    return token_logprobs_entropy(model, t["input_ids"], t["attention_mask"],
                                  temperature=cfg.temperature,
                                  entropy_mask=t["loss_mask"] if entropy else None)


@torch.no_grad()
def _recompute(
    model: nn.Module, mbs: list[list[TrainSample]], cfg: TrainStepConfig, num_padding: int = 0,
    share_prompts: bool = False,
) -> list[Tensor]:
    device = _model_device(model)
    out = []
    for mb in mbs:
        t = collate(mb, pad_token_id=cfg.pad_token_id, device=device)
        out.append(_logprobs_entropy(model, t, cfg, share_prompts, entropy=False)[0])
    for _ in range(num_padding):
        _padding_pass(model, cfg)
    return out


def accumulate_gradients(
    model: nn.Module,
    microbatches: list[list[TrainSample]],
    proximal: list[Tensor] | None,
    cfg: TrainStepConfig,
    *,
    reference: list[Tensor] | None = None,
    share_prompts: bool = True,
) -> dict[str, float]:
    """Forward/backward each micro-batch, adding into `.grad` (not zeroed here).

    The loss of every micro-batch is divided by the total valid-token count of all of
    `microbatches`, so the accumulated gradient is that of the token-mean loss over all of them.
    `proximal[i]` / `reference[i]` are [B_i, T_i] logprobs aligned with `microbatches[i]`;
    `proximal` None: each micro-batch's own forward, detached (the weights have not moved).
    `share_prompts`: run each distinct prompt of a micro-batch once
    (`rollart.trainer.sharedprompt`; the same loss and gradient up to float32 rounding).

    Returns:
        Token-weighted loss metrics (see `decoupled_ppo_loss`), `loss` being the total, and
        `entropy_mean` (`train_step`).
    """
    acc = _MetricAccumulator(_domains(s for mb in microbatches for s in mb))
    total_tokens = sum(s.num_loss_tokens for mb in microbatches for s in mb)
    _accumulate(model, microbatches, proximal, cfg, reference, total_tokens, 0, acc,
                share_prompts)
    return acc.result(num_minibatches=1)


def _domains(samples: Iterable[TrainSample]) -> list[str]:
    return sorted({s.domain for s in samples if s.domain})


def _accumulate(
    model: nn.Module,
    microbatches: list[list[TrainSample]],
    proximal: list[Tensor] | None,
    cfg: TrainStepConfig,
    reference: list[Tensor] | None,
    loss_normalizer: int,
    num_padding: int,
    acc: _MetricAccumulator,
    share_prompts: bool = False,
) -> list[Tensor]:
    # `loss_normalizer`: valid tokens of the whole minibatch (all ranks); per micro-batch metrics
    # go into `acc`; then `num_padding` zero-weight passes (see `_padding_pass`). `proximal`
    # None: the training forward's logprobs, detached, are the proximal ones (the lean path).
    # Returns the proximal logprobs used, one [B_i, T_i] tensor per micro-batch.
    device = _model_device(model)
    used = []
    for i, mb in enumerate(microbatches):
        t = collate(mb, pad_token_id=cfg.pad_token_id, device=device)
        logp, entropy = _logprobs_entropy(model, t, cfg, share_prompts, entropy=True)
        prox = logp.detach() if proximal is None else proximal[i]
        used.append(prox)
        assert entropy is not None
        acc.add_entropy(mb, entropy, t["loss_mask"])
        loss, m = decoupled_ppo_loss(
            logp,
            prox,
            t["behaviour_logprobs"],
            t["advantages"],
            t["loss_mask"],
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            iw_cap=cfg.iw_cap,
            iw_mode=cfg.iw_mode,
            kl_coef=cfg.kl_coef,
            ref_logprobs=None if reference is None else reference[i],
            loss_normalizer=float(loss_normalizer),
        )
        loss.backward()
        acc.add(m)
    for _ in range(num_padding):
        _padding_pass(model, cfg)
    return used


def sample_agreement(
    batch: Sequence[TrainSample],
    plans: list[tuple[list[list[TrainSample]], int]],
    proximal: list[list[Tensor]],
    cfg: TrainStepConfig,
    dp: DataParallel | None = None,
    weights_version: int | None = None,
) -> list[tuple[float, float, float, int, float, float, float]]:
    """Per sample of `batch` (in order), the fields of `SampleAgreement`: over its generated
    tokens, (mean |logp_prox - logp_behaviour| in nats, max importance weight
    exp(logp_prox - logp_behaviour), fraction with a weight over `cfg.iw_cap`); then the
    number of its generated tokens whose `behaviour_versions` entry is `weights_version` (the
    version of the weights the proximal logprobs come from; 0 for a sample without versions
    or when `weights_version` is None) and the same three figures over those tokens alone
    (0.0 over none). A token of an older version differs by the policy's change since it was
    generated too (allowed by the staleness bound), which is not the engine disagreeing with
    the trainer.

    `plans[k]` / `proximal[k]`: this rank's micro-batches of minibatch k and their proximal
    logprobs ([B_i, T_i] each). Under `dp` every rank holds a share; the values are combined
    with two all-reduces (sum, max) so every rank returns the whole batch's.
    """
    index = {s.sample_id: i for i, s in enumerate(batch)}
    n = len(batch)
    # [all tokens, the weights' version's tokens] x (mean |log w|, capped fraction, max w)
    mean_abs = [[0.0] * n, [0.0] * n]
    capped = [[0.0] * n, [0.0] * n]
    iw_max = [[0.0] * n, [0.0] * n]
    current = [0.0] * n
    log_cap = math.log(cfg.iw_cap) if cfg.iw_cap is not None else math.inf
    for (mbs, _), prox in zip(plans, proximal, strict=True):
        for mb, lp in zip(mbs, prox, strict=True):
            rows = collate(mb, pad_token_id=cfg.pad_token_id, device=lp.device)
            generated = rows["loss_mask"]
            log_w_all = lp.float() - rows["behaviour_logprobs"]
            at = (_generated_at(mb, generated, weights_version) if weights_version is not None
                  else torch.zeros_like(generated))
            for k, mask in enumerate((generated, at)):
                log_w = torch.where(mask, log_w_all, torch.zeros((), device=lp.device))
                num = mask.sum(dim=1)
                count = num.clamp(min=1)
                # One device-to-host copy per field and micro-batch, not per sample.
                means = (log_w.abs().sum(dim=1) / count).tolist()
                fracs = (((log_w > log_cap) & mask).sum(dim=1) / count).tolist()
                peak = torch.where(mask, log_w, torch.full_like(log_w, -math.inf)).amax(dim=1)
                peaks = peak.double().exp().tolist()
                nums = num.tolist()
                for row, s in enumerate(mb):
                    i = index[s.sample_id]
                    mean_abs[k][i], capped[k][i], iw_max[k][i] = means[row], fracs[row], peaks[row]
                    if k:
                        current[i] = float(nums[row])
    if dp is not None:
        summed = dp.all_reduce(mean_abs[0] + capped[0] + mean_abs[1] + capped[1] + current,
                               "sum")
        mean_abs = [summed[:n], summed[2 * n:3 * n]]
        capped = [summed[n:2 * n], summed[3 * n:4 * n]]
        current = summed[4 * n:]
        peaks_all = dp.all_reduce(iw_max[0] + iw_max[1], "max")
        iw_max = [peaks_all[:n], peaks_all[n:]]
    return [(mean_abs[0][i], iw_max[0][i], capped[0][i], int(current[i]), mean_abs[1][i],
             iw_max[1][i], capped[1][i]) for i in range(n)]


def _generated_at(mb: Sequence[TrainSample], loss_mask: Tensor, version: int) -> Tensor:
    """bool [B, T]: per row, the tokens its sample generated under `version` (none for a
    sample without `behaviour_versions`); `loss_mask` gives the shape and device."""
    keep = np.zeros(tuple(loss_mask.shape), dtype=np.bool_)
    for row, s in enumerate(mb):
        at = s.generated_at(version)
        if at is not None:
            keep[row, : at.size] = at
    return torch.from_numpy(keep).to(loss_mask.device)


def split_batch(
    batch: Sequence[TrainSample], cfg: TrainStepConfig, *, vocab_size: int | None = None
) -> tuple[list[TrainSample], dict[str, str]]:
    """The samples `train_step` can take, and the others (sample_id -> why: over the
    micro-batch budget, or a token id outside the model's embedding table of ``vocab_size``
    rows, which would fail the whole step's embedding lookup): the trainer drops such a sample,
    never the whole batch, and reports it (``TrainResult.dropped``) so the controller counts
    it."""
    usable, dropped = [], {}
    for s in batch:
        if s.num_tokens > cfg.max_tokens_per_microbatch:
            dropped[s.sample_id] = (f"{s.num_tokens} tokens > max_tokens_per_microbatch "
                                    f"{cfg.max_tokens_per_microbatch}")
        elif vocab_size is not None and (top := int(tb.view_i32(s.token_ids).max())) >= vocab_size:
            dropped[s.sample_id] = f"token id {top} outside the vocabulary [0, {vocab_size})"
        else:
            usable.append(s)
    return usable, dropped


def check_batch(batch: Sequence[TrainSample], cfg: TrainStepConfig) -> None:
    """The input checks of `train_step`, without touching a model (a data-parallel leader runs
    them before it hands the batch to its ranks, so a bad batch never reaches a collective).

    Raises:
        ValueError: empty batch, more minibatches than samples, or a sample over the
            micro-batch budget (named by sample_id).
    """
    if not batch:
        raise ValueError("train_step needs at least one sample")
    if cfg.num_minibatches > len(batch):
        raise ValueError(f"num_minibatches {cfg.num_minibatches} > batch size {len(batch)}")
    for s in batch:
        if s.num_tokens > cfg.max_tokens_per_microbatch:
            raise ValueError(
                f"sample {s.sample_id!r} has {s.num_tokens} tokens > "
                f"max_tokens_per_microbatch {cfg.max_tokens_per_microbatch}"
            )


def _global_norm(norm: Tensor) -> float:
    # Under FSDP2 the gradients are DTensor shards and clip_grad_norm_ returns the norm as a
    # replicated DTensor (already reduced over ranks); full_tensor() reads it as a plain value.
    from torch.distributed.tensor import DTensor

    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Sequence[TrainSample],
    cfg: TrainStepConfig,
    *,
    ref_model: nn.Module | None = None,
    dp: DataParallel | None = None,
    agreement: list[tuple[float, float, float, int, float, float, float]] | None = None,
    weights_version: int | None = None,
    recompute_proximal: bool | None = None,
    share_prompts: bool | None = None,
) -> dict[str, float]:
    """One GRPO / decoupled-PPO update of `model` on `batch` (see module docstring).

    Args:
        model: transformers causal LM, in train mode on return.
        optimizer: typically `torch.optim.AdamW(model.parameters(), ...)`.
        batch: samples (each with its advantage already set; failed trajectories excluded).
        cfg: loss / optimisation settings.
        ref_model: frozen reference policy, required when `cfg.kl_coef > 0` (under `dp`, sharded
            like `model` or a full replica on every rank).
        dp: the data-parallel rank group when `model` is FSDP2-sharded over several ranks; every
            rank calls `train_step` with the same `batch` and `cfg`.
        agreement: if given (a list), extended with `sample_agreement`'s per-sample
            engine/trainer agreement (before the update), in batch order.
        weights_version: the policy version of `model`'s weights before this update; the
            agreement also reports the tokens generated under it alone (`sample_agreement`).
        recompute_proximal: True: always run the no-grad proximal pass; False: never (only
            valid with one minibatch); None (default): run it only when `cfg.num_minibatches`
            > 1 (with one optimizer step the training forward's logprobs, detached, are the
            proximal ones: same loss and gradient, one forward fewer).
        share_prompts: run each distinct prompt of a micro-batch once in every forward
            (`rollart.trainer.sharedprompt`: the same loss and gradient up to float32 rounding,
            the prompts' tokens computed once per micro-batch instead of once per sample). None
            (default): in one process; never under `dp`, whose ranks must run the same number
            of forwards (True with `dp` is refused).

    Returns:
        Floats over the whole batch (all ranks): loss metrics averaged over tokens (`loss`,
        `pg_loss`, `kl`, `clip_fraction`, `iw_mean`, `iw_max`, `iw_min`, `iw_capped_fraction`,
        `logprob_mismatch`, `ratio_mean`), `entropy_mean` (the policy's mean entropy per
        generated token, nats, from the training forwards: with one minibatch, the weights
        before the update) and `entropy_mean/<domain>` for each non-empty
        `TrainSample.domain` of the batch, `num_tokens` (loss tokens), `num_samples`,
        `num_microbatches` (real ones, all ranks), `grad_norm` (pre-clip global norm, max over
        minibatches), `num_skipped_steps` (optimizer steps skipped because the gradient norm was
        not finite); under `dp` also `num_padding_microbatches` (padding passes, all ranks).

    Raises:
        ValueError: as `check_batch`, kl_coef > 0 without `ref_model`,
            `recompute_proximal=False` with more than one minibatch, or `share_prompts=True`
            with `dp`.
    """
    check_batch(batch, cfg)
    if cfg.kl_coef > 0 and ref_model is None:
        raise ValueError("cfg.kl_coef > 0 needs ref_model")
    if recompute_proximal is None:
        recompute_proximal = cfg.num_minibatches > 1
    elif not recompute_proximal and cfg.num_minibatches > 1:
        raise ValueError(f"recompute_proximal=False needs num_minibatches 1, got "
                         f"{cfg.num_minibatches}: later minibatches train on moved weights")
    if share_prompts is None:
        share_prompts = dp is None
    elif share_prompts and dp is not None:
        raise ValueError("share_prompts=True needs one process: data-parallel ranks must run "
                         "the same number of forwards")
    rank, world = (0, 1) if dp is None else (dp.rank, dp.world_size)
    model.train()
    # Minibatch k takes every num_minibatches-th sample: a fixed, order-preserving partition.
    minibatches = [list(batch[k :: cfg.num_minibatches]) for k in range(cfg.num_minibatches)]
    plans = [plan_microbatches(mb, rank, world, cfg.max_tokens_per_microbatch,
                               by_prompt=share_prompts)
             for mb in minibatches]
    # Proximal policy = weights before any update of this batch (AReaL's pi_prox); None: the
    # single minibatch's training forward provides it (the lean path).
    recomputed = ([_recompute(model, p, cfg, pad, share_prompts) for p, pad in plans]
                  if recompute_proximal else None)
    proximal: list[list[Tensor] | None] = [None] if recomputed is None else list(recomputed)
    reference = ([_recompute(ref_model, p, cfg, pad, share_prompts) for p, pad in plans]
                 if cfg.kl_coef > 0 and ref_model is not None else None)  # checked above
    if agreement is not None and recomputed is not None:
        agreement.extend(sample_agreement(batch, plans, recomputed, cfg, dp, weights_version))

    acc = _MetricAccumulator(_domains(batch))
    grad_norm_max = 0.0
    skipped = 0
    for k, (mbs, pad) in enumerate(plans):
        optimizer.zero_grad(set_to_none=True)
        # The whole minibatch's valid tokens (every rank holds the batch), not this rank's share.
        normalizer = sum(s.num_loss_tokens for s in minibatches[k])
        used = _accumulate(model, mbs, proximal[k], cfg,
                           None if reference is None else reference[k], normalizer, pad, acc,
                           share_prompts)
        if agreement is not None and not recompute_proximal:
            # Before the optimizer step: the weights are still those of `weights_version`.
            agreement.extend(sample_agreement(batch, plans, [used], cfg, dp, weights_version))
        grad_norm = _global_norm(
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        if math.isfinite(grad_norm):
            optimizer.step()
            grad_norm_max = max(grad_norm_max, grad_norm)
        else:
            skipped += 1
            grad_norm_max = grad_norm
    optimizer.zero_grad(set_to_none=True)
    num_mbs = float(sum(len(p) for p, _ in plans))
    if dp is not None:
        acc.all_reduce(dp)
        num_mbs, num_pad = dp.all_reduce([num_mbs, float(sum(pad for _, pad in plans))], "sum")
    out = acc.result(num_minibatches=cfg.num_minibatches)
    out.update(
        grad_norm=grad_norm_max,
        num_samples=float(len(batch)),
        num_microbatches=num_mbs,
        num_skipped_steps=float(skipped),
    )
    if dp is not None:
        out["num_padding_microbatches"] = num_pad
    return out
