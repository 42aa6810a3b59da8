"""Batch assembly in the sample buffer: which complete groups a batch trains on, and the
bookkeeping of the batch handed to the trainer until ``advance_version``.

``ReadyGroup`` and ``BatchPlan`` are the types of the batch policy a ``SampleBuffer`` subclass
may override (``assemble_batch`` / ``batch_order``, on the class in
``rollart.controller.buffer.core``); the functions here run ``SampleBuffer.take_batch`` and
``drop_consumed`` over the buffer's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollart.controller.buffer.groups import discard, maybe_forget, sweep_stale
from rollart.controller.buffer.records import Group, SampleBufferError, TrajState
from rollart.controller.buffer.sample import Sample

if TYPE_CHECKING:
    from rollart.controller.buffer.core import SampleBuffer

__all__ = ["BatchPlan", "ReadyGroup"]


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


def take_batch(buf: SampleBuffer, default_policy: bool) -> list[Sample] | None:
    """``SampleBuffer.take_batch`` (its docstring); ``default_policy``: the buffer's class
    keeps the default ``assemble_batch``, so a scan below a batch's worth of groups can be
    skipped."""
    if buf._outstanding:
        raise SampleBufferError(
            f"a batch for version {buf._version} is outstanding; call advance_version()"
        )
    buf._batch_members.clear()
    sweep_stale(buf)
    need = buf.batch_size // buf.group_size
    if default_policy and len(buf._ready) < need:
        # The default policy takes nothing below ``need`` complete groups and discards
        # nothing: skip the scan (O(ready groups) per kept sample otherwise). A group
        # that stopped being complete stays listed until the next scan drops it.
        return None
    ready = [g for g in buf._ready.values() if buf._complete(g)]
    if len(ready) != len(buf._ready):
        buf._ready = {g.key: g for g in ready}
    if default_policy and len(ready) < need:
        return None
    chosen = plan(buf, ready, need)
    if chosen is None:
        return None
    out: list[Sample] = []
    buf._last_staleness = []
    for g in chosen:
        d = buf._dom(g.domain)
        for t in g.kept:
            if not buf._ok(t):  # unreachable after the sweep
                raise SampleBufferError(f"internal: stale sample {t.tid!r} in a batch")
            assert t.sample is not None
            out.append(t.sample)
            buf._last_staleness.append(buf._version - buf._mv(t))
            buf._trained_tokens += t.num_tokens
            buf._batch_members[t.tid] = (t.num_tokens, t.sample.num_generated,
                                         t.sample.num_turns, g.domain)
            d.trained += 1
            d.trained_tokens += t.sample.num_generated
            d.trained_turns += t.sample.num_turns
            t.state, t.sample = TrajState.DONE, None
            del buf._trajs[t.tid]
        g.kept, g.status = [], "consumed"
        maybe_forget(buf, g)
    buf._c["consumed"] += len(out)
    buf._c["batches"] += 1
    buf._outstanding = True
    return out


def plan(buf: SampleBuffer, ready: list[Group], need: int) -> list[Group] | None:
    """Ask ``assemble_batch``, check its plan, discard what it discards; the groups to
    train on, or ``None``."""
    if not ready:
        return None
    views = [ReadyGroup(g.key, g.domain, g.seq, min(buf._mv(t) for t in g.kept),
                        tuple(t.sample.reward for t in g.kept if t.sample is not None),
                        sum(t.sample.num_generated for t in g.kept if t.sample is not None))
             for g in ready]
    proposed = buf.assemble_batch(views, need)
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
        discard(buf, by_key[key], reason)
    return [by_key[k] for k in take] if take else None


def drop_consumed(buf: SampleBuffer, sample_id: str, reason: str) -> None:
    """``SampleBuffer.drop_consumed`` (its docstring): undo one sample's share of the
    trained counts and count it dropped / wasted for ``reason`` instead."""
    entry = buf._batch_members.pop(sample_id, None) if buf._outstanding else None
    if entry is None:
        raise SampleBufferError(f"drop_consumed: {sample_id!r} is not in the outstanding "
                                "batch")
    num_tokens, num_generated, num_turns, domain = entry
    d = buf._dom(domain)
    buf._trained_tokens -= num_tokens
    d.trained -= 1
    d.trained_tokens -= num_generated
    d.trained_turns -= num_turns
    buf._c["consumed"] -= 1
    buf._dropped[reason] = buf._dropped.get(reason, 0) + 1
    if num_tokens:
        buf._wasted[reason] = buf._wasted.get(reason, 0) + num_tokens
        d.wasted_tokens[reason] = d.wasted_tokens.get(reason, 0) + num_tokens
