"""Staleness-bounded sample buffer and version protocol: a pure state machine.

No I/O, no asyncio, no clocks: the asyncio controller drives it, and the hypothesis property
tests (``tests/unit/test_staleness_protocol.py``) exercise this very class.

``SampleBuffer`` here is the public API and the version protocol (its configuration,
``take_batch`` / ``advance_version``, stats and checkpoint), built in layers, one
responsibility each: ``queries.BufferQueries`` (the buffer's state and read-only queries),
``policy.StalenessPolicy`` (which samples are admissible, the sweep of stale ones, admission
room and batch assembly) and ``trajectories.TrajectoryCalls`` (admission and the calls per
trajectory). It delegates to parts that own their state: ``groups.GroupTable`` (the groups in
flight and a record per running or held trajectory: slots, selection, retries, retirement;
``groups.Group`` answers what one group wants), ``batch.BatchAssembler`` (a plan put into
effect, the outstanding batch), ``stats.BufferCounters`` (every counter and ``stats()``) and
``snapshot`` (the checkpoint format). "The module docstring" in any of them means this one.

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
    ``on_drop(id, "stale")``) and its slot gets a fresh trajectory (``drain_restarts``); with
    ``readmit_stale_groups``, a complete group that went stale as a whole is dropped instead
    (``groups_dropped["stale"]``) and admission starts its replacement.

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
from rollart.controller.buffer.groups import GroupTable
from rollart.controller.buffer.records import SampleBufferError, TurnVerdict
from rollart.controller.buffer.sample import BufferStats, DomainCounts, Sample
from rollart.controller.buffer.stats import BufferCounters
from rollart.controller.buffer.trajectories import TrajectoryCalls
from rollart.transport.errors import ConfigError

__all__ = ["BatchPlan", "BufferStats", "DomainCounts", "ReadyGroup", "Sample", "SampleBuffer",
           "SampleBufferError", "TurnVerdict"]


class SampleBuffer(TrajectoryCalls):
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
            go stale at the next version, or would find no place in the next batch, its last
            (:meth:`holds_batch`), so the trainer waits for it
            instead of the rollout throwing it away; the caller bounds the wait
            (``take_batch(hold=False)``). For the per-turn check with ``"bound"`` control.
            Not in :meth:`snapshot` (it changes no state): :meth:`restore` leaves it off.
        readmit_stale_groups: a complete group whose every sample went stale before a batch
            took it (no member running) is dropped (``groups_dropped`` ``"stale"``, its samples
            wasted as ``"stale"``) instead of refilled in place, so its replacement goes
            through admission like any new group (with ``run.admission = "capacity"``, the
            version-aware check a refill would bypass). Not in :meth:`snapshot`, like
            ``hold_for_groups``.

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
        readmit_stale_groups: bool = False,
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
        self.readmit_stale_groups = bool(readmit_stale_groups)
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

    # ------------------------------------------------------------------ trainer side
    def take_batch(self, *, hold: bool = True) -> list[Sample] | None:
        """Exactly ``batch_size`` samples of whole complete groups, each re-checked admissible
        at ``version``, chosen by :meth:`assemble_batch` (default: last chance first); marks
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
            if plan.take and self.holds_batch({g.key for g in ready}, plan.take):
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
