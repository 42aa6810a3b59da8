"""A group's life in the sample buffer: slots filled and closed, samples kept, dropped or
selected, stale ones replaced, groups retired and forgotten.

Plain functions over a ``SampleBuffer``'s state (``rollart.controller.buffer.core`` owns the state
and calls them; the rules are in its module docstring). They are functions, not methods of
another object, so that ``SampleBuffer.complete`` reaches them in one call, as it reached the
methods they were: it runs once per finished trajectory.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from rollart.controller.buffer.records import LIVE, Group, SampleBufferError, Traj, TrajState

if TYPE_CHECKING:
    from rollart.controller.buffer.core import SampleBuffer


def new_traj(buf: SampleBuffer, g: Group, slot: int, attempt: int,
             tid: str | None = None) -> Traj:
    if tid is None:
        tid = f"{g.key}/{buf._next_seq}"
        buf._next_seq += 1
    t = Traj(tid=tid, group=g, slot=slot, attempt=attempt)
    g.slots[slot] = t
    g.started += 1
    buf._trajs[tid] = t
    buf._c["started"] += 1
    buf._dom(g.domain).started += 1
    return t


def refill(buf: SampleBuffer, g: Group, slot: int, attempt: int) -> str | None:
    """A new trajectory in ``slot`` (a retry, restart or stale replacement): its id, or
    ``None`` when the group already started ``max_group_attempts`` per slot, in which case
    the group is given up (``"group_attempts"``) instead: a group whose members keep going
    stale one after another would otherwise be refilled forever."""
    limit = buf.max_group_attempts
    if limit is not None and g.started >= limit * len(g.slots):
        give_up(buf, g, "group_attempts")
        return None
    return new_traj(buf, g, slot, attempt).tid


def give_up(buf: SampleBuffer, g: Group, reason: str) -> None:
    """The buffer drops an open group on its own (counted by ``reason``): held samples are
    dropped (``"retired"``), live members listed for the caller to cancel
    (``drain_cancels``)."""
    if g.status != "open":
        return
    buf._groups_dropped[reason] = buf._groups_dropped.get(reason, 0) + 1
    retire(buf, g)
    buf._cancels.extend(t.tid for t in g.live())
    maybe_forget(buf, g)


def finish(buf: SampleBuffer, t: Traj, reason: str) -> None:
    """Terminal state, not trained: every token ``t`` generated is wasted for ``reason``
    (exactly once: a trajectory reaches DONE once). Its record goes at once (calls on its
    id are then late calls), so the records are the running and held trajectories only."""
    t.state = TrajState.DONE
    buf._trajs.pop(t.tid, None)
    if t.num_tokens:
        buf._wasted[reason] = buf._wasted.get(reason, 0) + t.num_tokens
        w = buf._dom(t.group.domain).wasted_tokens
        w[reason] = w.get(reason, 0) + t.num_tokens


def drop(buf: SampleBuffer, t: Traj, reason: str) -> None:
    """Discard a completed sample (counted, reported to ``on_drop``)."""
    g = t.group
    for lst in (g.kept, g.finished):
        if t in lst:
            lst.remove(t)
    t.sample = None
    buf._dropped[reason] = buf._dropped.get(reason, 0) + 1
    finish(buf, t, reason)
    if buf._on_drop is not None:
        buf._on_drop(t.tid, reason)


def keep(buf: SampleBuffer, t: Traj) -> None:
    g = t.group
    g.kept.append(t)
    if len(g.kept) == buf.group_size:
        buf._ready[g.key] = g
    assert t.sample is not None
    buf._c["kept_members"] += 1
    buf._c["kept_len"] += t.sample.num_generated


def replace_stale(buf: SampleBuffer, t: Traj) -> None:
    """A completed sample can never be admitted: drop it, refill its slot."""
    drop(buf, t, "stale")
    tid = refill(buf, t.group, t.slot, t.attempt)
    if tid is not None:
        buf._c["replaced_stale"] += 1
        buf._restarts.append(tid)


def sweep_stale(buf: SampleBuffer) -> None:
    """Replace stale held samples (and abort stale running trajectories if configured).
    Skipped while ``_fresh_bound`` proves no trajectory is stale (a sweep would do
    nothing); a full sweep recomputes the bound."""
    if buf._fresh_bound is not None and buf._fresh_bound >= buf._version:
        return
    abort = buf.abort_stale and buf.check == "per_turn" and buf.on_stale == "restart"
    bound: int | None = None
    for g in list(buf._groups.values()):
        if g.status != "open":
            continue
        for t in [*g.kept, *g.finished]:
            if not buf._ok(t) and t.state is TrajState.HELD:
                # (a replacement past the group's attempts gives the group up, and drops
                # the rest of this list with it)
                replace_stale(buf, t)
        for t in [*g.kept, *g.finished, *g.live()]:
            if (abort and t.state is TrajState.RUNNING and not buf._ok(t)
                    and buf._slot_open(t)):
                t.state = TrajState.ABORTING
                buf._aborts.append(t.tid)
            if t.min_version is not None:
                b = t.min_version + g.alpha
                bound = b if bound is None or b < bound else bound
    # No trajectory with a version at all: any later one lowers the bound from here.
    buf._fresh_bound = buf._version if bound is None else bound


def close_slot(buf: SampleBuffer, t: Traj) -> None:
    g = t.group
    if g.slots[t.slot] is t:
        g.slots[t.slot] = None
    if g.status == "open" and not buf._complete(g):
        potential = len(g.kept) + len(g.finished) + len(g.live())
        if potential < buf.group_size:
            retire(buf, g)
        elif buf.selection == "unbiased" and not g.selected:
            # Selection only fires here with no member left running, so nothing to cancel.
            maybe_select(buf, g, None)
    maybe_forget(buf, g)


def discard(buf: SampleBuffer, g: Group, reason: str) -> None:
    """A complete group the batch policy throws away: its samples are wasted for
    ``reason``; counted in ``groups_dropped`` as the caller's ``drop_group`` is."""
    buf._groups_dropped[reason] = buf._groups_dropped.get(reason, 0) + 1
    buf._ready.pop(g.key, None)
    g.status = "retired"
    buf._admitted_groups -= 1
    buf._c["groups_retired"] += 1
    for t in list(g.kept):
        drop(buf, t, reason)
    maybe_forget(buf, g)


def retire(buf: SampleBuffer, g: Group) -> None:
    g.status = "retired"
    buf._admitted_groups -= 1  # AReaL: a rejected rollout is not "accepted"
    buf._c["groups_retired"] += 1
    for t in [*g.kept, *g.finished]:
        drop(buf, t, "retired")


def maybe_select(buf: SampleBuffer, g: Group, rng: random.Random | None) -> list[str]:
    """Unbiased selection once the deadline passed or no member is left running."""
    live = [t for t in g.live() if buf._slot_open(t)]
    if len(g.finished) < buf.group_size or not (g.closing or not live):
        return []
    chosen = set((rng or buf._rng).sample(g.finished, buf.group_size))
    finished, g.finished, g.selected = g.finished, [], True
    for t in finished:  # kept in completion order, so batches are reproducible
        if t in chosen:
            keep(buf, t)
        else:
            drop(buf, t, "unselected")
    return cancel_surplus(g)


def cancel_surplus(g: Group) -> list[str]:
    """Group complete: close every other slot; its live members are for the caller to
    cancel (they stay counted in flight until ``cancel``)."""
    return [t.tid for t in g.live() if t not in g.kept]


def maybe_forget(buf: SampleBuffer, g: Group) -> None:
    if g.status != "open" and not g.live() and buf._groups.get(g.key) is g:
        # Its trajectories' records went as each finished or was consumed.
        del buf._groups[g.key]
        if buf._on_forget is not None:
            buf._on_forget(g.key)


# What the caller reports on a trajectory or group, other than a turn or a completion (the
# hot paths, which stay methods of ``SampleBuffer``): each public method delegates here.
def close_group(buf: SampleBuffer, group_key: str, rng: random.Random | None) -> list[str]:
    """``SampleBuffer.close_group`` (its docstring)."""
    g = buf._groups.get(group_key)
    if g is None or g.status != "open" or g.selected or buf.selection != "unbiased":
        return []
    g.closing = True
    return maybe_select(buf, g, rng)


def fail(buf: SampleBuffer, traj_id: str, reason: str) -> str | None:
    """``SampleBuffer.fail`` (its docstring)."""
    t = buf._get(traj_id)
    if t is None or t.state not in LIVE:
        buf._c["late_calls"] += 1
        return None
    if not reason:
        raise SampleBufferError(f"trajectory {traj_id!r}: fail() needs a reason")
    buf._failed[reason] = buf._failed.get(reason, 0) + 1
    finish(buf, t, "failed")
    g = t.group
    if buf._slot_open(t) and t.attempt < buf.max_attempts:
        retry = refill(buf, g, t.slot, t.attempt + 1)
        if retry is not None:
            buf._c["retries"] += 1
        return retry
    was_open = g.status == "open" and t.attempt >= buf.max_attempts
    close_slot(buf, t)
    if was_open and g.status == "retired":
        # A slot ran out of attempts and the group can no longer fill: given up, by reason.
        buf._groups_dropped["attempts_exhausted"] = (
            buf._groups_dropped.get("attempts_exhausted", 0) + 1)
    return None


def drop_group(buf: SampleBuffer, group_key: str, reason: str) -> list[str]:
    """``SampleBuffer.drop_group`` (its docstring)."""
    g = buf._groups.get(group_key)
    if g is None or g.status != "open":
        return []
    if not reason:
        raise SampleBufferError(f"group {group_key!r}: drop_group() needs a reason")
    buf._groups_dropped[reason] = buf._groups_dropped.get(reason, 0) + 1
    retire(buf, g)
    live = [t.tid for t in g.live()]
    maybe_forget(buf, g)
    return live


def cancel(buf: SampleBuffer, traj_id: str, reason: str | None) -> None:
    """``SampleBuffer.cancel`` (its docstring)."""
    t = buf._get(traj_id)
    if t is None or t.state not in LIVE:
        buf._c["late_calls"] += 1
        return
    if reason is None:
        reason = ("retired" if t.group.status == "retired"
                  else "stale" if t.state is TrajState.ABORTING or t.doomed else "redundancy")
    buf._c["cancelled"] += 1
    buf._c["cancelled_len"] += t.num_tokens
    finish(buf, t, reason)
    close_slot(buf, t)


def restart_trajectory(buf: SampleBuffer, traj_id: str) -> str | None:
    """``SampleBuffer.restart_trajectory`` (its docstring)."""
    t = buf._get(traj_id)
    if t is None or t.state not in LIVE:
        buf._c["late_calls"] += 1
        return None
    if t.state is not TrajState.ABORTING:
        raise SampleBufferError(f"trajectory {traj_id!r} was not told to restart")
    buf._c["restarted_stale"] += 1
    finish(buf, t, "stale")
    if buf._slot_open(t):
        return refill(buf, t.group, t.slot, t.attempt)
    close_slot(buf, t)
    return None
