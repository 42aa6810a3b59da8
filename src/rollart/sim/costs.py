"""SIMULATED cost models: seconds for prefill, decode steps, weight transfer and training.

Roofline models (Williams et al., "Roofline", CACM 2009) applied to transformer inference as in
"Efficient Memory Management for LLM Serving" (vLLM, SOSP'23) and "Splitwise" (ISCA'24): prefill
is compute-bound, a decode step is memory-bound until the batch is large enough to be
compute-bound. An engine spans ``tp`` devices (tensor parallel): their FLOP/s and bandwidth add.

- step_s (one engine iteration, decode and chunked prefill together) = max(
      (weight bytes read + KV bytes read) / (tp x hbm_bytes_per_s x bw_efficiency),
      (2 x active_params x tokens + attention FLOPs) / (tp x flops x mfu))
  (bw_efficiency: the GPU's measured one where its profile has one,
  ``HardwareProfile.bw_efficiency``, else the engine's ``Efficiency.bw_efficiency``)
  + TP all-reduce (2 per layer, ring; Shoeybi et al. 2019). 2 FLOPs per parameter per token
  for a forward pass (Kaplan et al. 2020, §2.1); attention FLOPs grow with context
  (``ModelProfile.attention_flops``); MoE reads only routed experts and computes only active
  parameters (``ModelProfile.weight_bytes_read``, ``active_params``).
- prefill_s / decode_step_s: ``step_s`` with only prefill / only decode.
- transfer_s = bytes / link_bytes_per_s + latency_s
- train_step_s = passes x (2 x active_params x num_tokens + causal attention FLOPs) /
  (num_gpus x flops x train_mfu), 3 passes for forward + backward (Kaplan et al. 2020, §2.1),
  one more for a separate forward for old / proximal logprobs, one more for the reference
  model's forward when the loss has a KL term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollart.sim import calibration
from rollart.sim.hardware import HardwareProfile
from rollart.sim.models import ModelProfile


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of peak (SIMULATED).

    Defaults come from ``rollart.sim.calibration`` (``PREFILL_MFU``, ``DECODE_BW_EFFICIENCY``,
    ``TRAIN_MFU``), where each names its source or says it is an assumption.
    """

    mfu: float = calibration.PREFILL_MFU
    bw_efficiency: float = calibration.DECODE_BW_EFFICIENCY
    train_mfu: float = calibration.TRAIN_MFU

    def __post_init__(self) -> None:
        for field in ("mfu", "bw_efficiency", "train_mfu"):
            value = getattr(self, field)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"Efficiency.{field} must be in (0, 1], got {value}")


DEFAULT_EFFICIENCY = Efficiency()


def _check_tp(tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tp (devices per engine) must be >= 1, got {tp}")


def allreduce_s(model: ModelProfile, hw: HardwareProfile, num_tokens: float, *,
                tp: int) -> float:
    """Seconds of tensor-parallel all-reduce in one forward pass over ``num_tokens`` tokens.

    Megatron-LM tensor parallelism (Shoeybi et al. 2019, §3) all-reduces the activations twice
    per layer (after attention and after the MLP): ``2 x num_layers`` calls of ``num_tokens x
    hidden_size x 2`` bytes (bf16). A ring all-reduce moves ``2 (tp - 1) / tp`` of the buffer
    over each GPU's link (Patarasuk & Yuan 2009), plus a fixed launch latency per call
    (``hw.allreduce_latency_s``). Zero for ``tp == 1``.
    """
    _check_tp(tp)
    if tp == 1 or num_tokens <= 0:
        return 0.0
    nbytes = num_tokens * model.hidden_size * 2.0
    per_call = 2.0 * (tp - 1) / tp * nbytes / hw.nvlink_bytes_per_s + hw.allreduce_latency_s
    return 2 * model.num_layers * per_call


def step_s(model: ModelProfile, hw: HardwareProfile, *, decode_seqs: int,
           decode_kv_tokens: float, prefill_tokens: int = 0, prefill_keys: float = 0.0,
           prefill_kv_read: float = 0.0, tp: int = 1,
           eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Seconds of one engine iteration: ``decode_seqs`` sequences decode one token each while
    ``prefill_tokens`` prompt tokens are prefilled in the same forward pass (chunked prefill,
    as vLLM V1 schedules it).

    Args:
        decode_seqs: sequences generating one token (each attends its own cached context).
        decode_kv_tokens: KV tokens those sequences hold in total (read once; attended once).
        prefill_tokens: prompt tokens computed this iteration.
        prefill_keys: keys the prefill queries attend in total
            (``ModelProfile.attention_flops`` counts them for one request).
        prefill_kv_read: cached-context KV tokens the prefill reads (prefix-cache hits,
            earlier chunks).

    Roofline: max(memory, compute) + TP all-reduce, where memory = weight bytes the batch
    routes to + KV bytes read, compute = 2 x active_params x tokens + attention FLOPs.
    Returns 0.0 when there is no work.
    """
    _check_tp(tp)
    if min(decode_seqs, decode_kv_tokens, prefill_tokens, prefill_keys, prefill_kv_read) < 0:
        raise ValueError("step_s: token counts must be >= 0, got "
                         f"decode_seqs={decode_seqs}, decode_kv_tokens={decode_kv_tokens}, "
                         f"prefill_tokens={prefill_tokens}, prefill_keys={prefill_keys}, "
                         f"prefill_kv_read={prefill_kv_read}")
    tokens = decode_seqs + prefill_tokens
    if tokens == 0:
        return 0.0
    bytes_read = (model.weight_bytes_read(tokens)
                  + (decode_kv_tokens + prefill_kv_read) * model.kv_bytes_per_token)
    bw_eff = eff.bw_efficiency if hw.bw_efficiency is None else hw.bw_efficiency
    memory_s = bytes_read / (tp * hw.hbm_bytes_per_s * bw_eff)
    attn = 4.0 * model.num_layers * model.q_dim * (decode_kv_tokens + prefill_keys)
    compute_s = (2.0 * model.active_params * tokens + attn) / (tp * hw.flops * eff.mfu)
    return max(memory_s, compute_s) + allreduce_s(model, hw, tokens, tp=tp)


def prefill_s(model: ModelProfile, hw: HardwareProfile, num_tokens: int, *, tp: int = 1,
              context: int = 0, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Seconds to prefill ``num_tokens`` prompt tokens of one request after ``context`` tokens
    already cached (prefix-cache hit), in one forward pass (``step_s`` with no decode)."""
    if num_tokens < 0 or context < 0:
        raise ValueError(f"num_tokens and context must be >= 0, got {num_tokens}, {context}")
    keys = num_tokens * context + num_tokens * (num_tokens + 1) / 2.0
    return step_s(model, hw, decode_seqs=0, decode_kv_tokens=0, prefill_tokens=num_tokens,
                  prefill_keys=keys, prefill_kv_read=context if num_tokens else 0, tp=tp,
                  eff=eff)


def decode_step_s(model: ModelProfile, hw: HardwareProfile, batch_size: int,
                  kv_tokens: float, *, tp: int = 1,
                  eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Seconds for one decode step of ``batch_size`` sequences holding ``kv_tokens`` in total.

    The step reads the weights once (MoE: the experts the batch routes to) plus every cached
    K/V of the batch, and each new token attends its whole context (attention FLOPs grow with
    ``kv_tokens``); a large enough batch becomes compute-bound (roofline max). Returns 0.0 for
    an empty batch.
    """
    if batch_size < 0 or kv_tokens < 0:
        raise ValueError(f"batch_size and kv_tokens must be >= 0, got {batch_size}, {kv_tokens}")
    return step_s(model, hw, decode_seqs=batch_size, decode_kv_tokens=kv_tokens, tp=tp,
                  eff=eff)


def transfer_s(num_bytes: float, bytes_per_s: float, *, latency_s: float = 0.0) -> float:
    """Seconds to move ``num_bytes`` over a link of ``bytes_per_s`` (plus a fixed latency)."""
    if num_bytes < 0 or bytes_per_s <= 0 or latency_s < 0:
        raise ValueError(f"need num_bytes >= 0, bytes_per_s > 0, latency_s >= 0; got "
                         f"{num_bytes}, {bytes_per_s}, {latency_s}")
    return num_bytes / bytes_per_s + latency_s


def train_step_s(model: ModelProfile, hw: HardwareProfile, num_tokens: int, *, num_gpus: int,
                 extra_forward: bool = True, ref_forward: bool = False,
                 seq_lens: Sequence[int] = (), eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Seconds for one optimizer step over ``num_tokens`` tokens on ``num_gpus`` devices.

    FLOPs = passes x (2 x active_params x num_tokens + causal attention FLOPs of each sequence
    in ``seq_lens``, ``ModelProfile.attention_flops(n, 0)``), where the training forward +
    backward counts 3 passes (``calibration.BACKWARD_OVER_FORWARD``), ``extra_forward`` (old or
    proximal logprobs in a separate no-grad pass) one more and ``ref_forward`` (the reference
    model's forward for a KL term) one more. ``seq_lens`` empty: attention is not charged.
    Raises ``ValueError`` on negative counts or ``num_gpus < 1``.
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be >= 1, got {num_gpus}")
    if num_tokens < 0 or any(n < 0 for n in seq_lens):
        raise ValueError(f"num_tokens and seq_lens must be >= 0, got {num_tokens}, "
                         f"{list(seq_lens)}")
    passes = 1.0 + calibration.BACKWARD_OVER_FORWARD + extra_forward + ref_forward
    forward = (calibration.FORWARD_FLOPS_PER_PARAM * model.active_params * num_tokens
               + sum(model.attention_flops(n, 0) for n in seq_lens))
    return passes * forward / (num_gpus * hw.flops * eff.train_mfu)


def kv_capacity_tokens(model: ModelProfile, hw: HardwareProfile, *, tp: int = 1,
                       memory_utilization: float = 0.9) -> int:
    """KV cache tokens an engine of ``tp`` devices holds after loading the weights.

    Raises ``ValueError`` when the weights alone do not fit (pick a larger ``tp``).
    """
    _check_tp(tp)
    free = tp * hw.memory_bytes * memory_utilization - model.weight_bytes
    if free <= 0:
        raise ValueError(f"{model.name} ({model.weight_bytes / 1e9:.1f} GB of weights) does not "
                         f"fit on {tp} x {hw.name} at memory_utilization={memory_utilization}")
    return int(free // model.kv_bytes_per_token)
