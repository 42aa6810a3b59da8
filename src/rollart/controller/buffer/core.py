"""Staleness-bounded sample buffer and version protocol: a pure state machine.

No I/O, no asyncio, no clocks: the asyncio controller drives it, and the hypothesis property
tests (``tests/unit/test_staleness_protocol.py``) exercise this very class.

``SampleBuffer`` here is the public API, the version protocol and the policy: which samples
are admissible, the sweep of stale ones, admission room and batch assembly, each readable in
this class. It delegates to parts that own their state: ``groups.GroupTable`` (the groups in
flight and a record per running or held trajectory: slots, selection, retries, retirement;
``groups.Group`` answers what one group wants), ``batch.BatchAssembler`` (a plan put into
effect, the outstanding batch), ``stats.BufferCounters`` (every counter and ``stats()``) and
``snapshot`` (the checkpoint format).

Versions
    The trainer's version ``v`` (property ``version``) is the number of weight updates applied.
    ``take_batch()`` returns the batch that produces ``v + 1``; then the trainer trains and the
    controller calls ``advance_version()``. The two strictly alternate (a second batch before
    ``advance_version`` raises ``SampleBufferError``), so every batch is checked against the
    version it really trains at.

Admissibility (RollArt section 6.2, bound alpha)
    A sample may go into the batch taken at version ``v`` only if every generated token's version
    is ``>= v - alpha``. ``v`` only grows, so a sample that fails this once never passes again.
    It is checked (1) at every turn start in ``begin_turn`` (``check="per_turn"``; with
    ``check="admission"``, the AReaL policy, only at the first turn), (2) when a trajectory
    completes, (3) on every ``advance_version`` for all held samples (and, with
    ``abort_stale``, running ones: ``drain_aborts``), and (4) again on every sample at batch
    assembly in ``take_batch``. A stale held sample is dropped (counted,
    ``on_drop(id, "stale")``) and its slot gets a fresh trajectory (``drain_restarts``).

begin_turn verdicts, in order of precedence
    ``"cancel"``: the trajectory is no longer needed (group complete, retired or consumed, or the
    id is finished/forgotten): abort it and call ``cancel``. ``"restart"``: an already generated
    token is older than ``v - alpha`` and ``on_stale="restart"``: abort, then
    ``restart_trajectory`` gives a fresh id in the same slot (staleness does not use up retry
    attempts). ``"drop"``: the same but ``on_stale="drop"``: keep going; the sample will be
    dropped when it completes and only then replaced (so the group never exceeds its slots).
    ``"wait"``: the worker serves a version older than ``v - alpha`` (alpha = 0 with a lagging
    worker), or, with ``fresh_start``, the trajectory has no token yet and the worker serves a
    version older than ``v - alpha + 1`` (its first token would already be at the bound, so
    it could only join the very next batch): do not generate; call ``begin_turn`` again once
    the worker has the new weights. ``fresh_start`` needs weights that reach the workers
    without waiting for a batch (eager apply), else the wait could block the batch it awaits.
    ``"continue"``: generate.

Groups, slots and redundancy
    ``try_start_group`` creates ``group_size + redundancy`` slots, one trajectory each. A slot
    holds at most one live-or-held trajectory; retries, restarts and stale replacements reuse the
    slot. Selection ``"first"`` keeps the first ``group_size`` completions and returns the still
    running members for the caller to cancel. ``"unbiased"`` collects finishers until the caller's
    deadline (``close_group``) or until none is left running, then keeps a uniformly random
    ``group_size`` of them (the buffer's ``rng`` unless one is passed); after a deadline with too
    few finishers, the next finishers are kept. Finished-but-unkept members are dropped
    (``"unselected"``). Failed or cancelled members never enter a group's kept samples.

Failures
    ``fail(id, reason)`` counts the failure by reason (never a reward of 0). If the slot's attempt
    is ``< max_attempts`` and the group still collects members, a retry id (attempt + 1) is
    returned; a group that can no longer fill because a slot ran out of attempts counts in
    ``stats().groups_dropped["attempts_exhausted"]`` (``drop_group`` adds the caller's reasons). A group that can no longer reach ``group_size`` (held + live members fall short)
    is retired: its held samples are dropped (``"retired"``), its live members get ``"cancel"``.

In-flight bound and liveness
    A group is in flight from admission until it is consumed or retired *and* has no live
    member. ``try_start_group`` returns ``None`` (admission paused) while
    ``groups_in_flight >= max_groups = (alpha + 1) * batch_size // group_size``. As a group never
    has more than ``group_size + redundancy`` live-or-held trajectories, at all times
    ``running + held <= (alpha + 1) * batch_size + redundancy * groups_in_flight``.
    Liveness: stale held samples are replaced, never left occupying a slot; groups that cannot
    fill are retired; consumed/retired groups leave as soon as their stragglers are cancelled.
    Replacing is not enough on its own: a group whose members finish out of phase (one was
    slow once) can see each held member go stale before the last one finishes, and be refilled
    forever. So a group may start at most ``max_group_attempts * (group_size + redundancy)``
    trajectories (first attempts, retries, staleness restarts and replacements together); the
    one that would exceed it gives the group up instead (``stats().groups_dropped
    ["group_attempts"]``, its held samples dropped as ``"retired"``, its live members listed
    by ``drain_cancels`` for the caller to cancel), and admission starts a new group in its
    place. The buffer keeps a record per running or held trajectory only (a finished one's
    goes at once): its records number ``stats().in_flight``, within the bound above. A wall-clock bound per
    group is the caller's (the buffer has no clock): ``drop_group`` gives a group up.
    So if the caller runs every trajectory it is given to completion at the current version,
    ``max_groups >= batch_size / group_size`` groups fill with admissible samples and
    ``take_batch`` succeeds (with the default batch assembly; a subclass's
    ``assemble_batch`` that neither takes nor discards ready groups gives this up).
    ``has_capacity(serving_version)`` is a stricter, optional admission test (version-aware):
    a group whose first tokens would be of ``serving_version`` can only join the batches at
    versions ``next .. serving_version + alpha``; it is admitted only while fewer groups that
    are still admissible at the next batch are in flight than those batches hold.

Waste and selection accounting
    Every generated token (``record_tokens``, or a completed sample's ``num_generated``) ends in
    exactly one of: trained (``take_batch``), wasted under one reason, or still in flight
    (running or held). Reasons: ``"stale"`` (restarted, or a held/completed sample dropped as
    stale), ``"redundancy"`` (a member the group no longer needs, cancelled), ``"failed"``,
    ``"unselected"``, ``"retired"`` (its group could no longer fill), the caller's reason
    for ``cancel`` (``"shutdown"``), or the batch policy's reason for a group it discards
    (``assemble_batch``). So ``generated_tokens == trained_tokens + sum(wasted_tokens)
    + in_flight_tokens`` at all times (property-tested). The same is kept per task domain, with
    trajectories started / finished / trained and their turns and generated tokens, so the
    selection bias (trained vs finished) is visible per domain.

AReaL's policy (``staleness_control="areal"``; mode ``areal`` only)
    The bound above is rollart's. AReaL (Fu et al. 2025, arXiv 2505.24298, §5; its rollout
    capacity check) enforces staleness only through its admission capacity
    ``min(C - running, (eta + v + 1) * B - (accepted + running))``: nothing checks a sample at
    a turn, at completion or at batch assembly, so a trajectory that outlives versions (slow,
    or interrupted and re-prefilled) is trained however stale it finished. With
    ``"areal"`` this buffer does the same: no ``"restart"`` / ``"drop"`` / ``"wait"``
    verdicts, no stale drop at completion, on a version bump or in ``take_batch``, and
    admission while ``admitted - retired < (alpha + v + 1) * batch_size / group_size`` groups
    (the formula in groups, AReaL's unit of a rollout: ``accepted + running`` counts every
    group admitted and not rejected, and ``v`` only grows at ``advance_version``, i.e. after
    training, so a consumed batch frees no room until its update is applied), and while
    ``groups_in_flight < max_groups`` as in every policy (a retired group leaves AReaL's count
    at once but stays in flight until its live members are cancelled). ``C - running``
    (the engines' concurrency) is left to the workers' own queues. The staleness really
    trained at is in ``stats().last_batch_max_staleness``.

Per-group bound
    ``try_start_group(..., alpha=a)`` gives a group its own bound ``a >= alpha`` (a per-domain
    alpha for long-horizon tasks): its samples obey ``a`` everywhere above; the in-flight bound
    and ``max_groups`` stay those of the buffer's ``alpha``.

Races
    Calls on a trajectory that already finished, was cancelled, or whose group was forgotten are
    no-ops with a neutral result (counted as ``late_calls``); never-issued ids raise
    ``SampleBufferError``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any, Literal

from rollart.controller.buffer import snapshot as buffersnapshot
from rollart.controller.buffer.batch import BatchAssembler, BatchPlan, ReadyGroup
from rollart.controller.buffer.groups import GroupTable, Traj
from rollart.controller.buffer.records import LIVE, SampleBufferError, TrajState, TurnVerdict
from rollart.controller.buffer.sample import BufferStats, DomainCounts, Sample
from rollart.controller.buffer.stats import BufferCounters
from rollart.transport.errors import ConfigError

__all__ = ["BatchPlan", "BufferStats", "DomainCounts", "ReadyGroup", "Sample", "SampleBuffer",
           "SampleBufferError", "TurnVerdict"]


class SampleBuffer:
    """Staleness-bounded buffer of GRPO groups; see the module docstring for every rule.

    Args:
        alpha: staleness bound in versions (>= 0; 0 = on-policy).
        batch_size: samples per ``take_batch`` (> 0, a multiple of ``group_size``).
        group_size: kept members per group (> 0).
        redundancy: extra members started per group (>= 0).
        selection: ``"first"`` or ``"unbiased"``.
        check: ``"per_turn"`` (rollart) or ``"admission"`` (AReaL: first turn only).
        on_stale: ``"restart"`` (abort now) or ``"drop"`` (finish, then drop).
        max_attempts: attempts per slot for failures (>= 1).
        max_group_attempts: trajectories one group may start, per slot (>= 1; ``None``: no
            limit): past it the group is given up, ``"group_attempts"`` (module docstring).
        initial_version: trainer version at start (>= 0).
        rng: for unbiased selection when ``close_group`` gets none (default ``Random(0)``).
        on_drop: called ``(traj_id, reason)`` whenever a completed sample is discarded.
        on_forget: called ``(group_key)`` when a group leaves (consumed or retired, no member
            live); the buffer keeps nothing of it after that.
        fresh_start: a trajectory's first token needs one version of headroom (``"wait"``
            otherwise; module docstring). Needs weights applied independently of batches.
        staleness_control: ``"bound"`` (alpha bounds every trained sample) or ``"areal"``
            (alpha only enters AReaL's admission capacity; stale samples are kept; module
            docstring).
        hold_for_groups: ``take_batch`` holds a batch while an open, incomplete group would
            go stale at the next version (:meth:`holds_batch`), so the trainer waits for it
            instead of the rollout throwing it away; the caller bounds the wait
            (``take_batch(hold=False)``). For the per-turn check with ``"bound"`` control.
            Not in :meth:`snapshot` (it changes no state): :meth:`restore` leaves it off.

    Raises:
        ConfigError: any argument out of range, naming it.
    """

    def __init__(
        self,
        *,
        alpha: int,
        batch_size: int,
        group_size: int,
        redundancy: int = 0,
        selection: Literal["first", "unbiased"] = "first",
        check: Literal["per_turn", "admission"] = "per_turn",
        on_stale: Literal["restart", "drop"] = "restart",
        max_attempts: int = 3,
        max_group_attempts: int | None = None,
        initial_version: int = 0,
        rng: random.Random | None = None,
        on_drop: Callable[[str, str], None] | None = None,
        on_forget: Callable[[str], None] | None = None,
        fresh_start: bool = False,
        abort_stale: bool = False,
        staleness_control: Literal["bound", "areal"] = "bound",
        hold_for_groups: bool = False,
    ) -> None:
        for name, val, lo in (
            ("alpha", alpha, 0),
            ("batch_size", batch_size, 1),
            ("group_size", group_size, 1),
            ("redundancy", redundancy, 0),
            ("max_attempts", max_attempts, 1),
            ("max_group_attempts", 1 if max_group_attempts is None else max_group_attempts, 1),
            ("initial_version", initial_version, 0),
        ):
            if not isinstance(val, int) or isinstance(val, bool):
                raise ConfigError(f"SampleBuffer: {name} must be an int, got {val!r}")
            if val < lo:
                raise ConfigError(f"SampleBuffer: {name} must be >= {lo}, got {val}")
        if batch_size % group_size:
            raise ConfigError(
                f"SampleBuffer: batch_size {batch_size} is not a multiple of group_size "
                f"{group_size} (take_batch returns whole groups)"
            )
        for name, val, allowed in (
            ("selection", selection, ("first", "unbiased")),
            ("check", check, ("per_turn", "admission")),
            ("on_stale", on_stale, ("restart", "drop")),
            ("staleness_control", staleness_control, ("bound", "areal")),
        ):
            if val not in allowed:
                raise ConfigError(f"SampleBuffer: {name} must be one of {allowed}, got {val!r}")
        self.alpha, self.batch_size, self.group_size = alpha, batch_size, group_size
        self.redundancy, self.selection, self.check = redundancy, selection, check
        self.on_stale, self.max_attempts = on_stale, max_attempts
        self.fresh_start = bool(fresh_start)
        self.abort_stale = bool(abort_stale)
        self.staleness_control = staleness_control
        self._areal = staleness_control == "areal"
        if hold_for_groups and (check != "per_turn" or staleness_control != "bound"):
            raise ConfigError(
                "SampleBuffer: hold_for_groups needs check 'per_turn' and staleness_control "
                f"'bound' (got {check!r}, {staleness_control!r}): nothing else goes stale "
                "at a version bump")
        self.hold_for_groups = bool(hold_for_groups)
        #: the last ``take_batch`` found a batch but held it (``hold_for_groups``)
        self.holding = False
        self.max_groups = self.groups_bound(alpha, batch_size, group_size)
        self._version = initial_version
        #: a batch was taken at this version; its update is not applied yet
        self._outstanding = False
        #: running trajectories that went stale on a version bump (``abort_stale``)
        self._aborts: list[str] = []
        # A lower bound of ``min_version + group alpha`` over every trajectory of an open group
        # (None: no bound, sweep). While it is >= the version no trajectory is stale, so
        # ``_sweep`` has nothing to do and is skipped: take_batch runs once per kept sample,
        # and a full sweep there made every completion O(trajectories).
        self._fresh_bound: int | None = None
        self._counters = BufferCounters()
        self._table = GroupTable(
            self._counters, group_size=group_size, selection=selection,
            max_attempts=max_attempts, max_group_attempts=max_group_attempts,
            rng=rng if rng is not None else random.Random(0), on_drop=on_drop,
            on_forget=on_forget)
        self._batch = BatchAssembler(self._table, self._counters, batch_size // group_size)
        # The table's groups in flight and trajectory records (never rebound), by short names.
        self._groups, self._trajs = self._table.groups, self._table.trajs

    # ------------------------------------------------------------------ properties / queries
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
        reached, module docstring): the caller aborts each and calls ``cancel`` (a member
        that ended meanwhile makes that a late call). Each id is returned once."""
        out, self._table.cancels = self._table.cancels, []
        return out

    def drain_aborts(self) -> list[str]:
        """With ``abort_stale``: running trajectories that went stale on a version bump (each
        returned once, already in the "restart" state): the caller aborts each generation now
        and calls ``restart_trajectory``, instead of letting it run to its next turn start."""
        out, self._aborts = self._aborts, []
        return out

    # ------------------------------------------------------------------ policy
    # Staleness (admissible, _ok, _sweep), admission room (has_room, has_capacity) and batch
    # assembly (assemble_batch, batch_order; take_batch below puts a plan into effect).
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

    @staticmethod
    def groups_bound(alpha: int, batch_size: int, group_size: int) -> int:
        """``max_groups``: groups in flight the buffer admits, ``(alpha + 1) * batch_size //
        group_size`` (each of ``group_size + redundancy`` trajectories)."""
        return (alpha + 1) * batch_size // group_size

    def has_room(self) -> bool:
        """Whether ``try_start_group`` would admit a group now: ``groups_in_flight <
        max_groups``, and with ``staleness_control="areal"`` also AReaL's capacity (module
        docstring)."""
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
        ``need`` by :meth:`batch_order`; nothing discarded. Override it in a subclass to
        assemble batches otherwise (filter, balance domains, ...). A group neither taken nor
        discarded stays ready until it is taken or goes stale, holding its place in the
        in-flight bound: a policy that never takes nor discards a group can stall the run.

        Returns:
            a :class:`BatchPlan`; ``take_batch`` raises SampleBufferError if its ``take`` is
            neither empty nor exactly ``need`` distinct ready keys, or ``discard`` names a key
            that is not ready, is also taken, or has an empty reason.
        """
        if len(ready) < need:
            return BatchPlan()
        order = sorted(ready, key=lambda g: self.batch_order(g.domain, g.min_version, g.seq))
        return BatchPlan(take=[g.key for g in order[:need]])

    def batch_order(self, domain: str, min_version: int, seq: int) -> Any:
        """Sort key of a complete group (smallest first) for the default
        :meth:`assemble_batch`; ``min_version`` is the oldest generated-token version of its
        kept samples, ``seq`` its admission order. Default: oldest tokens first, then oldest
        group (fewest samples go stale). Override it to reorder batches without filtering."""
        return (min_version, seq)

    # ------------------------------------------------------------------ admission
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

    # ------------------------------------------------------------------ per trajectory
    def begin_turn(self, traj_id: str, serving_version: int) -> TurnVerdict:
        """Staleness check at a turn start; ``serving_version`` is the worker's version now.

        Returns a verdict (module docstring). Raises ``SampleBufferError`` if
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

    # ------------------------------------------------------------------ trainer side
    def take_batch(self, *, hold: bool = True) -> list[Sample] | None:
        """Exactly ``batch_size`` samples of whole complete groups, each re-checked admissible
        at ``version``, chosen by :meth:`assemble_batch` (default: oldest groups first); marks
        them consumed. ``None`` if not enough (or the policy takes none yet), or, with
        ``hold_for_groups`` and ``hold``, while :meth:`holds_batch` (then ``holding`` is true
        until a later call takes a batch or finds none; what the policy discards is discarded
        all the same). ``hold=False``: the caller's bound on the wait has passed; the batch
        goes ahead and the group it waited for goes stale at the next version as without it.

        Raises:
            SampleBufferError: a batch is already outstanding for this version, or
                ``assemble_batch`` returned a plan breaking its protocol.
        """
        if self._outstanding:
            raise SampleBufferError(
                f"a batch for version {self._version} is outstanding; call advance_version()"
            )
        self._batch.members.clear()
        self._sweep()
        default_policy = type(self).assemble_batch is SampleBuffer.assemble_batch
        held: list[bool] = []

        def holding_policy(ready: Sequence[ReadyGroup], need: int) -> BatchPlan:
            plan = self.assemble_batch(ready, need)
            if plan.take and self.holds_batch({g.key for g in ready}):
                held.append(True)
                return BatchPlan(discard=plan.discard)
            return plan

        policy = holding_policy if self.hold_for_groups and hold else self.assemble_batch
        chosen = self._batch.choose(policy, self._version, default_policy)
        self.holding = bool(held)
        if chosen is None:
            return None
        out = self._batch.consume(chosen, self._version, self._ok)
        self._outstanding = True
        return out

    def holds_batch(self, ready: set[str]) -> bool:
        """Whether a batch taken now would make an open group that is not among the ``ready``
        keys stale: one of its trajectories (kept, finished or running) has a token of a
        version below ``version + 1 - alpha`` (its group's alpha), so once the batch's update
        is applied it can no longer be trained on and its tokens are wasted. A group with no
        token yet is never waited for (it loses nothing)."""
        nxt = self._version + 1
        for g in self._groups.values():
            if g.status != "open" or g.key in ready:
                continue
            versions = [t.min_version for t in (*g.kept, *g.finished, *g.live())
                        if t.min_version is not None]
            if versions and min(versions) < nxt - g.alpha:
                return True
        return False

    def drop_consumed(self, sample_id: str, reason: str) -> None:
        """A sample of the outstanding batch that cannot be trained on after all (the train
        path's last check refused it): it counts as dropped and its tokens as wasted for
        ``reason`` instead of consumed and trained (per domain too), so the token accounting
        still adds up. Its slot is not refilled (its group was consumed).

        Raises:
            SampleBufferError: ``sample_id`` is not in the outstanding batch (or was dropped).
        """
        self._batch.drop_consumed(sample_id, reason, self._outstanding)

    def advance_version(self) -> None:
        """The trainer applied the update of the outstanding batch: ``version += 1``; held
        samples that became stale are dropped and replaced (``drain_restarts``)."""
        if not self._outstanding:
            raise SampleBufferError(
                f"advance_version at version {self._version} without a batch taken"
            )
        self._outstanding = False
        self._version += 1
        self._sweep()

    # ------------------------------------------------------------------ stats / checkpoint
    def stats(self) -> BufferStats:
        """Counters and gauges (see ``BufferStats``)."""
        return self._counters.stats(
            version=self._version, alpha=self.alpha, batch_size=self.batch_size,
            group_size=self.group_size, redundancy=self.redundancy, max_groups=self.max_groups,
            groups=self._groups.values(), ready_samples=self.ready_samples())

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for checkpoint/resume: config, version, every in-flight group's held
        samples and which slots were running (those are restarted on restore). A batch
        outstanding at snapshot time is not included (it was handed to the trainer)."""
        config = {k: getattr(self, k) for k in buffersnapshot.CONFIG_KEYS}
        return buffersnapshot.snapshot(config, self._version, self._table)

    @classmethod
    def restore(
        cls,
        snap: dict[str, Any],
        *,
        rng: random.Random | None = None,
        on_drop: Callable[[str, str], None] | None = None,
        on_forget: Callable[[str], None] | None = None,
    ) -> SampleBuffer:
        """Rebuild from ``snapshot()``: held samples come back (then re-checked for staleness);
        each slot that was running gets a fresh trajectory id, listed by ``drain_restarts()``.
        Counters restart from zero. Raises ``ConfigError`` on an unknown snapshot format."""
        buffersnapshot.check_format(snap)
        buf = cls(**snap["config"], initial_version=snap["version"], rng=rng, on_drop=on_drop,
                  on_forget=on_forget)
        buffersnapshot.restore_groups(
            snap, buf._table, buf._counters, version=buf._version,
            groups_per_batch=buf.batch_size // buf.group_size, alpha=buf.alpha)
        buf._fresh_bound = None
        buf._sweep()
        return buf

    # ------------------------------------------------------------------ internals
    def _add_tokens(self, t: Traj, n: int) -> None:
        t.num_tokens += n
        self._counters.generated(t.group.domain, n)

    def _lower_bound(self, t: Traj) -> None:
        """``t.min_version`` was just lowered: keep ``_fresh_bound`` a lower bound."""
        if self._fresh_bound is not None and t.min_version is not None:
            self._fresh_bound = min(self._fresh_bound, t.min_version + t.group.alpha)
