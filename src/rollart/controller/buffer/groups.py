"""A group's life in the sample buffer: slots filled and closed, samples kept, dropped or
selected, stale ones replaced, groups retired and forgotten.

``Group`` answers what one group wants (which slots are open, whether it is complete or can
still fill). ``GroupTable`` holds the groups in flight and the record of each running or held
trajectory, and carries out what happens to them, counting it in the buffer's
``BufferCounters``. Whether a sample is stale is not decided here: ``SampleBuffer``
(``rollart.controller.buffer.core``, whose module docstring has the rules) asks its staleness
policy and tells the table what to do.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from rollart.controller.buffer.records import LIVE, SampleBufferError, TrajState
from rollart.controller.buffer.sample import Sample
from rollart.controller.buffer.stats import BufferCounters, bump

__all__ = ["Group", "GroupTable"]


@dataclass(slots=True, eq=False)
class Traj:
    """One running or held trajectory in ``slot`` of ``group`` (``attempt``: 1 + retries)."""

    tid: str
    group: Group
    slot: int
    attempt: int
    state: TrajState = TrajState.RUNNING
    #: version of its oldest generated token (``None``: none generated yet)
    min_version: int | None = None
    #: tokens generated so far (what its waste or training counts)
    num_tokens: int = 0
    #: turns begun (``"continue"`` verdicts)
    turns: int = 0
    #: stale under ``on_stale="drop"``: runs on, dropped when it completes
    doomed: bool = False
    #: its sample once completed (``HELD``)
    sample: Sample | None = None

    def oldest(self, version: int) -> int:
        """Version of its oldest generated token (``version`` if it has none yet)."""
        return version if self.min_version is None else self.min_version


@dataclass(slots=True, eq=False)
class Group:
    """One GRPO group in flight: ``slots`` (``None``: closed for good), the completed members
    it ``kept`` and, under unbiased selection, those ``finished`` awaiting selection."""

    key: str
    seq: int
    slots: list[Traj | None]
    #: kept members a complete group holds (the buffer's ``group_size``)
    size: int
    kept: list[Traj] = field(default_factory=list)
    finished: list[Traj] = field(default_factory=list)  # unbiased candidates
    selected: bool = False
    closing: bool = False
    status: Literal["open", "consumed", "retired"] = "open"
    #: trajectories started for it so far (first attempts, retries, restarts, replacements)
    started: int = 0
    domain: str = "default"
    alpha: int = 0

    def live(self) -> list[Traj]:
        """Members running or told to restart, in slot order."""
        return [t for t in self.slots if t is not None and t.state in LIVE]

    def held(self) -> list[Traj]:
        """Completed members not yet consumed: kept, then awaiting selection."""
        return [*self.kept, *self.finished]

    def is_complete(self) -> bool:
        """Open with ``size`` kept members: waits only for a batch to take it."""
        return self.status == "open" and len(self.kept) == self.size

    def wants(self, t: Traj) -> bool:
        """Whether the group still wants member ``t``'s slot filled."""
        if self.status != "open" or self.slots[t.slot] is not t:
            return False
        return t in self.kept or len(self.kept) < self.size

    def surplus(self) -> list[str]:
        """Group complete: its live members not kept, for the caller to cancel (they stay
        counted in flight until ``cancel``)."""
        return [t.tid for t in self.live() if t not in self.kept]


class GroupTable:
    """The groups in flight (``groups``, admission order) and a record per running or held
    trajectory (``trajs``; a finished one's goes at once), with what happens to them.

    Also: ``ready``, the groups that reached ``group_size`` kept members (a superset of the
    complete ones, pruned by ``complete_groups``: finding them costs O(candidates), not
    O(groups in flight)); ``restarts`` and ``cancels``, the ids the buffer started or gave up
    on its own, for the caller (``drain_restarts`` / ``drain_cancels``); ``admitted``, groups
    admitted and not retired (AReaL's ``accepted + running``, in groups).
    """

    def __init__(self, counters: BufferCounters, *, group_size: int,
                 selection: Literal["first", "unbiased"], max_attempts: int,
                 max_group_attempts: int | None, rng: random.Random,
                 on_drop: Callable[[str, str], None] | None,
                 on_forget: Callable[[str], None] | None) -> None:
        self.counters = counters
        self.group_size, self.selection = group_size, selection
        self.max_attempts, self.max_group_attempts = max_attempts, max_group_attempts
        self.rng, self.on_drop, self.on_forget = rng, on_drop, on_forget
        self.groups: dict[str, Group] = {}
        self.trajs: dict[str, Traj] = {}
        self.ready: dict[str, Group] = {}
        self.restarts: list[str] = []
        self.cancels: list[str] = []
        self.admitted = 0
        self.next_seq = 0
        self.group_seq = 0

    # ------------------------------------------------------------------ lookups
    def lookup(self, tid: str, allow_forgotten: bool = True) -> Traj | None:
        """The record of ``tid``; ``None`` for one that finished (or whose group went) when
        ``allow_forgotten``. Raises ``SampleBufferError`` for an id never issued."""
        t = self.trajs.get(tid)
        if t is not None:
            return t
        _, _, seq = tid.rpartition("/")
        if allow_forgotten and seq.isdigit() and int(seq) < self.next_seq:
            return None
        raise SampleBufferError(f"unknown trajectory id {tid!r}")

    def live(self, tid: str) -> Traj | None:
        """The record of live trajectory ``tid``; ``None`` (counted as a late call) if it is
        no longer live."""
        t = self.lookup(tid)
        if t is None or t.state not in LIVE:
            self.counters.late_calls += 1
            return None
        return t

    def complete_groups(self) -> list[Group]:
        """The complete groups (admission order among the ``ready`` ones), dropping from
        ``ready`` those no longer complete."""
        ready = [g for g in self.ready.values() if g.is_complete()]
        if len(ready) != len(self.ready):
            self.ready = {g.key: g for g in ready}
        return ready

    # ------------------------------------------------------------------ admission, slots
    def add_group(self, key: str, domain: str, alpha: int, num_slots: int, *,
                  selected: bool = False, closing: bool = False) -> Group:
        """Register a group in flight with ``num_slots`` empty slots."""
        g = Group(key=key, seq=self.group_seq, slots=[None] * num_slots, size=self.group_size,
                  selected=selected, closing=closing, domain=domain, alpha=alpha)
        self.group_seq += 1
        self.groups[key] = g
        return g

    def admit(self, key: str, domain: str, alpha: int, num_slots: int) -> Group:
        """A new group, one first-attempt trajectory in each of its ``num_slots`` slots."""
        self.admitted += 1
        self.counters.domain(domain).groups_started += 1
        g = self.add_group(key, domain, alpha, num_slots)
        for i in range(num_slots):
            self.new_traj(g, i, attempt=1)
        return g

    def new_traj(self, g: Group, slot: int, attempt: int, tid: str | None = None) -> Traj:
        """A trajectory in ``slot`` of ``g`` (a fresh ``<group>/<seq>`` id unless ``tid``)."""
        if tid is None:
            tid = f"{g.key}/{self.next_seq}"
            self.next_seq += 1
        t = Traj(tid=tid, group=g, slot=slot, attempt=attempt)
        g.slots[slot] = t
        g.started += 1
        self.trajs[tid] = t
        self.counters.started += 1
        self.counters.domain(g.domain).started += 1
        return t

    def refill(self, g: Group, slot: int, attempt: int) -> str | None:
        """A new trajectory in ``slot`` (a retry, restart or stale replacement): its id, or
        ``None`` when the group already started ``max_group_attempts`` per slot, in which case
        the group is given up (``"group_attempts"``) instead: a group whose members keep going
        stale one after another would otherwise be refilled forever."""
        limit = self.max_group_attempts
        if limit is not None and g.started >= limit * len(g.slots):
            self.give_up(g, "group_attempts")
            return None
        return self.new_traj(g, slot, attempt).tid

    def close_slot(self, t: Traj) -> None:
        """``t`` ended without a sample: its slot closes; a group that can no longer fill is
        retired, and unbiased selection runs once no member is left running."""
        g = t.group
        if g.slots[t.slot] is t:
            g.slots[t.slot] = None
        if g.status == "open" and not g.is_complete():
            potential = len(g.kept) + len(g.finished) + len(g.live())
            if potential < g.size:
                self.retire(g)
            elif self.selection == "unbiased" and not g.selected:
                # Selection only fires here with no member left running, so nothing to cancel.
                self.select(g, None)
        self.forget_if_done(g)

    # ------------------------------------------------------------------ samples
    def finish(self, t: Traj, reason: str) -> None:
        """Terminal state, not trained: every token ``t`` generated is wasted for ``reason``
        (exactly once: a trajectory reaches DONE once). Its record goes at once (calls on its
        id are then late calls), so the records are the running and held trajectories only."""
        t.state = TrajState.DONE
        self.trajs.pop(t.tid, None)
        self.counters.wasted(t.group.domain, reason, t.num_tokens)

    def drop(self, t: Traj, reason: str) -> None:
        """Discard a completed sample (counted, reported to ``on_drop``)."""
        g = t.group
        for lst in (g.kept, g.finished):
            if t in lst:
                lst.remove(t)
        t.sample = None
        bump(self.counters.dropped, reason)
        self.finish(t, reason)
        if self.on_drop is not None:
            self.on_drop(t.tid, reason)

    def keep(self, t: Traj) -> None:
        g = t.group
        g.kept.append(t)
        if len(g.kept) == g.size:
            self.ready[g.key] = g
        assert t.sample is not None
        self.counters.kept_members += 1
        self.counters.kept_len += t.sample.num_generated

    def hold(self, t: Traj) -> list[str]:
        """A wanted, admissible sample completed: kept, or (unbiased selection not done yet)
        a candidate. Returns the live members the caller must cancel once the group is
        complete, usually ``[]``."""
        g = t.group
        if self.selection == "unbiased" and not g.selected:
            g.finished.append(t)
            return self.select(g, None)
        self.keep(t)
        return g.surplus() if len(g.kept) == g.size else []

    def unwanted(self, t: Traj) -> None:
        """A sample completed whose slot its group no longer wants: dropped (``"retired"`` if
        the group was retired, else ``"unselected"``)."""
        g = t.group
        self.drop(t, "retired" if g.status == "retired" else "unselected")
        self.forget_if_done(g)

    def replace_stale(self, t: Traj) -> None:
        """A completed sample can never be admitted: drop it, refill its slot."""
        self.drop(t, "stale")
        tid = self.refill(t.group, t.slot, t.attempt)
        if tid is not None:
            self.counters.replaced_stale += 1
            self.restarts.append(tid)

    def drop_stale_group(self, g: Group) -> None:
        """Every sample of ``g`` went stale and no member runs: drop them (``"stale"``) and
        give the group up (``"stale"``) instead of refilling each slot."""
        for t in g.held():
            self.drop(t, "stale")
        self.give_up(g, "stale")

    def select(self, g: Group, rng: random.Random | None) -> list[str]:
        """Unbiased selection once the deadline passed or no member is left running; returns
        the live members to cancel."""
        live = [t for t in g.live() if g.wants(t)]
        if len(g.finished) < g.size or not (g.closing or not live):
            return []
        chosen = set((rng or self.rng).sample(g.finished, g.size))
        finished, g.finished, g.selected = g.finished, [], True
        for t in finished:  # kept in completion order, so batches are reproducible
            if t in chosen:
                self.keep(t)
            else:
                self.drop(t, "unselected")
        return g.surplus()

    # ------------------------------------------------------------------ groups leaving
    def retire(self, g: Group) -> None:
        """``g`` can no longer fill (or is given up): its held samples are dropped."""
        g.status = "retired"
        self.admitted -= 1  # AReaL: a rejected rollout is not "accepted"
        self.counters.groups_retired += 1
        for t in g.held():
            self.drop(t, "retired")

    def give_up(self, g: Group, reason: str) -> None:
        """The buffer drops an open group on its own (counted by ``reason``): held samples are
        dropped (``"retired"``), live members listed for the caller to cancel
        (``drain_cancels``)."""
        if g.status != "open":
            return
        bump(self.counters.groups_dropped, reason)
        self.retire(g)
        self.cancels.extend(t.tid for t in g.live())
        self.forget_if_done(g)

    def discard(self, g: Group, reason: str) -> None:
        """A complete group the batch policy throws away: its samples are wasted for
        ``reason``; counted in ``groups_dropped`` as the caller's ``drop_group`` is."""
        bump(self.counters.groups_dropped, reason)
        self.ready.pop(g.key, None)
        g.status = "retired"
        self.admitted -= 1
        self.counters.groups_retired += 1
        for t in list(g.kept):
            self.drop(t, reason)
        self.forget_if_done(g)

    def consume(self, g: Group) -> None:
        """A batch took ``g``: its kept samples' records go (counted by the batch)."""
        for t in g.kept:
            t.state, t.sample = TrajState.DONE, None
            del self.trajs[t.tid]
        g.kept, g.status = [], "consumed"
        self.forget_if_done(g)

    def forget_if_done(self, g: Group) -> None:
        """A consumed or retired group with no live member leaves (``on_forget``)."""
        if g.status != "open" and not g.live() and self.groups.get(g.key) is g:
            # Its trajectories' records went as each finished or was consumed.
            del self.groups[g.key]
            if self.on_forget is not None:
                self.on_forget(g.key)

    # ------------------------------------------------------------------ the caller's reports
    # (``SampleBuffer``'s methods of the same name have the contracts.)
    def close(self, group_key: str, rng: random.Random | None) -> list[str]:
        """Unbiased selection deadline of ``group_key``: the live members to cancel."""
        g = self.groups.get(group_key)
        if g is None or g.status != "open" or g.selected or self.selection != "unbiased":
            return []
        g.closing = True
        return self.select(g, rng)

    def fail(self, t: Traj, reason: str) -> str | None:
        """Live ``t`` failed: its retry id, or ``None`` (its slot closed)."""
        if not reason:
            raise SampleBufferError(f"trajectory {t.tid!r}: fail() needs a reason")
        bump(self.counters.failed, reason)
        self.finish(t, "failed")
        g = t.group
        if g.wants(t) and t.attempt < self.max_attempts:
            retry = self.refill(g, t.slot, t.attempt + 1)
            if retry is not None:
                self.counters.retries += 1
            return retry
        was_open = g.status == "open" and t.attempt >= self.max_attempts
        self.close_slot(t)
        if was_open and g.status == "retired":
            # A slot ran out of attempts and the group can no longer fill: given up, by reason.
            bump(self.counters.groups_dropped, "attempts_exhausted")
        return None

    def drop_group(self, group_key: str, reason: str) -> list[str]:
        """The caller gives up an open group: its live members to cancel."""
        g = self.groups.get(group_key)
        if g is None or g.status != "open":
            return []
        if not reason:
            raise SampleBufferError(f"group {group_key!r}: drop_group() needs a reason")
        bump(self.counters.groups_dropped, reason)
        self.retire(g)
        live = [t.tid for t in g.live()]
        self.forget_if_done(g)
        return live

    def cancel(self, t: Traj, reason: str | None) -> None:
        """The caller aborted live ``t``; ``None`` derives the waste reason."""
        if reason is None:
            reason = ("retired" if t.group.status == "retired"
                      else "stale" if t.state is TrajState.ABORTING or t.doomed
                      else "redundancy")
        self.counters.cancelled += 1
        self.counters.cancelled_len += t.num_tokens
        self.finish(t, reason)
        self.close_slot(t)

    def restart(self, t: Traj) -> str | None:
        """Live ``t`` was told to restart: a fresh id in its slot, or ``None``."""
        if t.state is not TrajState.ABORTING:
            raise SampleBufferError(f"trajectory {t.tid!r} was not told to restart")
        self.counters.restarted_stale += 1
        self.finish(t, "stale")
        if t.group.wants(t):
            return self.refill(t.group, t.slot, t.attempt)
        self.close_slot(t)
        return None
