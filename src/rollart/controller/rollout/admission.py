"""The controller's admission of GRPO groups: whether, which domain, and when.

The *admission loop* (:meth:`Admission.loop`) starts a group whenever the sample buffer's
in-flight bound allows (and, in ``sync`` / ``sync_plus`` / ``one_off``, while at most one batch
of groups is in flight), picking domains by weight with its seeded RNG (``run.domain_mix``);
each group gets one env seed shared by its members. ``run.admission = "capacity"`` holds a
group back while every batch it could join is spoken for (``SampleBuffer.has_capacity``),
``"paced"`` while ``rollart.controller.rollout.pacing`` says so; a domain held back keeps its
turn. A group not complete ``run.group_timeout_s`` after its admission is dropped
(``group_timeout``), so a group with a stuck member gives its place to a new one. The training
step closes admission while it applies weights (:meth:`Admission.pause`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from rollart.config import DomainConfig, RunConfig
from rollart.controller.modes import ModeSpec
from rollart.controller.rollout.admitted import AdmittedGroups
from rollart.controller.rollout.tasks import Signal, TrajectoryTasks

if TYPE_CHECKING:
    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.rollout.pacing import Pacer
    from rollart.controller.routing.proxy import LLMProxy

log = logging.getLogger(__name__)
#: a complete group found at its deadline (it waits for the trainer) is checked again after
#: this share of ``run.group_timeout_s``
RECHECK_SHARE = 0.1
#: ``domain_mix = "yield"`` starts a domain at most this many times as often as its weight
#: says: a domain whose groups keep failing (a hung pool, a broken env) would otherwise be
#: started ever more often and starve the healthy ones.
MAX_YIELD_BOOST = 4.0

#: trajectories admitted in one pass of the event loop before admission yields to it
ADMIT_PER_PASS = 32


class Admission:
    """Starts GRPO groups (module docstring) and times them out.

    Args:
        run: the scenario's run settings.
        spec: the mode's switches (``one_batch_in_flight``).
        domains: the scenario's domains by name, in the scenario's order.
        buffer: the sample buffer (its in-flight bound decides whether a group may start).
        proxy: the LLM proxy (``version``: the weights the workers serve).
        tasks: the trajectory tasks, which run the admitted groups' members; admission waits
            on their ``changed`` signal.
        groups: the admitted groups' table, which admission fills.
        weights_changed: notified whenever the workers apply new weights.
        clock: monotonic seconds.
        pacer: paced admission's pacer; ``None``: not paced.
    """

    def __init__(self, run: RunConfig, spec: ModeSpec, domains: Mapping[str, DomainConfig], *,
                 buffer: SampleBuffer, proxy: LLMProxy, tasks: TrajectoryTasks,
                 groups: AdmittedGroups, weights_changed: Signal, clock: Callable[[], float],
                 pacer: Pacer | None = None) -> None:
        self.run, self.spec, self.domains = run, spec, domains
        self.buffer, self.proxy, self.tasks, self.groups = buffer, proxy, tasks, groups
        self.weights_changed, self.clock, self.pacer = weights_changed, clock, pacer
        self._rng = random.Random(run.seed)
        #: per open group, its ``run.group_timeout_s`` timer (:meth:`arm_group_timeout`)
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._open = True
        self._pending_domain: DomainConfig | None = None

    # ------------------------------------------------------------------ state
    def pause(self) -> None:
        """Start no group until :meth:`resume` (the training step applies weights)."""
        self._open = False

    def resume(self) -> None:
        """Start groups again (wakes the loop)."""
        self._open = True
        self.tasks.notify()

    def can_admit(self) -> bool:
        """Whether the mode and the step let a group start now (the buffer's bound aside)."""
        if not self._open or self.tasks.closed:
            return False
        if self.spec.one_batch_in_flight:
            per_batch = self.run.batch_size // self.run.group_size
            return self.buffer.groups_in_flight < per_batch
        return True

    def group_deadline(self, key: str) -> float | None:
        """When (event loop time, s) group ``key``'s timeout fires; ``None``: no timer."""
        timer = self._timers.get(key)
        return timer.when() if timer is not None else None

    def forget(self, key: str) -> None:
        """The buffer forgot group ``key``: its timer goes."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()

    def close(self) -> None:
        """Cancel every group timer (the controller closes)."""
        for timer in self._timers.values():
            timer.cancel()

    def snapshot(self, keys: set[str]) -> dict[str, Any]:
        """The checkpoint's part: the groups ``keys`` (:meth:`AdmittedGroups.snapshot`) and
        the RNG's state (``rng``)."""
        return {**self.groups.snapshot(keys), "rng": list(self._rng.getstate()[1])}

    def restore(self, snap: Mapping[str, Any]) -> None:
        """Continue from a :meth:`snapshot` (same seeds, same RNG stream).

        Raises:
            RollartError: a group of a domain the scenario lacks.
        """
        self.groups.restore(snap["groups"], snap["group_seq"])
        self._rng.setstate((3, tuple(snap["rng"]), None))

    # ------------------------------------------------------------------ group timeout
    def arm_group_timeout(self, key: str, delay_s: float | None = None) -> None:
        """Drop group ``key`` if it is still open and not complete ``delay_s`` from now
        (default ``run.group_timeout_s``; nothing when that is ``None``). The timer goes when
        the buffer forgets the group (:meth:`forget`) or the controller closes."""
        limit = self.run.group_timeout_s
        if limit is None:
            return
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        self._timers[key] = asyncio.get_running_loop().call_later(
            limit if delay_s is None else delay_s, self._group_timed_out, key)

    def _group_timed_out(self, key: str) -> None:
        """``run.group_timeout_s`` passed since group ``key`` was admitted: a group still
        collecting members is given up (``group_timeout``) and its live members cancelled, as
        are the stragglers of a consumed or retired one; a complete one only waits for the
        trainer and is checked again later."""
        self._timers.pop(key, None)
        if self.tasks.closed or self.tasks.stopping or key not in self.groups:
            return
        limit = self.run.group_timeout_s
        assert limit is not None
        if self.buffer.group_complete(key):
            self.arm_group_timeout(key, limit * RECHECK_SHARE)
            return
        if self.buffer.group_status(key) == "open":
            live = self.buffer.drop_group(key, "group_timeout")
            log.warning("group %s dropped: not complete %g s after its admission "
                        "(run.group_timeout_s); %d live member(s) cancelled", key, limit,
                        len(live))
        else:
            # Consumed or retired, but a member that never reached its next turn start (where
            # it would learn so) still holds the group's place in the in-flight bound.
            live = self.buffer.live_members(key)
        for tid in live:
            self.tasks.cancel(tid)
        self.tasks.notify()

    # ------------------------------------------------------------------ which domain, when
    def domain_weights(self) -> list[float]:
        """``Controller.domain_weights`` (its docstring has the formula)."""
        domains = list(self.domains.values())
        if self.run.domain_mix == "weight":
            return [d.weight for d in domains]
        counts = self.buffer.domain_counts()
        in_flight = self.buffer.groups_in_flight_by_domain()
        g = self.run.group_size
        out = []
        for d in domains:
            dc = counts.get(d.name)
            trained, groups = (dc.trained, dc.groups_started) if dc is not None else (0, 0)
            resolved = max(0, groups - in_flight.get(d.name, 0))
            boost = (g * resolved + g) / (trained + g)
            out.append(d.weight * min(boost, MAX_YIELD_BOOST))
        return out

    def _pick_domain(self) -> DomainConfig:
        domains = list(self.domains.values())
        return self._rng.choices(domains, weights=self.domain_weights())[0]

    def _pace_wait_s(self, domain: DomainConfig) -> float:
        """Paced admission: seconds to hold ``domain``'s next group back (0: start now)."""
        if self.pacer is None:
            return 0.0
        now = self.clock()
        alpha = domain.alpha if domain.alpha is not None else self.run.alpha
        if not self.pacer.should_wait(domain.name, now, self.proxy.version, alpha):
            return 0.0
        period = self.pacer.period_s() or 0.0
        return max(1e-3, period)

    async def loop(self) -> None:
        """The admission loop (runs until cancelled)."""
        changed, buffer = self.tasks.changed, self.buffer
        for key in self.groups:  # restored from a checkpoint: their time starts now
            if key not in self._timers:
                self.arm_group_timeout(key)
        this_pass = 0
        while True:
            started = False
            if self.can_admit() and buffer.has_room():
                key = self.groups.next_key
                # A held-back domain keeps its turn (else pacing would favour short domains).
                domain = self._pending_domain or self._pick_domain()
                self._pending_domain = None
                if self.run.admission == "capacity" and not buffer.has_capacity(
                        self.proxy.version, domain.alpha):
                    # Every batch this group could join is already spoken for: wait for a
                    # batch, an apply or a group that fails or goes stale.
                    self._pending_domain = domain
                    this_pass = 0
                    await changed.wait()
                    continue
                wait_s = self._pace_wait_s(domain)
                if wait_s > 0:
                    self._pending_domain = domain
                    # Until the next apply (or one period, if it does not come).
                    this_pass = 0
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.weights_changed.wait(), wait_s)
                    continue
                ids = buffer.try_start_group(key, domain.name, domain.alpha)
                if ids is not None:
                    self.groups.add(key, domain, self._rng.randrange(2**31))
                    self.arm_group_timeout(key)
                    for tid in ids:
                        self.tasks.launch(tid, key)
                    started = True
                    this_pass += len(ids)
            if not started:
                this_pass = 0
                await changed.wait()
            elif this_pass >= ADMIT_PER_PASS and (self.tasks.ctx is None
                                                  or self.tasks.ctx.barrier is None):
                # A training step frees room for a whole batch of groups at once; admitting
                # them in one pass (each member's first step runs in the next) held every
                # reply waiting behind it for tens of ms at 10k trajectories: ~32
                # trajectories per pass, a few ms. Not under sync mode's turn barrier, whose
                # batch must join it together (a group alone would take its turns alone).
                this_pass = 0
                await asyncio.sleep(0)
