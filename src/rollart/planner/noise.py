"""How sure the search is of a simulated step time: standard errors, the cut of a rung, racing.

A candidate's estimate is its mean step time over the steps after the warm-up of every run
(seed) at its highest rung; one step of a small batch is noisy (a long-tailed trajectory
or a step that drains what the previous one overlapped can double it), so the search
compares candidates with the noise of their estimates, not the bare means:

- the standard error of a candidate's mean is ``stdev / sqrt(n)`` over its ``n`` post-warm-up
  step times; a candidate with one step takes the rung's pooled coefficient of variation
  (the root mean square of the others' ``stdev / mean``) times its mean. Successive steps of
  an overlapping mode often alternate (a long step lets the next one start with rollouts
  done); there, treating them as independent over-states the error, and the search keeps
  more candidates rather than fewer;
- a rung keeps its best third, and of the candidates whose mean exceeds the cut's (the last
  one of that third) by less than ``NOISE_Z`` standard errors of the difference (not slower
  than the cut with about 95% confidence, one-sided, as in racing algorithms: Maron and
  Moore, NIPS 1993; Birattari et al., F-Race, GECCO 2002) as many again, those whose
  estimate could be lowest first (``cut``);
- all candidates of a rung run on the same seeds, so a seed's workload (its trajectory
  lengths, env latencies) is common to the comparison (common random numbers);
- after the last rung, while budget is left and a candidate is within the noise of the
  leader, the leader and those candidates run on further common seeds (``racing``), until
  each is either slower with that confidence or resolved to within ``INDIFFERENCE`` of the
  leader's step time (then it does not matter which one wins), or ``MAX_RACE_SEEDS`` seeds
  were added; at most ``RACE_WIDTH`` candidates race the leader, the most promising first.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Protocol

#: one-sided normal quantile: a candidate is dropped when it is slower than the cut with
#: about 95% confidence
NOISE_Z = 1.645
#: racing stops on a candidate once its difference from the leader is known to this share of
#: the leader's step time: the planner's accuracy goal (within 5% of the best layout)
INDIFFERENCE = 0.05
#: racing adds at most this many seeds after the last rung's
MAX_RACE_SEEDS = 8
#: candidates racing the leader at most (successive halving's ``ETA``)
RACE_WIDTH = 3


class Estimate(Protocol):
    """What the noise figures need of a ``rollart.planner.search.Score``."""

    samples_s: list[float]
    se_s: float

    @property
    def step_time_s(self) -> float: ...


def set_standard_errors(scores: Sequence[Estimate]) -> None:
    """Set ``se_s`` of every score (module docstring): from its own post-warm-up steps when
    it has two or more, else from the pooled coefficient of variation of those that do
    (0 when none does: the bare means are all there is)."""
    cvs = [statistics.stdev(s.samples_s) / s.step_time_s for s in scores
           if len(s.samples_s) >= 2 and s.step_time_s > 0]
    pooled = math.sqrt(statistics.fmean(cv * cv for cv in cvs)) if cvs else 0.0
    for s in scores:
        n = len(s.samples_s)
        sd = statistics.stdev(s.samples_s) if n >= 2 else pooled * s.step_time_s
        s.se_s = sd / math.sqrt(max(n, 1))


def margin_s(a: Estimate, b: Estimate) -> float:
    """``NOISE_Z`` standard errors of the difference of two means (seconds)."""
    return NOISE_Z * math.hypot(a.se_s, b.se_s)


def lower_bound_s(s: Estimate) -> float:
    """The optimistic end of ``s``'s estimate: its mean less ``NOISE_Z`` standard errors."""
    return s.step_time_s - NOISE_Z * s.se_s


def cut(scores: Sequence[Estimate], keep: int) -> list[int]:
    """Indices (into ``scores``, sorted best first) a rung keeps: the first ``keep`` and at
    most ``keep`` more of those within the noise of the ``keep``-th, the most promising
    first (lowest ``lower_bound_s``: optimism under uncertainty, as in UCB, Auer et al.,
    Machine Learning 2002), so a rung at most doubles what successive halving keeps."""
    if len(scores) <= keep:
        return list(range(len(scores)))
    edge = scores[keep - 1]
    close = [i for i in range(keep, len(scores))
             if scores[i].step_time_s - edge.step_time_s <= margin_s(scores[i], edge)]
    close.sort(key=lambda i: lower_bound_s(scores[i]))
    return [*range(keep), *sorted(close[:keep])]


def racers(scores: Sequence[Estimate], width: int) -> list[int]:
    """Indices (into ``scores``, best first) racing goes on with: the leader and at most
    ``width`` candidates ``unresolved`` against it, the most promising first; only the
    leader when none is."""
    close = [i for i in range(1, len(scores)) if unresolved(scores[i], scores[0])]
    close.sort(key=lambda i: lower_bound_s(scores[i]))
    return [0, *sorted(close[:width])] if close else [0]


def unresolved(s: Estimate, leader: Estimate) -> bool:
    """Whether racing should run ``s`` further against ``leader``: not yet slower with
    ``NOISE_Z`` confidence, and the uncertainty still larger than ``INDIFFERENCE`` of the
    leader's step time."""
    m = margin_s(s, leader)
    return s.step_time_s - leader.step_time_s <= m and m > INDIFFERENCE * leader.step_time_s
