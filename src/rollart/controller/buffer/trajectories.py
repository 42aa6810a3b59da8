"""The sample buffer's calls per group and per trajectory: admission, turn starts, tokens,
completion, selection deadline, failure, cancel and restart.

``TrajectoryCalls`` is the layer of ``SampleBuffer`` (``rollart.controller.buffer.core``,
whose module docstring has the rules: verdicts, slots, retries, races) that the trajectory
coroutines call; it asks the policy (``policy.StalenessPolicy``) and has the group table
carry out the result.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rollart.controller.buffer.groups import Traj
from rollart.controller.buffer.policy import StalenessPolicy
from rollart.controller.buffer.records import SampleBufferError, TrajState, TurnVerdict
from rollart.controller.buffer.sample import Sample

__all__ = ["TrajectoryCalls"]


class TrajectoryCalls(StalenessPolicy):
    """Admission (try_start_group) and every call about one trajectory, from its first turn
    to its completion, failure, cancellation or restart."""

    def try_start_group(self, group_key: str, domain: str = "default",
                        alpha: int | None = None) -> list[str] | None:
        """Admit a group of ``group_size + redundancy`` trajectories of task ``domain``; their
        ids, or ``None`` while ``groups_in_flight >= max_groups`` (admission paused).

        ``alpha``: this group's staleness bound (a per-domain bound, >= the buffer's ``alpha``;
        default the buffer's). Its samples are admissible only while every token is at most
        ``alpha`` versions old; the in-flight bound stays the buffer's.

        Raises:
            SampleBufferError: ``group_key`` is already in flight, or ``alpha`` is below the
                buffer's bound.
        """
        if group_key in self._groups:
            raise SampleBufferError(f"group {group_key!r} is already in flight")
        a = self.alpha if alpha is None else alpha
        if not isinstance(a, int) or a < self.alpha:
            raise SampleBufferError(
                f"group {group_key!r}: alpha {alpha!r} must be an int >= the buffer's "
                f"{self.alpha}")
        if not self.has_room():
            return None
        g = self._table.admit(group_key, domain, a, self.group_size + self.redundancy)
        return [t.tid for t in g.slots if t is not None]

    def begin_turn(self, traj_id: str, serving_version: int) -> TurnVerdict:
        """Staleness check at a turn start; ``serving_version`` is the worker's version now.

        Returns a verdict (``core``'s module docstring). Raises ``SampleBufferError`` if
        ``serving_version`` is negative or ahead of the trainer, or the id was never issued.
        """
        t = self._table.live(traj_id)
        if t is None:
            return "cancel"
        if not 0 <= serving_version <= self._version:
            raise SampleBufferError(
                f"trajectory {traj_id!r}: serving_version {serving_version} outside "
                f"[0, trainer version {self._version}]"
            )
        g = t.group
        if not g.wants(t):
            return "cancel"
        if t.state is TrajState.ABORTING:
            return "restart"
        if t.doomed:
            return "drop"
        if not self._areal and (self.check == "per_turn" or t.turns == 0):
            if not self._ok(t):
                if self.on_stale == "restart":
                    t.state = TrajState.ABORTING
                    return "restart"
                t.doomed = True
                return "drop"
            if not self.admissible(serving_version, g.alpha):
                return "wait"
            if (self.fresh_start and t.min_version is None and g.alpha >= 1
                    and not self.admissible(serving_version, g.alpha - 1)):
                return "wait"
        t.turns += 1
        return "continue"

    def record_tokens(self, traj_id: str, versions: Sequence[int]) -> None:
        """Record the versions (ints in ``[0, version]``) of tokens just generated."""
        t = self._table.live(traj_id)
        if t is None:
            return
        if t.state is TrajState.ABORTING:
            raise SampleBufferError(f"trajectory {traj_id!r} was told to restart; no tokens")
        if not versions:
            return
        lo = min(versions)
        if lo < 0 or max(versions) > self._version:
            bad = [v for v in versions if not 0 <= v <= self._version]
            raise SampleBufferError(
                f"trajectory {traj_id!r}: token versions {bad[:3]} outside "
                f"[0, trainer version {self._version}]"
            )
        t.min_version = lo if t.min_version is None else min(t.min_version, lo)
        self._lower_bound(t)
        self._add_tokens(t, len(versions))

    def complete(self, traj_id: str, sample: Sample) -> list[str]:
        """A trajectory finished with a reward. Returns the ids of running siblings the caller
        must cancel (group just reached ``group_size`` kept members), usually ``[]``.

        Raises:
            SampleBufferError: ``sample.sample_id``/``group_key`` do not match, or the
                trajectory was told to restart.
        """
        t = self._table.live(traj_id)
        if t is None:
            return []
        g = t.group
        if sample.sample_id != traj_id or sample.group_key != g.key:
            raise SampleBufferError(
                f"trajectory {traj_id!r} of group {g.key!r}: sample is "
                f"{sample.sample_id!r} of group {sample.group_key!r}"
            )
        if t.state is TrajState.ABORTING:
            raise SampleBufferError(f"trajectory {traj_id!r} was told to restart, not complete")
        sv = sample.min_version
        if sv is not None:
            t.min_version = sv if t.min_version is None else min(t.min_version, sv)
            self._lower_bound(t)
        # A caller that did not report every token through record_tokens: count the rest now.
        self._add_tokens(t, max(0, sample.num_generated - t.num_tokens))
        t.sample, t.state = sample, TrajState.HELD
        c = self._counters
        c.completed += 1
        c.finished_members += 1
        c.finished_len += sample.num_generated
        d = c.domain(g.domain)
        d.finished += 1
        d.finished_tokens += sample.num_generated
        d.finished_turns += sample.num_turns
        if not g.wants(t):  # group complete, retired, or its slot taken over
            self._table.unwanted(t)
            return []
        if t.doomed or not self._ok(t):
            self._table.replace_stale(t)
            return []
        return self._table.hold(t)

    def close_group(self, group_key: str, rng: random.Random | None = None) -> list[str]:
        """Unbiased selection deadline: keep a random ``group_size`` of the finished members
        (if enough) and return the running members to cancel; otherwise keep the next
        finishers. No-op (``[]``) for ``"first"`` or a group already selected / gone."""
        return self._table.close(group_key, rng)

    def fail(self, traj_id: str, reason: str) -> str | None:
        """Per-trajectory failure (counted by ``reason``, never a reward). Returns a retry id
        (same slot, attempt + 1) if attempts remain and the group still collects members."""
        t = self._table.live(traj_id)
        return None if t is None else self._table.fail(t, reason)

    def drop_group(self, group_key: str, reason: str) -> list[str]:
        """Give up on an open group (e.g. its failure budget is spent): retire it, counted in
        ``stats().groups_dropped`` by ``reason``; its held samples are dropped (``"retired"``).
        Returns its live members for the caller to cancel; ``[]`` if it is not open."""
        return self._table.drop_group(group_key, reason)

    def cancel(self, traj_id: str, reason: str | None = None) -> None:
        """The caller aborted a live trajectory (redundancy, shutdown, "cancel" verdict).
        Its slot closes; a group that can no longer fill is retired. No-op if not live.

        ``reason`` names the waste of its tokens (e.g. ``"shutdown"``); ``None`` derives it:
        ``"retired"`` if its group was retired, ``"stale"`` if it was told to restart,
        else ``"redundancy"`` (the group no longer needs it)."""
        t = self._table.live(traj_id)
        if t is not None:
            self._table.cancel(t, reason)

    def restart_trajectory(self, traj_id: str) -> str | None:
        """After a ``"restart"`` verdict: a fresh id in the same slot (same attempt), or
        ``None`` if the group no longer needs it. Raises if no such verdict was given."""
        t = self._table.live(traj_id)
        return None if t is None else self._table.restart(t)

    def _add_tokens(self, t: Traj, n: int) -> None:
        t.num_tokens += n
        self._counters.generated(t.group.domain, n)
