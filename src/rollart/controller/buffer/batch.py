"""Batch assembly in the sample buffer: which complete groups a batch trains on, and the
bookkeeping of the batch handed to the trainer until ``advance_version``.

``ReadyGroup`` and ``BatchPlan`` are the types of the batch policy a ``SampleBuffer`` subclass
may override (``assemble_batch`` / ``batch_order``, on the class in
``rollart.controller.buffer.core``, whose ``take_batch`` reads as the whole flow);
``BatchAssembler`` puts that policy's plan into effect and counts what the batch trains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rollart.controller.buffer.groups import Group, GroupTable, Traj
from rollart.controller.buffer.records import SampleBufferError
from rollart.controller.buffer.sample import Sample
from rollart.controller.buffer.stats import BufferCounters, bump

__all__ = ["BatchAssembler", "BatchPlan", "ReadyGroup"]


@dataclass(frozen=True, slots=True)
class ReadyGroup:
    """A complete group ``take_batch`` may train on, as ``assemble_batch`` sees it: ``key``,
    ``domain``, ``seq`` (admission order), ``min_version`` (oldest generated-token version of
    its samples), ``rewards`` (its ``group_size`` samples' rewards, completion order) and
    ``num_generated`` (their generated tokens, summed). Every ready group is admissible at the
    buffer's version (stale ones were swept before)."""

    key: str
    domain: str
    seq: int
    min_version: int
    rewards: tuple[float, ...]
    num_generated: int


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """What ``assemble_batch`` decides: ``take``, the keys of exactly ``batch_size /
    group_size`` ready groups to train on, in batch order, or ``()`` for no batch yet;
    ``discard``, ready groups to throw away, key -> reason (their samples are dropped and
    their tokens counted wasted under that reason, the group in ``stats().groups_dropped``)."""

    take: Sequence[str] = ()
    discard: dict[str, str] = field(default_factory=dict)


#: a batch policy: ``SampleBuffer.assemble_batch`` (ready groups, groups a batch needs)
Policy = Callable[[Sequence[ReadyGroup], int], BatchPlan]


class BatchAssembler:
    """Turns the complete groups into the next batch as a policy plans it, and keeps the
    outstanding batch's ``members`` (sample id -> tokens counted as trained, generated tokens,
    turns, domain) until the next batch, for ``drop_consumed``.

    ``need``: groups per batch (``batch_size / group_size``). What a batch trains is counted in
    ``counters`` (per domain too); the groups it takes or discards leave through ``table``.
    """

    def __init__(self, table: GroupTable, counters: BufferCounters, need: int) -> None:
        self.table, self.counters, self.need = table, counters, need
        self.members: dict[str, tuple[int, int, int, str]] = {}

    def choose(self, policy: Policy, version: int, default_policy: bool) -> list[Group] | None:
        """The groups ``policy`` takes for the batch trained at ``version`` (after discarding
        those it discards), or ``None``. ``default_policy``: ``policy`` is the default
        ``assemble_batch``, which takes nothing below ``need`` complete groups and discards
        nothing, so those calls are skipped.

        Raises:
            SampleBufferError: the plan breaks its protocol (``SampleBuffer.assemble_batch``).
        """
        need = self.need
        if default_policy and len(self.table.ready) < need:
            # Skip the scan (O(ready groups) per kept sample otherwise). A group that stopped
            # being complete stays listed until the next scan drops it.
            return None
        ready = self.table.complete_groups()
        if (default_policy and len(ready) < need) or not ready:
            return None
        views = [ReadyGroup(g.key, g.domain, g.seq, min(t.oldest(version) for t in g.kept),
                            tuple(t.sample.reward for t in g.kept if t.sample is not None),
                            sum(t.sample.num_generated for t in g.kept if t.sample is not None))
                 for g in ready]
        proposed = policy(views, need)
        by_key = {g.key: g for g in ready}
        take = list(proposed.take)
        if take and (len(take) != need or len(set(take)) != need
                     or not set(take) <= by_key.keys()):
            raise SampleBufferError(
                f"assemble_batch: take must be () or {need} distinct ready group keys, got "
                f"{take!r} (ready: {sorted(by_key)})")
        for key, reason in proposed.discard.items():
            if key not in by_key or key in take or not isinstance(reason, str) or not reason:
                raise SampleBufferError(
                    f"assemble_batch: discard {key!r}: {reason!r} must name a ready group not "
                    f"taken, with a non-empty reason (ready: {sorted(by_key)})")
        for key, reason in proposed.discard.items():
            self.table.discard(by_key[key], reason)
        return [by_key[k] for k in take] if take else None

    def consume(self, chosen: list[Group], version: int,
                admissible: Callable[[Traj], bool]) -> list[Sample]:
        """The samples of ``chosen``, in order, trained at ``version``: counted as trained and
        consumed, their groups consumed. ``admissible`` re-checks each (all pass after the
        sweep; a failure is an internal error)."""
        out: list[Sample] = []
        c = self.counters
        c.last_staleness = []
        for g in chosen:
            d = c.domain(g.domain)
            for t in g.kept:
                if not admissible(t):  # unreachable after the sweep
                    raise SampleBufferError(f"internal: stale sample {t.tid!r} in a batch")
                s = t.sample
                assert s is not None
                out.append(s)
                c.last_staleness.append(version - t.oldest(version))
                c.trained_tokens += t.num_tokens
                self.members[t.tid] = (t.num_tokens, s.num_generated, s.num_turns, g.domain)
                d.trained += 1
                d.trained_tokens += s.num_generated
                d.trained_turns += s.num_turns
            self.table.consume(g)
        c.consumed += len(out)
        c.batches += 1
        return out

    def drop_consumed(self, sample_id: str, reason: str, outstanding: bool) -> None:
        """``SampleBuffer.drop_consumed`` (its docstring): undo one sample's share of the
        trained counts and count it dropped / wasted for ``reason`` instead."""
        entry = self.members.pop(sample_id, None) if outstanding else None
        if entry is None:
            raise SampleBufferError(f"drop_consumed: {sample_id!r} is not in the outstanding "
                                    "batch")
        num_tokens, num_generated, num_turns, domain = entry
        c = self.counters
        d = c.domain(domain)
        c.trained_tokens -= num_tokens
        d.trained -= 1
        d.trained_tokens -= num_generated
        d.trained_turns -= num_turns
        c.consumed -= 1
        bump(c.dropped, reason)
        c.wasted(domain, reason, num_tokens)
