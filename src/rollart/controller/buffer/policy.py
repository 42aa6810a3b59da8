"""The sample buffer's policy: which samples are admissible, the sweep of stale ones,
admission room and batch assembly.

``StalenessPolicy`` is the layer of ``SampleBuffer`` (``rollart.controller.buffer.core``, whose
module docstring states every rule these methods carry out) that decides; the group table
carries the decisions out. A subclass of ``SampleBuffer`` overrides :meth:`assemble_batch` /
:meth:`batch_order` (or ``has_room`` / ``has_capacity``) to assemble batches or admit groups
otherwise.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from rollart.controller.buffer.batch import BatchPlan, ReadyGroup
from rollart.controller.buffer.groups import Group, Traj
from rollart.controller.buffer.queries import BufferQueries
from rollart.controller.buffer.records import TrajState

__all__ = ["StalenessPolicy"]


class StalenessPolicy(BufferQueries):
    """Staleness (admissible, _ok, _sweep), admission room (has_room, has_capacity) and batch
    assembly (assemble_batch, batch_order, holds_batch; ``SampleBuffer.take_batch`` puts a
    plan into effect)."""

    def admissible(self, min_version: int | None, alpha: int | None = None) -> bool:
        """Whether tokens whose oldest version is ``min_version`` may train at this version,
        under bound ``alpha`` (default the buffer's; a group's own with ``_ok``)."""
        a = self.alpha if alpha is None else alpha
        return min_version is None or min_version >= self._version - a

    def _ok(self, t: Traj) -> bool:
        # AReaL's policy never rejects a sample for staleness once admitted.
        return self._areal or self.admissible(t.min_version, t.group.alpha)

    def _sweep(self) -> None:
        """Replace stale held samples (and abort stale running trajectories if configured).
        Skipped while ``_fresh_bound`` proves no trajectory is stale (a sweep would do
        nothing); a full sweep recomputes the bound."""
        if self._fresh_bound is not None and self._fresh_bound >= self._version:
            return
        abort = self.abort_stale and self.check == "per_turn" and self.on_stale == "restart"
        bound: int | None = None
        for g in list(self._groups.values()):
            if g.status != "open":
                continue
            if self.readmit_stale_groups and self._stale_whole(g):
                self._table.drop_stale_group(g)
                continue
            for t in g.held():
                if not self._ok(t) and t.state is TrajState.HELD:
                    # (a replacement past the group's attempts gives the group up, and drops
                    # the rest of this list with it)
                    self._table.replace_stale(t)
            for t in [*g.held(), *g.live()]:
                if (abort and t.state is TrajState.RUNNING and not self._ok(t)
                        and g.wants(t)):
                    t.state = TrajState.ABORTING
                    self._aborts.append(t.tid)
                if t.min_version is not None:
                    b = t.min_version + g.alpha
                    bound = b if bound is None or b < bound else bound
        # No trajectory with a version at all: any later one lowers the bound from here.
        self._fresh_bound = self._version if bound is None else bound

    def _stale_whole(self, g: Group) -> bool:
        """Whether open group ``g`` has samples, every one of them stale, and no member it
        wants running (a complete group's surplus members are being cancelled): refilling it
        in place would start a whole group outside admission."""
        held = g.held()
        return (bool(held) and not any(g.wants(t) for t in g.live())
                and not any(self._ok(t) for t in held))

    @staticmethod
    def groups_bound(alpha: int, batch_size: int, group_size: int) -> int:
        """``max_groups``: groups in flight the buffer admits, ``(alpha + 1) * batch_size //
        group_size`` (each of ``group_size + redundancy`` trajectories)."""
        return (alpha + 1) * batch_size // group_size

    def has_room(self) -> bool:
        """Whether ``try_start_group`` would admit a group now: ``groups_in_flight <
        max_groups``, and with ``staleness_control="areal"`` also AReaL's capacity
        (``core``'s module docstring)."""
        if len(self._groups) >= self.max_groups:
            # Also under AReaL's capacity: a retired group leaves it at once but stays in
            # flight until its members are cancelled.
            return False
        if self._areal:
            cap = (self.alpha + self._version + 1) * (self.batch_size // self.group_size)
            return self._table.admitted < cap
        return True

    def has_capacity(self, serving_version: int, alpha: int | None = None) -> bool:
        """Version-aware admission: whether a group started now on workers serving
        ``serving_version`` (bound ``alpha``, default the buffer's) can still be trained.

        Its samples can join the batches at trainer versions ``n .. serving_version + alpha``
        (``n``: the next batch's version), i.e. ``k = serving_version + alpha - n + 1`` batches,
        ``k * batch_size / group_size`` groups; batches are filled oldest first, so every open
        group in flight that is still admissible at ``n`` comes before it. True if fewer such
        groups than that are in flight (a group beyond them would only be trained if one of
        them fails), and while ``has_room``.
        """
        if not self.has_room():
            return False
        a = self.alpha if alpha is None else alpha
        n = self._version + (1 if self._outstanding else 0)
        batches = serving_version + a - n + 1
        if batches <= 0:
            return False
        eligible = 0
        for g in self._groups.values():
            if g.status != "open":
                continue
            versions = [t.min_version for t in (*g.kept, *g.finished, *g.live())
                        if t.min_version is not None]
            if not versions or min(versions) >= n - g.alpha:
                eligible += 1
        return eligible < batches * (self.batch_size // self.group_size)

    def assemble_batch(self, ready: Sequence[ReadyGroup], need: int) -> BatchPlan:
        """Batch assembly policy: which of the ``ready`` complete groups (each admissible now)
        the next batch trains on, and which to throw away. ``take_batch`` calls it whenever a
        batch may be ready (a sample was kept or the version advanced) with at least one
        ready group. Default: no batch until ``need`` groups are ready, then the first
        ``need`` by :meth:`last_chance`, then :meth:`batch_order`; nothing discarded.
        Override it in a subclass to assemble batches otherwise (filter, balance domains,
        ...). A group neither taken nor discarded stays ready until it is taken or goes
        stale, holding its place in the in-flight bound: a policy that never takes nor
        discards a group can stall the run.

        Returns:
            a :class:`BatchPlan`; ``take_batch`` raises SampleBufferError if its ``take`` is
            neither empty nor exactly ``need`` distinct ready keys, or ``discard`` names a key
            that is not ready, is also taken, or has an empty reason.
        """
        if len(ready) < need:
            return BatchPlan()
        order = sorted(ready, key=lambda g: (self.last_chance(g.key, g.min_version),
                                             self.batch_order(g.domain, g.min_version, g.seq)))
        return BatchPlan(take=[g.key for g in order[:need]])

    def last_chance(self, key: str, min_version: int) -> int:
        """Which of the batches still open to group ``key`` (oldest token ``min_version``, its
        group's alpha) the one taken now is: 0 its last (it goes stale at the next version if
        left out), 1 the last but one, 2 any earlier. The default :meth:`assemble_batch`
        takes ready groups by this first, then by :meth:`batch_order`, so a group that can
        still join a later batch never takes the place of one that cannot."""
        g = self._groups.get(key)
        alpha = self.alpha if g is None else g.alpha
        return min(max(min_version + alpha - self._version, 0), 2)

    def batch_order(self, domain: str, min_version: int, seq: int) -> Any:
        """Sort key of a complete group (smallest first) for the default
        :meth:`assemble_batch`; ``min_version`` is the oldest generated-token version of its
        kept samples, ``seq`` its admission order. Default: oldest tokens first, then oldest
        group (fewest samples go stale). Override it to reorder batches without filtering."""
        return (min_version, seq)

    def holds_batch(self, ready: set[str], taking: Collection[str] = ()) -> bool:
        """Whether a batch taken now would make an open group stale that waiting could save.

        Either (1) an open group that is not among the ``ready`` keys has a trajectory (kept,
        finished or running) with a token of a version below ``version + 1 - alpha`` (its
        group's alpha): once the batch's update is applied it can no longer be trained on and
        its tokens are wasted; or (2) the batch is ``taking`` (the keys the plan takes) a group
        that could still join a later batch while more groups than one batch holds have their
        last chance at the next version (oldest token exactly ``version + 1 - alpha``), one of
        them not ready yet: the next batch cannot take them all, so the one left out goes
        stale, unless it takes the younger group's place in this batch once it is ready. A
        group with no token yet is never waited for (it loses nothing).
        """
        nxt = self._version + 1
        at_next, waiting = 0, False
        younger_taken = False
        taken = set(taking)
        for g in self._groups.values():
            if g.status != "open":
                continue
            # A ready group trains on its kept samples only (its stragglers are cancelled).
            members = g.kept if g.key in ready else (*g.kept, *g.finished, *g.live())
            versions = [t.min_version for t in members if t.min_version is not None]
            if g.key in taken:
                younger_taken |= not versions or min(versions) > nxt - g.alpha
                continue
            if not versions:
                continue
            oldest = min(versions)
            if g.key not in ready and oldest < nxt - g.alpha:
                return True
            if oldest == nxt - g.alpha:
                at_next += 1
                waiting |= g.key not in ready
        return younger_taken and waiting and at_next > self.batch_size // self.group_size

    def _lower_bound(self, t: Traj) -> None:
        """``t.min_version`` was just lowered: keep ``_fresh_bound`` a lower bound."""
        if self._fresh_bound is not None and t.min_version is not None:
            self._fresh_bound = min(self._fresh_bound, t.min_version + t.group.alpha)
