"""Liveness and safety of the staleness protocol under every mode and every buffer policy.

``test_staleness_protocol``'s state machine (slow members that go stale one after another,
stuck members, failures, cancellations, checkpoint/restore, group time limits) driven with the
buffer *as the controller builds it for a mode* (``rollart.controller.modes.MODES``: where the
staleness check sits, ``check``; rollart's bound or AReaL's policy, ``staleness_control``) and
with the mode's admission and weight-apply rules played by the machine:

- ``one_batch_in_flight`` (sync, sync_plus, one_off): no group starts while a batch's worth of
  groups is in flight (``Admission.can_admit``), and never more are;
- no overlap (sync, sync_plus): generation is paused while the trainer trains, so a batch is
  trained and its weights applied before any other turn (the machine advances the version at
  once after a batch);
- ``weight_apply = "at_batch"``: workers take new weights only at the pause of a batch (no
  eager, staggered apply); ``"eager"`` (overlap modes only): any worker at any time.

Per mode, hypothesis draws every ``RunConfig`` policy field that changes the buffer's
behaviour, within what ``rollart.config.validate`` accepts for that mode: alpha (0 for the
on-policy modes, 1 for one_off, 1..2 for areal and rollart), a per-domain larger bound (areal
and rollart), ``on_stale`` restart / drop, ``abort_stale`` (restart, per-turn-check modes),
``fresh_start`` (eager, overlap modes), ``admission = "capacity"`` (``has_capacity``),
``weight_apply``, ``selection``, ``redundancy``, ``max_group_attempts``, ``retry.max_attempts``,
``hold_batch_for_groups`` (rollart).

Checked on top of the base machine's invariants (safety: no sample trained twice or lost,
whole groups, every token accounted for, rollart's bound on every trained token except under
AReaL's policy, which trains stale samples by design; progress: no group past
``max_group_attempts`` or its time limit, one record per running or held trajectory within
the in-flight bound, a batch whenever the running work is driven to completion, stuck members
around): under ``one_batch_in_flight`` at most one batch's worth of groups is ever in flight.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from test_staleness_protocol import StalenessProtocol, picks

from rollart.controller.modes import MODES


@st.composite
def mode_configs(draw: st.DrawFn) -> dict:
    mode = draw(st.sampled_from(sorted(MODES)))
    spec = MODES[mode]
    if mode in ("sync", "sync_plus"):
        alpha = 0
    elif mode == "one_off":
        alpha = 1
    else:
        alpha = draw(st.integers(1, 2))
    on_stale = draw(st.sampled_from(["restart", "drop"]))
    weight_apply = draw(st.sampled_from(["at_batch", "eager"])) if spec.overlap else "at_batch"
    per_turn_modes = ("sync", "sync_plus", "rollart")
    return {
        "mode": mode,
        "alpha": alpha,
        "group_size": draw(st.integers(1, 3)),
        "groups_per_batch": draw(st.integers(1, 2)),
        "redundancy": draw(st.integers(0, 2)),
        "selection": draw(st.sampled_from(["first", "unbiased"])),
        "check": spec.check,
        "staleness_control": spec.staleness_control,
        "on_stale": on_stale,
        "max_attempts": draw(st.integers(1, 3)),
        "long_extra_alpha": draw(st.integers(0, 2)) if mode in ("areal", "rollart") else 0,
        "fresh_start": weight_apply == "eager" and draw(st.booleans()),
        "abort_stale": (on_stale == "restart" and mode in per_turn_modes
                        and draw(st.booleans())),
        "capacity": draw(st.booleans()),
        "weight_apply": weight_apply,
        "max_group_attempts": draw(st.sampled_from([1, 2, 4, 8])),
        "hold": mode == "rollart" and draw(st.booleans()),
    }


class ModeLiveness(StalenessProtocol):
    @initialize(cfg=mode_configs(), seed=st.integers(0, 2**16))
    def setup(self, cfg: dict, seed: int) -> None:
        StalenessProtocol.setup(self, cfg, seed)
        self.spec = MODES[cfg["mode"]]
        self.areal = self.spec.staleness_control == "areal"
        self.per_batch = cfg["groups_per_batch"]
        self.defer_advance = False
        event(f"mode {cfg['mode']} {cfg['weight_apply']}")

    # ------------------------------------------------------------------ the mode's rules
    def _start_group(self, long: bool = False) -> bool:
        if self.spec.one_batch_in_flight and self.buf.groups_in_flight >= self.per_batch:
            return False  # Admission.can_admit
        return StalenessProtocol._start_group(self, long)

    def _take(self, release: bool = False) -> bool:
        if not StalenessProtocol._take(self, release):
            return False
        if self.cfg["weight_apply"] == "at_batch":
            # The pause of this batch applies the trainer's newest weights on every worker.
            self.workers = [self.buf.version] * len(self.workers)
        if not self.spec.overlap and not self.defer_advance:
            # Generation stays paused while the trainer trains and its weights are applied.
            self.buf.advance_version()
            self._drain()
            self.workers = [self.buf.version] * len(self.workers)
        return True

    @precondition(lambda self: self.live - self.stuck)
    @rule(i=picks)
    def lag_one(self, i: int) -> None:
        """The base rule, which trains each batch it takes at once (no turn in between)."""
        self.defer_advance = True
        try:
            StalenessProtocol.lag_one(self, i)
        finally:
            self.defer_advance = False

    @precondition(lambda self: self.cfg["weight_apply"] == "eager")
    @rule(w=st.integers(0, 1))
    def apply_on_worker(self, w: int) -> None:
        """Eager, staggered apply (``weight_apply = "eager"`` only)."""
        self.workers[w] = self.buf.version

    @precondition(lambda self: self.live - self.stuck)
    @rule(i=picks, w=st.integers(0, 1), ntok=st.integers(1, 4), newer=st.integers(0, 4))
    def turn_on_worker(self, i: int, w: int, ntok: int, newer: int) -> None:
        """A turn on worker ``w``; an apply lands mid-turn only if applies are eager."""
        if self.cfg["weight_apply"] != "eager":
            newer = 0
        StalenessProtocol.turn_on_worker(self, i, w, ntok, newer)

    # ------------------------------------------------------------------ AReaL's policy
    def _check_trained(self, tid: str, version: int) -> None:
        if not self.areal:  # AReaL trains stale samples by design
            StalenessProtocol._check_trained(self, tid, version)

    def _check_held(self, tid: str) -> None:
        if not self.areal:  # AReaL keeps held samples whatever their staleness
            StalenessProtocol._check_held(self, tid)

    def _check_refusal(self) -> None:
        if self.areal:
            assert not self.buf.has_room()  # AReaL's capacity is its only reason to refuse
        else:
            StalenessProtocol._check_refusal(self)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def mode_bounds(self) -> None:
        """One batch's worth of groups at most where the mode says so; AReaL never gives a
        staleness verdict, so nothing of it is wasted as stale."""
        if self.spec.one_batch_in_flight:
            assert self.buf.groups_in_flight <= self.per_batch
        if self.areal:
            assert self.buf.stats().wasted_tokens.get("stale", 0) == 0
        if not self.spec.overlap:
            assert not self.buf.batch_outstanding


ModeLiveness.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestModeLiveness = ModeLiveness.TestCase
