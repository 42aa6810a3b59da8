"""Engine/trainer agreement per serving worker, checked after every training step (issue 13).

The trainer recomputes the logprobs of every generated token under the weights the batch was
trained from and reports, per sample, ``SampleAgreement`` (mean ``|log w|``, max ``w``, fraction
of tokens whose importance weight ``w = exp(logp_trainer - logp_behaviour)`` is over its cap).
Importance weights are truncated in the loss (AReaL's decoupled PPO), so a worker whose weights
silently differ from its version label would train on for ever with only a metric showing it;
here each sample is attributed to the workers that served its turns (``Sample.turn_workers``)
and, per worker, the token-weighted batch means are compared with
``run.worker_checks`` thresholds.

Only tokens generated under the trainer's weights are compared (``SampleAgreement.num_tokens``):
a token up to alpha versions old differs from the recompute by the policy's own change too,
which the staleness bound allows; counting it would read a policy that moved as a worker that
disagrees (and, under ``quarantine`` / ``stop``, act on it). A worker none of whose tokens in
the batch came from the trainer's version is not judged in that step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollart.config import WorkerChecksConfig
from rollart.controller.sample import Sample
from rollart.transport import messages as m
from rollart.transport.errors import RollartError

#: name used for a sample's turns whose worker was not recorded (samples of older snapshots)
UNKNOWN_WORKER = "?"


class WorkerDisagreementError(RollartError):
    """Fatal (``agreement_policy = "stop"``): a worker's tokens disagree with the trainer."""


@dataclass
class WorkerAgreement:
    """One worker's share of a batch: ``num_tokens`` compared tokens (generated under the
    trainer's version) of the samples it served, their token-weighted mean
    ``logprob_mismatch`` (nats) and ``iw_capped_fraction``, and the largest importance weight
    ``iw_max``."""

    num_samples: int = 0
    num_tokens: int = 0
    logprob_mismatch: float = 0.0
    iw_capped_fraction: float = 0.0
    iw_max: float = 0.0


def by_worker(
    batch: Sequence[Sample], agreement: Sequence[m.SampleAgreement]
) -> dict[str, WorkerAgreement]:
    """Per serving worker, the agreement of the batch samples it served (a sample served by
    several workers counts for each), weighted by the tokens compared; samples with no token
    compared (none from the trainer's version) are left out, and a worker with none left has
    no entry. Empty when ``agreement`` is (a trainer that does not report it). Raises
    ValueError if ``agreement`` is not one entry per sample."""
    if not agreement:
        return {}
    if len(agreement) != len(batch):
        raise ValueError(f"trainer reported agreement for {len(agreement)} samples, the batch "
                         f"has {len(batch)}")
    out: dict[str, WorkerAgreement] = {}
    for s, a in zip(batch, agreement, strict=True):
        n = s.num_generated if a.num_tokens is None else a.num_tokens
        if n == 0:
            continue  # none of its tokens came from the weights the trainer recomputed with
        for name in sorted(set(s.turn_workers)) or [UNKNOWN_WORKER]:
            w = out.setdefault(name or UNKNOWN_WORKER, WorkerAgreement())
            w.num_samples += 1
            w.num_tokens += n
            w.logprob_mismatch += a.logprob_mismatch * n
            w.iw_capped_fraction += a.iw_capped_fraction * n
            w.iw_max = max(w.iw_max, a.iw_max)
    for w in out.values():
        if w.num_tokens:
            w.logprob_mismatch /= w.num_tokens
            w.iw_capped_fraction /= w.num_tokens
    return out


def offenders(workers: dict[str, WorkerAgreement], cfg: WorkerChecksConfig) -> dict[str, str]:
    """Workers over a threshold of ``cfg`` -> why (naming the values and thresholds); empty
    under ``agreement_policy = "off"``."""
    if cfg.agreement_policy == "off":
        return {}
    out = {}
    for name, w in sorted(workers.items()):
        why = []
        if w.logprob_mismatch > cfg.max_logprob_mismatch:
            why.append(f"logprob mismatch {w.logprob_mismatch:.4g} nats/token > "
                       f"{cfg.max_logprob_mismatch:g}")
        if w.iw_capped_fraction > cfg.max_iw_capped_fraction:
            why.append(f"{w.iw_capped_fraction:.2%} of tokens over the importance-weight cap > "
                       f"{cfg.max_iw_capped_fraction:.2%}")
        if why:
            out[name] = (f"{'; '.join(why)} (iw max {w.iw_max:.4g}, over {w.num_samples} "
                         f"samples / {w.num_tokens} tokens of the batch)")
    return out
