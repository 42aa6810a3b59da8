"""The sample buffer's state and its read-only queries: the layer ``SampleBuffer`` is built on.

``BufferQueries`` declares every attribute of a ``SampleBuffer`` (set by
``SampleBuffer.__init__`` in ``rollart.controller.buffer.core``, whose module docstring has
the protocol) and answers questions about it: versions, groups in flight, live and held
trajectories, per-domain counters, and the drains through which the buffer hands the caller
the trajectories it started, cancelled or aborted on its own. Nothing here changes a group or a
trajectory; the drains only empty their own lists.
"""

from __future__ import annotations

from typing import Literal

from rollart.controller.buffer.batch import BatchAssembler
from rollart.controller.buffer.groups import Group, GroupTable, Traj
from rollart.controller.buffer.records import LIVE
from rollart.controller.buffer.sample import DomainCounts
from rollart.controller.buffer.stats import BufferCounters

__all__ = ["BufferQueries"]


class BufferQueries:
    """Read-only queries of a ``SampleBuffer`` (its attributes are declared here, set by its
    ``__init__``); see ``SampleBuffer`` for the arguments they come from."""

    alpha: int
    batch_size: int
    group_size: int
    redundancy: int
    selection: Literal["first", "unbiased"]
    check: Literal["per_turn", "admission"]
    on_stale: Literal["restart", "drop"]
    max_attempts: int
    fresh_start: bool
    abort_stale: bool
    staleness_control: Literal["bound", "areal"]
    hold_for_groups: bool
    readmit_stale_groups: bool
    #: the last ``take_batch`` found a batch but held it (``hold_for_groups``)
    holding: bool
    max_groups: int
    _areal: bool
    _version: int
    #: a batch was taken at this version; its update is not applied yet
    _outstanding: bool
    #: running trajectories that went stale on a version bump (``abort_stale``)
    _aborts: list[str]
    #: a lower bound of ``min_version + group alpha`` over the open groups' trajectories
    #: (``None``: none known; ``policy.StalenessPolicy._sweep``)
    _fresh_bound: int | None
    _counters: BufferCounters
    _table: GroupTable
    _batch: BatchAssembler
    #: the table's groups in flight and trajectory records (never rebound), by short names
    _groups: dict[str, Group]
    _trajs: dict[str, Traj]

    @property
    def version(self) -> int:
        """Trainer version: weight updates applied (int >= 0)."""
        return self._version

    @property
    def batch_outstanding(self) -> bool:
        """True between a successful ``take_batch`` and the next ``advance_version``."""
        return self._outstanding

    @property
    def max_group_attempts(self) -> int | None:
        """Trajectories one group may start, per slot (``None``: no limit); may be changed
        between calls."""
        return self._table.max_group_attempts

    @max_group_attempts.setter
    def max_group_attempts(self, value: int | None) -> None:
        self._table.max_group_attempts = value

    @property
    def groups_in_flight(self) -> int:
        """Groups admitted and not yet forgotten (O(1); also in ``stats()``)."""
        return len(self._groups)

    @property
    def num_kept(self) -> int:
        """Samples kept into a group so far (cumulative; O(1)). A ``take_batch`` that found no
        batch finds none again until this grows or the version advances."""
        return self._counters.kept_members

    def is_live(self, traj_id: str) -> bool:
        """Whether ``traj_id`` is running (or aborting) now: started, and neither completed,
        failed nor cancelled (O(1); unknown ids are not live)."""
        t = self._trajs.get(traj_id)
        return t is not None and t.state in LIVE

    def group_of(self, traj_id: str) -> str:
        """Group key of a live or held trajectory. Raises ``SampleBufferError`` otherwise."""
        t = self._table.lookup(traj_id, allow_forgotten=False)
        assert t is not None  # lookup raises instead
        return t.group.key

    def held_sample_ids(self) -> set[str]:
        """Ids of completed samples still held (kept or awaiting selection), not consumed."""
        return {t.tid for g in self._groups.values() for t in (*g.kept, *g.finished)}

    def running_ids(self) -> list[str]:
        """Ids of live trajectories (running, or told to restart), in creation order."""
        return [t.tid for t in self._trajs.values() if t.state in LIVE]

    def ready_samples(self) -> int:
        """Samples in complete, unconsumed groups (all admissible after the last sweep)."""
        return self.group_size * sum(1 for g in self._table.ready.values() if g.is_complete())

    def domain_counts(self) -> dict[str, DomainCounts]:
        """Live per-domain counters (read-only view; ``stats().domains`` is a copy)."""
        return self._counters.domains

    def groups_in_flight_by_domain(self) -> dict[str, int]:
        """Groups in flight (admitted, not yet consumed or retired, or with live members) per
        domain."""
        out: dict[str, int] = {}
        for g in self._groups.values():
            out[g.domain] = out.get(g.domain, 0) + 1
        return out

    def group_status(self, group_key: str) -> Literal["open", "consumed", "retired"] | None:
        """``"open"`` (collecting members, or complete and waiting for a batch),
        ``"consumed"`` or ``"retired"`` (in flight while a member is live), ``None`` once the
        group is forgotten."""
        g = self._groups.get(group_key)
        return None if g is None else g.status

    def live_members(self, group_key: str) -> list[str]:
        """Ids of the live members of a group in flight (``[]`` once forgotten): the stragglers
        of a consumed or retired group learn it at their next turn start, so a caller that
        gives up waiting cancels them through this."""
        g = self._groups.get(group_key)
        return [] if g is None else [t.tid for t in g.live()]

    def group_complete(self, group_key: str) -> bool:
        """Whether group ``group_key`` holds ``group_size`` kept, admissible samples and waits
        only for a batch to take it (``False`` for a group not in flight)."""
        g = self._groups.get(group_key)
        return g is not None and g.is_complete()

    def open_groups(self) -> list[tuple[str, str, int, list[str]]]:
        """``(key, domain, kept members, live member ids)`` of every group still collecting,
        oldest first (what a batch waits on)."""
        return [(g.key, g.domain, len(g.kept), [t.tid for t in g.live()])
                for g in self._groups.values() if g.status == "open"]

    def stats_dropped(self, reason: str) -> int:
        """Groups given up for ``reason`` so far (O(1); ``stats().groups_dropped`` has all)."""
        return self._counters.groups_dropped.get(reason, 0)

    def drain_restarts(self) -> list[str]:
        """Trajectory ids the buffer created on its own (stale replacements, restore); the
        caller must start each (``group_of`` gives the group). Each id is returned once."""
        out, self._table.restarts = self._table.restarts, []
        return out

    def drain_cancels(self) -> list[str]:
        """Live trajectories of groups the buffer gave up on its own (``max_group_attempts``
        reached, ``core``'s module docstring): the caller aborts each and calls ``cancel`` (a
        member that ended meanwhile makes that a late call). Each id is returned once."""
        out, self._table.cancels = self._table.cancels, []
        return out

    def drain_aborts(self) -> list[str]:
        """With ``abort_stale``: running trajectories that went stale on a version bump (each
        returned once, already in the "restart" state): the caller aborts each generation now
        and calls ``restart_trajectory``, instead of letting it run to its next turn start."""
        out, self._aborts = self._aborts, []
        return out
