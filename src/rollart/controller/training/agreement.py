"""Engine/trainer agreement per serving worker, checked after every training step.

The trainer recomputes the logprobs of every generated token under the weights the batch was
trained from and reports, per sample, ``SampleAgreement`` (mean ``|log w|``, max ``w``, fraction
of tokens whose importance weight ``w = exp(logp_trainer - logp_behaviour)`` is over its cap).
Importance weights are truncated in the loss (AReaL's decoupled PPO), so a worker whose weights
silently differ from its version label would train on for ever with only a metric showing it;
here each sample is attributed to the workers that served its turns (``Sample.turn_workers``)
and, per worker, the token-weighted batch means are compared with
``run.worker_checks`` thresholds.

Which tokens a worker is judged on (``WorkerAgreement.basis``): a token up to alpha versions
old differs from the recompute by the policy's own change too, which the staleness bound allows,
and counting it reads a policy that moved as a worker that disagrees (and, under ``quarantine``
/ ``stop``, acts on it). So a worker with at least ``run.worker_checks.min_current_tokens``
tokens generated under the trainer's version in the batch is judged on those alone
(``"current"``); with fewer (few tokens are noise: one over the cap among three is 33%), on
all its generated tokens of the batch (``"all"``, as before the versions were reported). Under
``weight_apply = "at_batch"`` in an overlapped mode a batch holds no token of the trainer's
version after the first step (the new version is applied only once the batch was taken), so
there every worker is judged on ``"all"``. A current token is not always pure engine
agreement either: a request in flight across a weight apply keeps its KV cache (unless the
apply re-prefills), so its tokens labelled with the new version were computed over the old
weights' prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rollart.config import WorkerChecksConfig
from rollart.controller.buffer.sample import Sample
from rollart.transport import messages as m
from rollart.transport.errors import RollartError

#: name used for a sample's turns whose worker was not recorded (samples of older snapshots)
UNKNOWN_WORKER = "?"


class WorkerDisagreementError(RollartError):
    """Fatal (``agreement_policy = "stop"``): a worker's tokens disagree with the trainer."""


@dataclass
class WorkerAgreement:
    """One worker's share of a batch, as judged: ``basis`` ``"current"`` (its tokens generated
    under the trainer's version) or ``"all"`` (all its generated tokens); ``num_tokens`` of
    those tokens in the ``num_samples`` samples it served that have any, their token-weighted
    mean ``logprob_mismatch`` (nats) and ``iw_capped_fraction``, and the largest importance
    weight ``iw_max``."""

    basis: str = "all"
    num_samples: int = 0
    num_tokens: int = 0
    logprob_mismatch: float = 0.0
    iw_capped_fraction: float = 0.0
    iw_max: float = 0.0

    def add(self, num_tokens: int, mismatch: float, capped: float, iw_max: float) -> None:
        self.num_samples += 1
        self.num_tokens += num_tokens
        self.logprob_mismatch += mismatch * num_tokens
        self.iw_capped_fraction += capped * num_tokens
        self.iw_max = max(self.iw_max, iw_max)

    def averaged(self) -> WorkerAgreement:
        if self.num_tokens:
            self.logprob_mismatch /= self.num_tokens
            self.iw_capped_fraction /= self.num_tokens
        return self


def by_worker(
    batch: Sequence[Sample], agreement: Sequence[m.SampleAgreement], min_current_tokens: int = 1
) -> dict[str, WorkerAgreement]:
    """Per serving worker, the agreement of the batch samples it served (a sample served by
    several workers counts for each), token-weighted, on the basis the module docstring
    gives: its tokens of the trainer's version if it has at least ``min_current_tokens`` of
    them, else all its tokens. Empty when ``agreement`` is (a trainer that does not report
    it). Raises ValueError if ``agreement`` is not one entry per sample."""
    if not agreement:
        return {}
    if len(agreement) != len(batch):
        raise ValueError(f"trainer reported agreement for {len(agreement)} samples, the batch "
                         f"has {len(batch)}")
    every: dict[str, WorkerAgreement] = {}
    current: dict[str, WorkerAgreement] = {}
    for s, a in zip(batch, agreement, strict=True):
        for name in sorted(set(s.turn_workers)) or [UNKNOWN_WORKER]:
            name = name or UNKNOWN_WORKER
            every.setdefault(name, WorkerAgreement("all")).add(
                s.num_generated, a.logprob_mismatch, a.iw_capped_fraction, a.iw_max)
            if a.current_tokens:
                current.setdefault(name, WorkerAgreement("current")).add(
                    a.current_tokens, a.current_logprob_mismatch,
                    a.current_iw_capped_fraction, a.current_iw_max)
    out = {}
    for name, w in every.items():
        cur = current.get(name)
        out[name] = (cur if cur is not None and cur.num_tokens >= min_current_tokens
                     else w).averaged()
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
            tokens = ("tokens generated under the trainer's version" if w.basis == "current"
                      else "tokens")
            out[name] = (f"{'; '.join(why)} (iw max {w.iw_max:.4g}, over {w.num_samples} "
                         f"samples / {w.num_tokens} {tokens} of the batch)")
    return out
