"""The controller's admission of GRPO groups: whether, which domain, and when.

The *admission loop* starts a group whenever the sample buffer's in-flight bound allows (and,
in ``sync`` / ``sync_plus`` / ``one_off``, while at most one batch of groups is in flight),
picking domains by weight with the controller's seeded RNG (``run.domain_mix``); each group
gets one env seed shared by its members. ``run.admission = "capacity"`` holds a group back
while every batch it could join is spoken for (``SampleBuffer.has_capacity``), ``"paced"``
while ``rollart.controller.rollout.pacing`` says so; a domain held back keeps its turn. A group not
complete ``run.group_timeout_s`` after its admission is dropped (``group_timeout``), so a
group with a stuck member gives its place to a new one. Plain
functions over the :class:`~rollart.controller.controller.Controller`'s state (it owns the
RNG, the group table and the wake-up signals).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from rollart.config import DomainConfig
from rollart.controller.rollout.tasks import cancel_traj, launch

if TYPE_CHECKING:
    from rollart.controller.controller import Controller

log = logging.getLogger("rollart.controller.controller")
#: a complete group found at its deadline (it waits for the trainer) is checked again after
#: this share of ``run.group_timeout_s``
RECHECK_SHARE = 0.1


def arm_group_timeout(c: Controller, key: str, delay_s: float | None = None) -> None:
    """Drop group ``key`` if it is still open and not complete ``delay_s`` from now (default
    ``run.group_timeout_s``; nothing when that is ``None``). The timer goes when the buffer
    forgets the group (``Controller._forget_group``) or the controller closes."""
    limit = c.run.group_timeout_s
    if limit is None:
        return
    old = c._group_timers.pop(key, None)
    if old is not None:
        old.cancel()
    c._group_timers[key] = asyncio.get_running_loop().call_later(
        limit if delay_s is None else delay_s, group_timed_out, c, key)


def group_timed_out(c: Controller, key: str) -> None:
    """``run.group_timeout_s`` passed since group ``key`` was admitted: a group still
    collecting members is given up (``group_timeout``) and its live members cancelled, as are
    the stragglers of a consumed or retired one; a complete one only waits for the trainer and
    is checked again later."""
    c._group_timers.pop(key, None)
    if c._closed or c._stopping or key not in c._groups:
        return
    limit = c.run.group_timeout_s
    assert limit is not None
    if c.buffer.group_complete(key):
        arm_group_timeout(c, key, limit * RECHECK_SHARE)
        return
    if c.buffer.group_status(key) == "open":
        live = c.buffer.drop_group(key, "group_timeout")
        log.warning("group %s dropped: not complete %g s after its admission "
                    "(run.group_timeout_s); %d live member(s) cancelled", key, limit, len(live))
    else:
        # Consumed or retired, but a member that never reached its next turn start (where it
        # would learn so) still holds the group's place in the in-flight bound.
        live = c.buffer.live_members(key)
    for tid in live:
        cancel_traj(c, tid)
    c._notify()


def can_admit(c: Controller) -> bool:
    if not c._admission_open or c._closed:
        return False
    if c.spec.one_batch_in_flight:
        per_batch = c.run.batch_size // c.run.group_size
        return c.buffer.groups_in_flight < per_batch
    return True


def domain_weights(c: Controller) -> list[float]:
    """``Controller.domain_weights`` (its docstring has the formula)."""
    domains = list(c.domains.values())
    if c.run.domain_mix == "weight":
        return [d.weight for d in domains]
    counts = c.buffer.domain_counts()
    in_flight = c.buffer.groups_in_flight_by_domain()
    g = c.run.group_size
    out = []
    for d in domains:
        dc = counts.get(d.name)
        trained, groups = (dc.trained, dc.groups_started) if dc is not None else (0, 0)
        resolved = max(0, groups - in_flight.get(d.name, 0))
        out.append(d.weight * (g * resolved + g) / (trained + g))
    return out


def pick_domain(c: Controller) -> DomainConfig:
    domains = list(c.domains.values())
    return c._rng.choices(domains, weights=c.domain_weights())[0]


def pace_wait_s(c: Controller, domain: DomainConfig) -> float:
    """Paced admission: seconds to hold ``domain``'s next group back (0: start now)."""
    if c._pacer is None:
        return 0.0
    now = c.clock()
    alpha = domain.alpha if domain.alpha is not None else c.run.alpha
    if not c._pacer.should_wait(domain.name, now, c.proxy.version, alpha):
        return 0.0
    period = c._pacer.period_s() or 0.0
    return max(1e-3, period)


#: trajectories admitted in one pass of the event loop before admission yields to it
ADMIT_PER_PASS = 32


async def admission_loop(c: Controller) -> None:
    assert c._changed is not None and c._weights_changed is not None
    for key in c._groups:  # restored from a checkpoint: their time starts now
        if key not in c._group_timers:
            arm_group_timeout(c, key)
    this_pass = 0
    while True:
        started = False
        if can_admit(c) and c.buffer.has_room():
            key = f"g{c._group_seq}"
            # A held-back domain keeps its turn (else pacing would favour short domains).
            domain = c._pending_domain or pick_domain(c)
            c._pending_domain = None
            if c.run.admission == "capacity" and not c.buffer.has_capacity(
                    c.proxy.version, domain.alpha):
                # Every batch this group could join is already spoken for: wait for a
                # batch, an apply or a group that fails or goes stale.
                c._pending_domain = domain
                this_pass = 0
                await c._changed.wait()
                continue
            wait_s = pace_wait_s(c, domain)
            if wait_s > 0:
                c._pending_domain = domain
                # Until the next apply (or one period, if it does not come).
                this_pass = 0
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(c._weights_changed.wait(), wait_s)
                continue
            ids = c.buffer.try_start_group(key, domain.name, domain.alpha)
            if ids is not None:
                c._group_seq += 1
                c._groups[key] = (domain, c._rng.randrange(2**31))
                arm_group_timeout(c, key)
                for tid in ids:
                    launch(c, tid, key)
                started = True
                this_pass += len(ids)
        if not started:
            this_pass = 0
            await c._changed.wait()
        elif this_pass >= ADMIT_PER_PASS and (c._ctx is None or c._ctx.barrier is None):
            # A training step frees room for a whole batch of groups at once; admitting them
            # in one pass (each member's first step runs in the next) held every reply
            # waiting behind it for tens of ms at 10k trajectories (issue 11's added
            # latency): ~32 trajectories per pass, a few ms. Not under sync mode's turn
            # barrier, whose batch must join it together (a group alone would take its turns
            # alone).
            this_pass = 0
            await asyncio.sleep(0)
