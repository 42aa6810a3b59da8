"""The sample buffer's counters (``BufferCounters``) and their report, ``SampleBuffer.stats()``.

What each counts is in ``rollart.controller.buffer.core``'s module docstring ("Waste and
selection accounting"): every generated token ends trained, wasted under one reason, or still
in flight, in total and per task domain.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import msgspec

from rollart.controller.buffer.records import LIVE, TrajState
from rollart.controller.buffer.sample import BufferStats, DomainCounts

__all__ = ["BufferCounters"]


class _Member(Protocol):
    @property
    def state(self) -> TrajState: ...
    @property
    def num_tokens(self) -> int: ...


class GroupMembers(Protocol):
    """What the gauges read of a group (``groups.Group``, which imports this module)."""

    @property
    def slots(self) -> Sequence[_Member | None]: ...
    @property
    def kept(self) -> Sequence[_Member]: ...
    @property
    def finished(self) -> Sequence[_Member]: ...


def bump(counts: dict[str, int], key: str, n: int = 1) -> None:
    """``counts[key] += n``, from 0."""
    counts[key] = counts.get(key, 0) + n


class BufferCounters:
    """Every cumulative counter of one ``SampleBuffer`` (from 0 at construction or restore).

    The hot paths bump the plain int attributes in place (each named as the ``BufferStats``
    field it feeds, ``*_len`` the generated tokens summed for a mean); the by-reason dicts go
    through the methods, which keep the per-domain copy (``domains``) in step with the total.
    """

    __slots__ = (
        "started", "completed", "consumed", "batches", "retries", "restarted_stale",
        "replaced_stale", "cancelled", "groups_retired", "late_calls", "finished_members",
        "finished_len", "kept_members", "kept_len", "cancelled_len", "generated_tokens",
        "trained_tokens", "failed", "dropped", "wasted_tokens", "groups_dropped", "domains",
        "last_staleness",
    )

    def __init__(self) -> None:
        self.started = self.completed = self.consumed = self.batches = 0
        self.retries = self.restarted_stale = self.replaced_stale = 0
        self.cancelled = self.groups_retired = self.late_calls = 0
        self.finished_members = self.finished_len = 0
        self.kept_members = self.kept_len = self.cancelled_len = 0
        #: tokens generated, and of those trained (the rest: wasted or in flight)
        self.generated_tokens = self.trained_tokens = 0
        #: trajectory failures, dropped samples, wasted tokens and given-up groups, by reason
        self.failed: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.wasted_tokens: dict[str, int] = {}
        self.groups_dropped: dict[str, int] = {}
        self.domains: dict[str, DomainCounts] = {}
        #: staleness (versions) of each sample of the last batch taken
        self.last_staleness: list[int] = []

    def domain(self, name: str) -> DomainCounts:
        """The counters of task domain ``name`` (created at 0 on first use)."""
        d = self.domains.get(name)
        if d is None:
            d = self.domains[name] = DomainCounts()
        return d

    def generated(self, domain: str, n: int) -> None:
        """``n`` more tokens generated for ``domain``."""
        self.generated_tokens += n
        self.domain(domain).generated_tokens += n

    def wasted(self, domain: str, reason: str, n: int) -> None:
        """``n`` generated tokens of ``domain`` thrown away for ``reason`` (no entry if 0)."""
        if n:
            bump(self.wasted_tokens, reason, n)
            bump(self.domain(domain).wasted_tokens, reason, n)

    def stats(self, *, version: int, alpha: int, batch_size: int, group_size: int,
              redundancy: int, max_groups: int, groups: Iterable[GroupMembers],
              ready_samples: int) -> BufferStats:
        """A copy of every counter, with the gauges of this moment: ``groups`` are the groups
        in flight (walked once for the running / held members and their tokens), the other
        arguments the buffer's config and state as ``BufferStats`` names them."""
        # One pass, no list per group: at 10k trajectories this runs on the loop every step.
        running = held = in_flight_tokens = in_flight_groups = 0
        for g in groups:
            in_flight_groups += 1
            for t in g.slots:
                if t is not None and t.state in LIVE:
                    running += 1
                    in_flight_tokens += t.num_tokens
            for t in g.kept:
                in_flight_tokens += t.num_tokens
            for t in g.finished:
                in_flight_tokens += t.num_tokens
            held += len(g.kept) + len(g.finished)
        st = self.last_staleness
        return BufferStats(
            version=version,
            alpha=alpha,
            batch_size=batch_size,
            group_size=group_size,
            redundancy=redundancy,
            max_groups=max_groups,
            groups_in_flight=in_flight_groups,
            running=running,
            held=held,
            in_flight=running + held,
            in_flight_bound=(alpha + 1) * batch_size + redundancy * in_flight_groups,
            ready_samples=ready_samples,
            started=self.started,
            completed=self.completed,
            consumed=self.consumed,
            batches=self.batches,
            retries=self.retries,
            failed=dict(self.failed),
            restarted_stale=self.restarted_stale,
            replaced_stale=self.replaced_stale,
            dropped=dict(self.dropped),
            cancelled=self.cancelled,
            groups_retired=self.groups_retired,
            groups_dropped=dict(self.groups_dropped),
            wasted_tokens=dict(self.wasted_tokens),
            late_calls=self.late_calls,
            finished_members=self.finished_members,
            finished_mean_len=self.finished_len / max(self.finished_members, 1),
            kept_members=self.kept_members,
            kept_mean_len=self.kept_len / max(self.kept_members, 1),
            cancelled_mean_len=self.cancelled_len / max(self.cancelled, 1),
            last_batch_max_staleness=max(st, default=0),
            last_batch_mean_staleness=sum(st) / len(st) if st else 0.0,
            generated_tokens=self.generated_tokens,
            trained_tokens=self.trained_tokens,
            in_flight_tokens=in_flight_tokens,
            domains={k: msgspec.structs.replace(v, wasted_tokens=dict(v.wasted_tokens))
                     for k, v in sorted(self.domains.items())},
        )
