"""Deadline-paced admission: start a group when it can still be trained, not just when a slot
is free (``run.admission = "paced"``). Pure (times are passed in), so it is unit-tested with
made-up clocks.

Why: at alpha = 1 a group whose tokens are of version ``s`` can only join a batch taken at a
trainer version ``<= s + alpha``. A group admitted late in a step (a slot freed just before the
next version bump) has little of that window left; if its members take longer, all of them are
dropped as stale and the slot produced nothing. Waiting for the next weight apply gives the group
one more step of window for the same work.

Model (all measured in the run, no constants):

- batch period ``P``: mean interval between the last ``window`` batch takes; the batch at
  trainer version ``x`` is expected at ``t_b + (x - v_b) * P`` (``t_b``, ``v_b``: the last take);
- group completion time ``D``: the median of the maximum of ``group_size`` member durations,
  i.e. the ``0.5 ** (1 / group_size)`` quantile of the domain's last ``window`` member durations
  (start to completion, kept or not): for i.i.d. durations with CDF F, P(max <= d) = F(d) ** G;
- deadline of a group started now at serving version ``s`` with bound ``a``: the batch at
  version ``s + a``.

Decision: start now if ``now + D <= deadline(s)``; otherwise wait for the next apply if starting
then would meet its deadline (``t_apply + P + D <= deadline(s) + P``, the next apply expected one
period after the last); else start now (waiting would not help: a domain longer than its window
needs a larger per-domain alpha, not pacing). Before two batches and ``group_size`` durations of
the domain have been seen it always starts.
"""

from __future__ import annotations

import math
from collections import deque


class Pacer:
    """Admission pacing from measured batch periods and member durations (module docstring).

    Args:
        group_size: members per group whose maximum completes the group (> 0).
        window: how many recent batch intervals and durations per domain to keep (> 1).

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, group_size: int, window: int = 64) -> None:
        if group_size < 1 or window < 2:
            raise ValueError(f"Pacer: group_size >= 1 and window >= 2 needed, got "
                             f"{group_size}, {window}")
        self.group_size, self.window = group_size, window
        self._batches: deque[tuple[float, int]] = deque(maxlen=window + 1)
        self._durations: dict[str, deque[float]] = {}
        self._last_apply: float | None = None

    def on_batch(self, t: float, version: int) -> None:
        """A batch was taken at time ``t`` (seconds) at trainer version ``version``."""
        self._batches.append((t, version))

    def on_apply(self, t: float) -> None:
        """A new version reached every worker at time ``t``."""
        self._last_apply = t

    def on_finished(self, domain: str, duration_s: float) -> None:
        """A member of ``domain`` finished ``duration_s`` seconds after it started."""
        d = self._durations.get(domain)
        if d is None:
            d = self._durations[domain] = deque(maxlen=self.window)
        d.append(max(0.0, duration_s))

    def period_s(self) -> float | None:
        """Mean seconds per trainer version over the recent batches, or None (< 2 batches)."""
        if len(self._batches) < 2:
            return None
        (t0, v0), (t1, v1) = self._batches[0], self._batches[-1]
        return (t1 - t0) / (v1 - v0) if v1 > v0 else None

    def group_time_s(self, domain: str) -> float | None:
        """Median completion time of a group of ``domain`` (seconds), or None (too few)."""
        d = self._durations.get(domain)
        if d is None or len(d) < self.group_size:
            return None
        xs = sorted(d)
        q = 0.5 ** (1.0 / self.group_size)
        # the empirical q-quantile: the smallest duration whose empirical CDF is >= q
        return xs[max(0, math.ceil(q * len(xs)) - 1)]

    def should_wait(self, domain: str, now: float, serving: int, alpha: int) -> bool:
        """Whether a group of ``domain`` should wait for the next apply instead of starting at
        ``now`` on workers serving version ``serving`` under bound ``alpha``."""
        period, dur = self.period_s(), self.group_time_s(domain)
        if period is None or dur is None or not self._batches:
            return False
        t_b, v_b = self._batches[-1]
        deadline = t_b + (serving + alpha - v_b) * period
        if now + dur <= deadline:
            return False
        next_apply = (self._last_apply if self._last_apply is not None else t_b) + period
        return next_apply > now and next_apply + dur <= deadline + period
