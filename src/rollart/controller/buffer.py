"""Staleness-bounded sample buffer and version protocol: a pure state machine.

No I/O, no asyncio, no clocks: the asyncio controller drives it, and the hypothesis property
tests (``tests/unit/test_staleness_protocol.py``) exercise this very class.

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
    training, so a consumed batch frees no room until its update is applied). ``C - running``
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

import enum
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from rollart.controller.sample import BufferStats, DomainCounts, Sample
from rollart.transport.errors import ConfigError, RollartError

__all__ = ["BatchPlan", "BufferStats", "DomainCounts", "ReadyGroup", "Sample", "SampleBuffer",
           "SampleBufferError", "TurnVerdict"]

TurnVerdict = Literal["continue", "restart", "drop", "wait", "cancel"]
_SNAPSHOT_FORMAT = 1


class SampleBufferError(RollartError, RuntimeError):
    """The buffer protocol was misused (unknown id, wrong call order); names the id and rule."""


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


class _S(enum.Enum):
    RUNNING = "running"
    ABORTING = "aborting"  # told "restart", awaiting restart_trajectory / cancel
    HELD = "held"  # completed, sample kept or awaiting selection
    DONE = "done"  # any terminal state


_LIVE = (_S.RUNNING, _S.ABORTING)


@dataclass(slots=True, eq=False)
class _Traj:
    tid: str
    group: _Group
    slot: int
    attempt: int
    state: _S = _S.RUNNING
    min_version: int | None = None
    num_tokens: int = 0
    turns: int = 0
    doomed: bool = False
    sample: Sample | None = None


@dataclass(slots=True, eq=False)
class _Group:
    key: str
    seq: int
    slots: list[_Traj | None]  # None: slot closed for good
    kept: list[_Traj] = field(default_factory=list)
    finished: list[_Traj] = field(default_factory=list)  # unbiased candidates
    selected: bool = False
    closing: bool = False
    status: Literal["open", "consumed", "retired"] = "open"
    all_tids: list[str] = field(default_factory=list)
    domain: str = "default"
    alpha: int = 0

    def live(self) -> list[_Traj]:
        return [t for t in self.slots if t is not None and t.state in _LIVE]


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
        initial_version: int = 0,
        rng: random.Random | None = None,
        on_drop: Callable[[str, str], None] | None = None,
        on_forget: Callable[[str], None] | None = None,
        fresh_start: bool = False,
        abort_stale: bool = False,
        staleness_control: Literal["bound", "areal"] = "bound",
    ) -> None:
        for name, val, lo in (
            ("alpha", alpha, 0),
            ("batch_size", batch_size, 1),
            ("group_size", group_size, 1),
            ("redundancy", redundancy, 0),
            ("max_attempts", max_attempts, 1),
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
        #: groups admitted and not retired (AReaL's ``accepted + running``, in groups)
        self._admitted_groups = 0
        self._aborts: list[str] = []
        # A lower bound of ``min_version + group alpha`` over every trajectory of an open group
        # (None: no bound, sweep). While it is >= the version no trajectory is stale, so
        # ``_sweep_stale`` has nothing to do and is skipped: take_batch runs once per kept
        # sample, and a full sweep there made every completion O(trajectories).
        self._fresh_bound: int | None = None
        # Groups that reached group_size kept members (a superset of the complete ones: a
        # group only becomes complete in _keep or restore), so finding complete groups costs
        # O(candidates), not O(groups in flight), per take_batch.
        self._ready: dict[str, _Group] = {}
        self.max_groups = (alpha + 1) * batch_size // group_size
        self._version = initial_version
        self._outstanding = False
        self._rng = rng if rng is not None else random.Random(0)
        self._on_drop = on_drop
        self._on_forget = on_forget
        self._groups: dict[str, _Group] = {}
        self._trajs: dict[str, _Traj] = {}
        self._next_seq = 0
        self._group_seq = 0
        self._restarts: list[str] = []
        self._c: dict[str, int] = dict.fromkeys(
            (
                "started",
                "completed",
                "consumed",
                "batches",
                "retries",
                "restarted_stale",
                "replaced_stale",
                "cancelled",
                "groups_retired",
                "late_calls",
                "finished_members",
                "finished_len",
                "kept_members",
                "kept_len",
                "cancelled_len",
            ),
            0,
        )
        self._failed: dict[str, int] = {}
        self._groups_dropped: dict[str, int] = {}
        self._dropped: dict[str, int] = {}
        self._wasted: dict[str, int] = {}
        self._generated = 0
        self._trained_tokens = 0
        #: members of the outstanding batch: tid -> (tokens counted as trained, generated
        #: tokens, turns, domain), for ``drop_consumed``
        self._batch_members: dict[str, tuple[int, int, int, str]] = {}
        self._domains: dict[str, DomainCounts] = {}
        self._last_staleness: list[int] = []

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
    def groups_in_flight(self) -> int:
        """Groups admitted and not yet forgotten (O(1); also in ``stats()``)."""
        return len(self._groups)

    @property
    def num_kept(self) -> int:
        """Samples kept into a group so far (cumulative; O(1)). A ``take_batch`` that found no
        batch finds none again until this grows or the version advances."""
        return self._c["kept_members"]

    def admissible(self, min_version: int | None, alpha: int | None = None) -> bool:
        """Whether tokens whose oldest version is ``min_version`` may train at this version,
        under bound ``alpha`` (default the buffer's; a group's own with ``_ok``)."""
        a = self.alpha if alpha is None else alpha
        return min_version is None or min_version >= self._version - a

    def _ok(self, t: _Traj) -> bool:
        # AReaL's policy never rejects a sample for staleness once admitted.
        return self._areal or self.admissible(t.min_version, t.group.alpha)

    def group_of(self, traj_id: str) -> str:
        """Group key of a live or held trajectory. Raises ``SampleBufferError`` otherwise."""
        return self._get(traj_id, allow_forgotten=False).group.key

    def held_sample_ids(self) -> set[str]:
        """Ids of completed samples still held (kept or awaiting selection), not consumed."""
        return {t.tid for g in self._groups.values() for t in (*g.kept, *g.finished)}

    def running_ids(self) -> list[str]:
        """Ids of live trajectories (running, or told to restart), in creation order."""
        return [t.tid for t in self._trajs.values() if t.state in _LIVE]

    def ready_samples(self) -> int:
        """Samples in complete, unconsumed groups (all admissible after the last sweep)."""
        return self.group_size * sum(1 for g in self._ready.values() if self._complete(g))

    def drain_aborts(self) -> list[str]:
        """With ``abort_stale``: running trajectories that went stale on a version bump (each
        returned once, already in the "restart" state): the caller aborts each generation now
        and calls ``restart_trajectory``, instead of letting it run to its next turn start."""
        out, self._aborts = self._aborts, []
        return out

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

    def has_room(self) -> bool:
        """Whether ``try_start_group`` would admit a group now: ``groups_in_flight <
        max_groups``, or with ``staleness_control="areal"`` AReaL's capacity (module
        docstring)."""
        if self._areal:
            cap = (self.alpha + self._version + 1) * (self.batch_size // self.group_size)
            return self._admitted_groups < cap
        return len(self._groups) < self.max_groups

    def domain_counts(self) -> dict[str, DomainCounts]:
        """Live per-domain counters (read-only view; ``stats().domains`` is a copy)."""
        return self._domains

    def groups_in_flight_by_domain(self) -> dict[str, int]:
        """Groups in flight (admitted, not yet consumed or retired, or with live members) per
        domain."""
        out: dict[str, int] = {}
        for g in self._groups.values():
            out[g.domain] = out.get(g.domain, 0) + 1
        return out

    def drain_restarts(self) -> list[str]:
        """Trajectory ids the buffer created on its own (stale replacements, restore); the
        caller must start each (``group_of`` gives the group). Each id is returned once."""
        out, self._restarts = self._restarts, []
        return out

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
        self._admitted_groups += 1
        g = _Group(key=group_key, seq=self._group_seq, slots=[], domain=domain, alpha=a)
        self._dom(domain).groups_started += 1
        self._group_seq += 1
        self._groups[group_key] = g
        for i in range(self.group_size + self.redundancy):
            g.slots.append(None)
            self._new_traj(g, i, attempt=1)
        return [t.tid for t in g.slots if t is not None]

    # ------------------------------------------------------------------ per trajectory
    def begin_turn(self, traj_id: str, serving_version: int) -> TurnVerdict:
        """Staleness check at a turn start; ``serving_version`` is the worker's version now.

        Returns a verdict (module docstring). Raises ``SampleBufferError`` if
        ``serving_version`` is negative or ahead of the trainer, or the id was never issued.
        """
        t = self._get(traj_id)
        if t is None or t.state not in _LIVE:
            self._c["late_calls"] += 1
            return "cancel"
        if not 0 <= serving_version <= self._version:
            raise SampleBufferError(
                f"trajectory {traj_id!r}: serving_version {serving_version} outside "
                f"[0, trainer version {self._version}]"
            )
        if not self._slot_open(t):
            return "cancel"
        if t.state is _S.ABORTING:
            return "restart"
        if t.doomed:
            return "drop"
        if not self._areal and (self.check == "per_turn" or t.turns == 0):
            if not self._ok(t):
                if self.on_stale == "restart":
                    t.state = _S.ABORTING
                    return "restart"
                t.doomed = True
                return "drop"
            if not self.admissible(serving_version, t.group.alpha):
                return "wait"
            if (self.fresh_start and t.min_version is None and t.group.alpha >= 1
                    and not self.admissible(serving_version, t.group.alpha - 1)):
                return "wait"
        t.turns += 1
        return "continue"

    def record_tokens(self, traj_id: str, versions: Sequence[int]) -> None:
        """Record the versions (ints in ``[0, version]``) of tokens just generated."""
        t = self._get(traj_id)
        if t is None or t.state not in _LIVE:
            self._c["late_calls"] += 1
            return
        if t.state is _S.ABORTING:
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
        t = self._get(traj_id)
        if t is None or t.state not in _LIVE:
            self._c["late_calls"] += 1
            return []
        g = t.group
        if sample.sample_id != traj_id or sample.group_key != g.key:
            raise SampleBufferError(
                f"trajectory {traj_id!r} of group {g.key!r}: sample is "
                f"{sample.sample_id!r} of group {sample.group_key!r}"
            )
        if t.state is _S.ABORTING:
            raise SampleBufferError(f"trajectory {traj_id!r} was told to restart, not complete")
        sv = sample.min_version
        if sv is not None:
            t.min_version = sv if t.min_version is None else min(t.min_version, sv)
            self._lower_bound(t)
        # A caller that did not report every token through record_tokens: count the rest now.
        self._add_tokens(t, max(0, sample.num_generated - t.num_tokens))
        t.sample, t.state = sample, _S.HELD
        self._c["completed"] += 1
        self._c["finished_members"] += 1
        self._c["finished_len"] += sample.num_generated
        d = self._dom(g.domain)
        d.finished += 1
        d.finished_tokens += sample.num_generated
        d.finished_turns += sample.num_turns
        if not self._slot_open(t):
            self._drop(t, "retired" if g.status == "retired" else "unselected")
            self._maybe_forget(g)
            return []
        if t.doomed or not self._ok(t):
            self._replace_stale(t)
            return []
        if self.selection == "unbiased" and not g.selected:
            g.finished.append(t)
            return self._maybe_select(g, None)
        self._keep(t)
        return self._cancel_surplus(g) if len(g.kept) == self.group_size else []

    def close_group(self, group_key: str, rng: random.Random | None = None) -> list[str]:
        """Unbiased selection deadline: keep a random ``group_size`` of the finished members
        (if enough) and return the running members to cancel; otherwise keep the next
        finishers. No-op (``[]``) for ``"first"`` or a group already selected / gone."""
        g = self._groups.get(group_key)
        if g is None or g.status != "open" or g.selected or self.selection != "unbiased":
            return []
        g.closing = True
        return self._maybe_select(g, rng)

    def fail(self, traj_id: str, reason: str) -> str | None:
        """Per-trajectory failure (counted by ``reason``, never a reward). Returns a retry id
        (same slot, attempt + 1) if attempts remain and the group still collects members."""
        t = self._get(traj_id)
        if t is None or t.state not in _LIVE:
            self._c["late_calls"] += 1
            return None
        if not reason:
            raise SampleBufferError(f"trajectory {traj_id!r}: fail() needs a reason")
        self._failed[reason] = self._failed.get(reason, 0) + 1
        self._finish(t, "failed")
        g = t.group
        if self._slot_open(t) and t.attempt < self.max_attempts:
            self._c["retries"] += 1
            return self._new_traj(g, t.slot, t.attempt + 1).tid
        was_open = g.status == "open" and t.attempt >= self.max_attempts
        self._close_slot(t)
        if was_open and g.status == "retired":
            # A slot ran out of attempts and the group can no longer fill: given up, by reason.
            self._groups_dropped["attempts_exhausted"] = (
                self._groups_dropped.get("attempts_exhausted", 0) + 1)
        return None

    def drop_group(self, group_key: str, reason: str) -> list[str]:
        """Give up on an open group (e.g. its failure budget is spent): retire it, counted in
        ``stats().groups_dropped`` by ``reason``; its held samples are dropped (``"retired"``).
        Returns its live members for the caller to cancel; ``[]`` if it is not open."""
        g = self._groups.get(group_key)
        if g is None or g.status != "open":
            return []
        if not reason:
            raise SampleBufferError(f"group {group_key!r}: drop_group() needs a reason")
        self._groups_dropped[reason] = self._groups_dropped.get(reason, 0) + 1
        self._retire(g)
        live = [t.tid for t in g.live()]
        self._maybe_forget(g)
        return live

    def stats_dropped(self, reason: str) -> int:
        """Groups given up for ``reason`` so far (O(1); ``stats().groups_dropped`` has all)."""
        return self._groups_dropped.get(reason, 0)

    def open_groups(self) -> list[tuple[str, str, int, list[str]]]:
        """``(key, domain, kept members, live member ids)`` of every group still collecting,
        oldest first (what a batch waits on)."""
        return [(g.key, g.domain, len(g.kept), [t.tid for t in g.live()])
                for g in self._groups.values() if g.status == "open"]

    def cancel(self, traj_id: str, reason: str | None = None) -> None:
        """The caller aborted a live trajectory (redundancy, shutdown, "cancel" verdict).
        Its slot closes; a group that can no longer fill is retired. No-op if not live.

        ``reason`` names the waste of its tokens (e.g. ``"shutdown"``); ``None`` derives it:
        ``"retired"`` if its group was retired, ``"stale"`` if it was told to restart,
        else ``"redundancy"`` (the group no longer needs it)."""
        t = self._get(traj_id)
        if t is None or t.state not in _LIVE:
            self._c["late_calls"] += 1
            return
        if reason is None:
            reason = ("retired" if t.group.status == "retired"
                      else "stale" if t.state is _S.ABORTING or t.doomed else "redundancy")
        self._c["cancelled"] += 1
        self._c["cancelled_len"] += t.num_tokens
        self._finish(t, reason)
        self._close_slot(t)

    def restart_trajectory(self, traj_id: str) -> str | None:
        """After a ``"restart"`` verdict: a fresh id in the same slot (same attempt), or
        ``None`` if the group no longer needs it. Raises if no such verdict was given."""
        t = self._get(traj_id)
        if t is None or t.state not in _LIVE:
            self._c["late_calls"] += 1
            return None
        if t.state is not _S.ABORTING:
            raise SampleBufferError(f"trajectory {traj_id!r} was not told to restart")
        self._c["restarted_stale"] += 1
        self._finish(t, "stale")
        if self._slot_open(t):
            return self._new_traj(t.group, t.slot, t.attempt).tid
        self._close_slot(t)
        return None

    # ------------------------------------------------------------------ trainer side
    def take_batch(self) -> list[Sample] | None:
        """Exactly ``batch_size`` samples of whole complete groups, each re-checked admissible
        at ``version``, chosen by :meth:`assemble_batch` (default: oldest groups first); marks
        them consumed. ``None`` if not enough (or the policy takes none yet).

        Raises:
            SampleBufferError: a batch is already outstanding for this version, or
                ``assemble_batch`` returned a plan breaking its protocol.
        """
        if self._outstanding:
            raise SampleBufferError(
                f"a batch for version {self._version} is outstanding; call advance_version()"
            )
        self._batch_members.clear()
        self._sweep_stale()
        need = self.batch_size // self.group_size
        default_policy = type(self).assemble_batch is SampleBuffer.assemble_batch
        if default_policy and len(self._ready) < need:
            # The default policy takes nothing below ``need`` complete groups and discards
            # nothing: skip the scan (O(ready groups) per kept sample otherwise). A group
            # that stopped being complete stays listed until the next scan drops it.
            return None
        ready = [g for g in self._ready.values() if self._complete(g)]
        if len(ready) != len(self._ready):
            self._ready = {g.key: g for g in ready}
        if default_policy and len(ready) < need:
            return None
        chosen = self._plan(ready, need)
        if chosen is None:
            return None
        out: list[Sample] = []
        self._last_staleness = []
        for g in chosen:
            d = self._dom(g.domain)
            for t in g.kept:
                if not self._ok(t):  # unreachable after the sweep
                    raise SampleBufferError(f"internal: stale sample {t.tid!r} in a batch")
                assert t.sample is not None
                out.append(t.sample)
                self._last_staleness.append(self._version - self._mv(t))
                self._trained_tokens += t.num_tokens
                self._batch_members[t.tid] = (t.num_tokens, t.sample.num_generated,
                                              t.sample.num_turns, g.domain)
                d.trained += 1
                d.trained_tokens += t.sample.num_generated
                d.trained_turns += t.sample.num_turns
                t.state, t.sample = _S.DONE, None
            g.kept, g.status = [], "consumed"
            self._maybe_forget(g)
        self._c["consumed"] += len(out)
        self._c["batches"] += 1
        self._outstanding = True
        return out

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

    def _plan(self, ready: list[_Group], need: int) -> list[_Group] | None:
        """Ask ``assemble_batch``, check its plan, discard what it discards; the groups to
        train on, or ``None``."""
        if not ready:
            return None
        views = [ReadyGroup(g.key, g.domain, g.seq, min(self._mv(t) for t in g.kept),
                            tuple(t.sample.reward for t in g.kept if t.sample is not None),
                            sum(t.sample.num_generated for t in g.kept if t.sample is not None))
                 for g in ready]
        plan = self.assemble_batch(views, need)
        by_key = {g.key: g for g in ready}
        take = list(plan.take)
        if take and (len(take) != need or len(set(take)) != need
                     or not set(take) <= by_key.keys()):
            raise SampleBufferError(
                f"assemble_batch: take must be () or {need} distinct ready group keys, got "
                f"{take!r} (ready: {sorted(by_key)})")
        for key, reason in plan.discard.items():
            if key not in by_key or key in take or not isinstance(reason, str) or not reason:
                raise SampleBufferError(
                    f"assemble_batch: discard {key!r}: {reason!r} must name a ready group not "
                    f"taken, with a non-empty reason (ready: {sorted(by_key)})")
        for key, reason in plan.discard.items():
            self._discard(by_key[key], reason)
        return [by_key[k] for k in take] if take else None
    def drop_consumed(self, sample_id: str, reason: str) -> None:
        """A sample of the outstanding batch that cannot be trained on after all (the train
        path's last check refused it): it counts as dropped and its tokens as wasted for
        ``reason`` instead of consumed and trained (per domain too), so the token accounting
        still adds up. Its slot is not refilled (its group was consumed).

        Raises:
            SampleBufferError: ``sample_id`` is not in the outstanding batch (or was dropped).
        """
        entry = self._batch_members.pop(sample_id, None) if self._outstanding else None
        if entry is None:
            raise SampleBufferError(f"drop_consumed: {sample_id!r} is not in the outstanding "
                                    "batch")
        num_tokens, num_generated, num_turns, domain = entry
        d = self._dom(domain)
        self._trained_tokens -= num_tokens
        d.trained -= 1
        d.trained_tokens -= num_generated
        d.trained_turns -= num_turns
        self._c["consumed"] -= 1
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
        if num_tokens:
            self._wasted[reason] = self._wasted.get(reason, 0) + num_tokens
            d.wasted_tokens[reason] = d.wasted_tokens.get(reason, 0) + num_tokens

    def advance_version(self) -> None:
        """The trainer applied the update of the outstanding batch: ``version += 1``; held
        samples that became stale are dropped and replaced (``drain_restarts``)."""
        if not self._outstanding:
            raise SampleBufferError(
                f"advance_version at version {self._version} without a batch taken"
            )
        self._outstanding = False
        self._version += 1
        self._sweep_stale()

    # ------------------------------------------------------------------ stats / checkpoint
    def stats(self) -> BufferStats:
        """Counters and gauges (see ``BufferStats``)."""
        c = self._c
        # One pass, no list per group: at 10k trajectories this runs on the loop every step.
        running = held = in_flight_tokens = 0
        for g in self._groups.values():
            for t in g.slots:
                if t is not None and t.state in _LIVE:
                    running += 1
                    in_flight_tokens += t.num_tokens
            for t in g.kept:
                in_flight_tokens += t.num_tokens
            for t in g.finished:
                in_flight_tokens += t.num_tokens
            held += len(g.kept) + len(g.finished)
        st = self._last_staleness
        return BufferStats(
            version=self._version,
            alpha=self.alpha,
            batch_size=self.batch_size,
            group_size=self.group_size,
            redundancy=self.redundancy,
            max_groups=self.max_groups,
            groups_in_flight=len(self._groups),
            running=running,
            held=held,
            in_flight=running + held,
            in_flight_bound=(self.alpha + 1) * self.batch_size
            + self.redundancy * len(self._groups),
            ready_samples=self.ready_samples(),
            started=c["started"],
            completed=c["completed"],
            consumed=c["consumed"],
            batches=c["batches"],
            retries=c["retries"],
            failed=dict(self._failed),
            restarted_stale=c["restarted_stale"],
            replaced_stale=c["replaced_stale"],
            dropped=dict(self._dropped),
            cancelled=c["cancelled"],
            groups_retired=c["groups_retired"],
            groups_dropped=dict(self._groups_dropped),
            wasted_tokens=dict(self._wasted),
            late_calls=c["late_calls"],
            finished_members=c["finished_members"],
            finished_mean_len=c["finished_len"] / max(c["finished_members"], 1),
            kept_members=c["kept_members"],
            kept_mean_len=c["kept_len"] / max(c["kept_members"], 1),
            cancelled_mean_len=c["cancelled_len"] / max(c["cancelled"], 1),
            last_batch_max_staleness=max(st, default=0),
            last_batch_mean_staleness=sum(st) / len(st) if st else 0.0,
            generated_tokens=self._generated,
            trained_tokens=self._trained_tokens,
            in_flight_tokens=in_flight_tokens,
            domains={k: msgspec.structs.replace(v, wasted_tokens=dict(v.wasted_tokens))
                     for k, v in sorted(self._domains.items())},
        )

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for checkpoint/resume: config, version, every in-flight group's held
        samples and which slots were running (those are restarted on restore). A batch
        outstanding at snapshot time is not included (it was handed to the trainer)."""
        groups = []
        for g in sorted(self._groups.values(), key=lambda g: g.seq):
            if g.status != "open":
                continue
            groups.append(
                {
                    "key": g.key,
                    "domain": g.domain,
                    "alpha": g.alpha,
                    "selected": g.selected,
                    "closing": g.closing,
                    "slots": [
                        None
                        if t is None or not self._slot_open(t)
                        else {
                            "attempt": t.attempt,
                            "state": "held" if t.state is _S.HELD else "running",
                            "kept": t in g.kept,
                            "min_version": t.min_version,
                            "sample": msgspec.to_builtins(t.sample)
                            if t.sample is not None
                            else None,
                        }
                        for t in g.slots
                    ],
                }
            )
        cfg = {
            k: getattr(self, k)
            for k in (
                "alpha",
                "batch_size",
                "group_size",
                "redundancy",
                "selection",
                "check",
                "on_stale",
                "max_attempts",
                "fresh_start",
                "abort_stale",
                "staleness_control",
            )
        }
        return {
            "format": _SNAPSHOT_FORMAT,
            "config": cfg,
            "version": self._version,
            "next_seq": self._next_seq,
            "groups": groups,
        }

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
        if snap.get("format") != _SNAPSHOT_FORMAT:
            raise ConfigError(
                f"SampleBuffer.restore: unknown snapshot format {snap.get('format')!r}"
            )
        buf = cls(**snap["config"], initial_version=snap["version"], rng=rng, on_drop=on_drop,
                  on_forget=on_forget)
        buf._next_seq = snap["next_seq"]
        # Every version's batch was admitted before it was trained; the open groups come back.
        buf._admitted_groups = (buf._version * (buf.batch_size // buf.group_size)
                                + len(snap["groups"]))
        for gs in snap["groups"]:
            g = _Group(
                key=gs["key"],
                seq=buf._group_seq,
                slots=[None] * len(gs["slots"]),
                selected=gs["selected"],
                closing=gs["closing"],
                domain=gs.get("domain", "default"),
                alpha=gs.get("alpha", buf.alpha),
            )
            buf._group_seq += 1
            buf._groups[g.key] = g
            for i, ss in enumerate(gs["slots"]):
                if ss is None:
                    continue
                if ss["state"] == "running":
                    buf._restarts.append(buf._new_traj(g, i, ss["attempt"]).tid)
                    continue
                t = buf._new_traj(g, i, ss["attempt"], tid=ss["sample"]["sample_id"])
                t.sample = msgspec.convert(ss["sample"], Sample)
                t.state, t.min_version = _S.HELD, ss["min_version"]
                (g.kept if ss["kept"] else g.finished).append(t)
            if len(g.kept) == buf.group_size:
                buf._ready[g.key] = g
        buf._fresh_bound = None
        buf._sweep_stale()
        return buf

    # ------------------------------------------------------------------ internals
    def _get(self, tid: str, allow_forgotten: bool = True) -> _Traj | None:
        t = self._trajs.get(tid)
        if t is not None:
            return t
        _, _, seq = tid.rpartition("/")
        if allow_forgotten and seq.isdigit() and int(seq) < self._next_seq:
            return None
        raise SampleBufferError(f"unknown trajectory id {tid!r}")

    def _new_traj(self, g: _Group, slot: int, attempt: int, tid: str | None = None) -> _Traj:
        if tid is None:
            tid = f"{g.key}/{self._next_seq}"
            self._next_seq += 1
        t = _Traj(tid=tid, group=g, slot=slot, attempt=attempt)
        g.slots[slot] = t
        g.all_tids.append(tid)
        self._trajs[tid] = t
        self._c["started"] += 1
        self._dom(g.domain).started += 1
        return t

    def _mv(self, t: _Traj) -> int:
        return self._version if t.min_version is None else t.min_version

    def _complete(self, g: _Group) -> bool:
        return g.status == "open" and len(g.kept) == self.group_size

    def _slot_open(self, t: _Traj) -> bool:
        """Whether the group still wants this trajectory's slot filled."""
        g = t.group
        if g.status != "open" or g.slots[t.slot] is not t:
            return False
        return t in g.kept or len(g.kept) < self.group_size

    def _dom(self, domain: str) -> DomainCounts:
        d = self._domains.get(domain)
        if d is None:
            d = self._domains[domain] = DomainCounts()
        return d

    def _add_tokens(self, t: _Traj, n: int) -> None:
        t.num_tokens += n
        self._generated += n
        self._dom(t.group.domain).generated_tokens += n

    def _finish(self, t: _Traj, reason: str) -> None:
        """Terminal state, not trained: every token ``t`` generated is wasted for ``reason``
        (exactly once: a trajectory reaches DONE once)."""
        t.state = _S.DONE
        if t.num_tokens:
            self._wasted[reason] = self._wasted.get(reason, 0) + t.num_tokens
            w = self._dom(t.group.domain).wasted_tokens
            w[reason] = w.get(reason, 0) + t.num_tokens

    def _drop(self, t: _Traj, reason: str) -> None:
        """Discard a completed sample (counted, reported to ``on_drop``)."""
        g = t.group
        for lst in (g.kept, g.finished):
            if t in lst:
                lst.remove(t)
        t.sample = None
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
        self._finish(t, reason)
        if self._on_drop is not None:
            self._on_drop(t.tid, reason)

    def _keep(self, t: _Traj) -> None:
        g = t.group
        g.kept.append(t)
        if len(g.kept) == self.group_size:
            self._ready[g.key] = g
        assert t.sample is not None
        self._c["kept_members"] += 1
        self._c["kept_len"] += t.sample.num_generated

    def _replace_stale(self, t: _Traj) -> None:
        """A completed sample can never be admitted: drop it, refill its slot."""
        self._drop(t, "stale")
        self._c["replaced_stale"] += 1
        self._restarts.append(self._new_traj(t.group, t.slot, t.attempt).tid)

    def _lower_bound(self, t: _Traj) -> None:
        """``t.min_version`` was just lowered: keep ``_fresh_bound`` a lower bound."""
        if self._fresh_bound is not None and t.min_version is not None:
            self._fresh_bound = min(self._fresh_bound, t.min_version + t.group.alpha)

    def _sweep_stale(self) -> None:
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
            for t in [*g.kept, *g.finished]:
                if not self._ok(t):
                    self._replace_stale(t)
            for t in [*g.kept, *g.finished, *g.live()]:
                if abort and t.state is _S.RUNNING and not self._ok(t) and self._slot_open(t):
                    t.state = _S.ABORTING
                    self._aborts.append(t.tid)
                if t.min_version is not None:
                    b = t.min_version + g.alpha
                    bound = b if bound is None or b < bound else bound
        # No trajectory with a version at all: any later one lowers the bound from here.
        self._fresh_bound = self._version if bound is None else bound

    def _close_slot(self, t: _Traj) -> None:
        g = t.group
        if g.slots[t.slot] is t:
            g.slots[t.slot] = None
        if g.status == "open" and not self._complete(g):
            potential = len(g.kept) + len(g.finished) + len(g.live())
            if potential < self.group_size:
                self._retire(g)
            elif self.selection == "unbiased" and not g.selected:
                # Selection only fires here with no member left running, so nothing to cancel.
                self._maybe_select(g, None)
        self._maybe_forget(g)

    def _discard(self, g: _Group, reason: str) -> None:
        """A complete group the batch policy throws away: its samples are wasted for
        ``reason``; counted in ``groups_dropped`` as the caller's ``drop_group`` is."""
        self._groups_dropped[reason] = self._groups_dropped.get(reason, 0) + 1
        self._ready.pop(g.key, None)
        g.status = "retired"
        self._admitted_groups -= 1
        self._c["groups_retired"] += 1
        for t in list(g.kept):
            self._drop(t, reason)
        self._maybe_forget(g)

    def _retire(self, g: _Group) -> None:
        g.status = "retired"
        self._admitted_groups -= 1  # AReaL: a rejected rollout is not "accepted"
        self._c["groups_retired"] += 1
        for t in [*g.kept, *g.finished]:
            self._drop(t, "retired")

    def _maybe_select(self, g: _Group, rng: random.Random | None) -> list[str]:
        """Unbiased selection once the deadline passed or no member is left running."""
        live = [t for t in g.live() if self._slot_open(t)]
        if len(g.finished) < self.group_size or not (g.closing or not live):
            return []
        chosen = set((rng or self._rng).sample(g.finished, self.group_size))
        finished, g.finished, g.selected = g.finished, [], True
        for t in finished:  # kept in completion order, so batches are reproducible
            if t in chosen:
                self._keep(t)
            else:
                self._drop(t, "unselected")
        return self._cancel_surplus(g)

    def _cancel_surplus(self, g: _Group) -> list[str]:
        """Group complete: close every other slot; its live members are for the caller to
        cancel (they stay counted in flight until ``cancel``)."""
        return [t.tid for t in g.live() if t not in g.kept]

    def _maybe_forget(self, g: _Group) -> None:
        if g.status != "open" and not g.live() and self._groups.get(g.key) is g:
            del self._groups[g.key]
            for tid in g.all_tids:
                self._trajs.pop(tid, None)
            if self._on_forget is not None:
                self._on_forget(g.key)
