"""The controller's trajectory tasks: one asyncio task per trajectory, and what its outcome
does to the sample buffer.

A task runs :func:`~rollart.controller.rollout.trajectory.run_trajectory`; its outcome becomes a buffer
call (complete / fail -> retry or give the group up / restart / cancel); siblings the buffer
asks to cancel are cancelled (aborting generation, closing the env session); slots the buffer
refilled on its own (stale replacements, a restore) get their tasks here. Plain functions over
the :class:`~rollart.controller.controller.Controller`'s state (it owns the state and the
tasks' supervision); the admission loop and the training step launch through them.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from typing import TYPE_CHECKING, Any

from rollart.controller.observe.stall import ControllerStalledError
from rollart.controller.rollout.offloop import requested_cancel
from rollart.controller.rollout.trajectory import (
    TrajectoryFailed,
    TrajectoryNotNeeded,
    TrajectoryStale,
    run_trajectory,
)
from rollart.controller.training.advantages import INVALID_SAMPLE_REASON, trainable_problem

if TYPE_CHECKING:
    from rollart.controller.controller import Controller

# The controller's messages keep the logger name they always had, whichever module of the
# controller logs them: log filters and configurations key on it.
log = logging.getLogger("rollart.controller.controller")
#: the context trajectory tasks' done callbacks run in (they read no context variable)
_DONE_CONTEXT = contextvars.Context()


def launch(c: Controller, tid: str, group_key: str) -> None:
    if c._ctx is not None and c._ctx.barrier is not None:
        # Join now, not when the task first runs: otherwise the first member to reach the
        # barrier would find itself alone and go ahead.
        c._ctx.barrier.join(tid)
    task = asyncio.create_task(run_one(c, tid, group_key), name=f"traj-{tid}")
    c._tasks[tid] = task
    # One done callback, not three, run in one shared empty context (it reads no context
    # variable): each add_done_callback would otherwise copy the context and keep a
    # closure, GC-tracked objects every running trajectory holds.
    task.add_done_callback(functools.partial(traj_done, c, tid), context=_DONE_CONTEXT)


def traj_done(c: Controller, tid: str, task: asyncio.Task[Any]) -> None:
    c._tasks.pop(tid, None)
    if c._ctx is not None and c._ctx.barrier is not None:
        # Also when cancelled before its first step (its finally blocks never run).
        c._ctx.barrier.leave(tid)
    if c._closed and task.cancelled() and c.buffer.is_live(tid):
        # Shut down before its first step, run_one's handler never ran: the buffer must
        # still learn that it ended (one whose handler ran is no longer live).
        c.buffer.cancel(tid, "shutdown")
    c._on_done(task)


def launch_restarts(c: Controller) -> None:
    for tid in c.buffer.drain_aborts():
        # Stale mid-generation (abort_stale): stop it now, restart its slot fresh.
        task = c._tasks.get(tid)
        if task is not None:
            c._cancelled.add(tid)
            task.cancel()
        fresh = c.buffer.restart_trajectory(tid)
        if fresh is not None:
            launch(c, fresh, c.buffer.group_of(fresh))
    for tid in c.buffer.drain_restarts():
        launch(c, tid, c.buffer.group_of(tid))
    cancels = c.buffer.drain_cancels()
    for tid in cancels:
        # A group given up by the buffer (run.max_group_attempts): its members stop.
        cancel_traj(c, tid)
    given_up = c.buffer.stats_dropped("group_attempts")
    if given_up > c._attempts_seen:
        log.warning("%d group(s) dropped: each started run.max_group_attempts = %d "
                    "trajectories per member slot without completing; %d live member(s) "
                    "cancelled", given_up - c._attempts_seen, c.run.max_group_attempts,
                    len(cancels))
        c._attempts_seen = given_up


def cancel_traj(c: Controller, tid: str) -> None:
    # The buffer learns at once (so this step's counters include it); the task then aborts
    # its generation and closes its env session.
    c.buffer.cancel(tid)
    task = c._tasks.get(tid)
    if task is not None:
        c._cancelled.add(tid)
        task.cancel()


async def run_one(c: Controller, tid: str, key: str) -> None:
    assert c._ctx is not None
    domain, seed = c._groups[key]
    t_start = c.clock()
    try:
        body = c.agents.body_for(domain.name) if c.agents is not None else None
        sample = await (run_trajectory(c._ctx, tid, key, domain, seed) if body is None
                        else run_trajectory(c._ctx, tid, key, domain, seed, body))
        problem = trainable_problem(sample)
        if problem is not None:  # caught here, it costs a retry, not a training step
            raise TrajectoryFailed(INVALID_SAMPLE_REASON, problem, sample.num_generated)
    except TrajectoryFailed as exc:
        log.info("trajectory %s failed: %s", tid, exc)
        on_failed(c, tid, key, exc)
    except TrajectoryStale:
        fresh = c.buffer.restart_trajectory(tid)
        if fresh is not None:
            launch(c, fresh, key)
    except TrajectoryNotNeeded:
        c.buffer.cancel(tid)
    except asyncio.CancelledError:
        if tid in c._cancelled or c._closed or requested_cancel():
            if tid not in c._cancelled:  # shutdown, not a sibling cancel
                c.buffer.cancel(tid, "shutdown")
            raise
        # Nobody cancelled this task: env / reward / user code raised CancelledError on
        # its own. A failure of this trajectory (counted, retried), not a silent retirement.
        log.warning("trajectory %s: CancelledError raised inside it although nothing "
                    "cancelled it; counted as failure 'unrequested_cancel' and retried", tid)
        on_failed(c, tid, key, TrajectoryFailed(
            "unrequested_cancel", "CancelledError raised by env, reward or user code"))
    else:
        c._failures_in_a_row = 0
        c._overload_since = None
        if c.transcripts is not None:
            c.transcripts.finished(sample)
        if c._pacer is not None:
            c._pacer.on_finished(domain.name, c.clock() - t_start)
        for sibling in c.buffer.complete(tid, sample):
            cancel_traj(c, sibling)
        if c.run.selection == "unbiased":
            c._finished[key] += 1
            if c._finished[key] == c.run.group_size:
                del c._finished[key]
                c._spawn_aux(selection_deadline(c, key), f"deadline-{key}")
    finally:
        c._cancelled.discard(tid)
        if not c._closed and not c._stopping:
            launch_restarts(c)
        c._notify()


def last_failures(reasons: list[str]) -> str:
    """``reasons`` for one message: each distinct reason once, in first-seen order, with how
    many times it came (a misconfigured env fails every trajectory with the same long reason,
    which the run's last line would otherwise repeat)."""
    counts = dict.fromkeys(reasons, 0)
    for r in reasons:
        counts[r] += 1
    return "; ".join(f"{n}x {r!r}" if n > 1 else repr(r) for r, n in counts.items())


def on_failed(c: Controller, tid: str, key: str, exc: TrajectoryFailed) -> None:
    """Count a failed trajectory, retry its slot, or give its group up when the group's
    failure budget (``run.retry.max_failures_per_group``) is spent. A generate timeout under
    overload (``LLMProxy.generate``: its worker was busy, or no worker answered) is not a
    failure in a row; only ``run.retry.max_overload_s`` of them without a finished
    trajectory stop the run."""
    c._last_failures = [*c._last_failures[-4:], str(exc)]
    if exc.reason == "generation_timeout" and getattr(exc.__cause__, "overload", False):
        now = c.clock()
        if c._overload_since is None:  # the call timed out after generate_timeout_s
            c._overload_since = now - c.run.generate_timeout_s
        if now - c._overload_since >= c.run.retry.max_overload_s:
            raise ControllerStalledError(
                f"generate calls kept timing out under overload for "
                f"{now - c._overload_since:.0f} s with no trajectory finishing "
                f"(run.retry.max_overload_s = {c.run.retry.max_overload_s:g}): every worker "
                f"busy or silent, or the controller's loop stalled; last "
                f"{len(c._last_failures)}: {last_failures(c._last_failures)}") from exc
    else:
        c._failures_in_a_row += 1
    if c._failures_in_a_row >= c.run.retry.max_failures_in_a_row:
        raise ControllerStalledError(
            f"{c._failures_in_a_row} trajectory failures in a row "
            f"(run.retry.max_failures_in_a_row); last {len(c._last_failures)}: "
            f"{last_failures(c._last_failures)}"
        ) from exc
    retry = c.buffer.fail(tid, exc.reason)
    c._group_failures[key] += 1
    budget = c.run.retry.max_failures_per_group
    if budget is not None and c._group_failures[key] >= budget:
        log.warning("group %s dropped: %d failures (run.retry.max_failures_per_group = %d); "
                    "last: %s", key, c._group_failures[key], budget, exc)
        for other in c.buffer.drop_group(key, "failure_budget"):
            cancel_traj(c, other)
        return
    if retry is not None and not c._stopping:
        launch(c, retry, key)
    elif c.buffer.stats_dropped("attempts_exhausted") > c._exhausted_seen:
        c._exhausted_seen += 1
        log.warning("group %s dropped: a member failed run.retry.max_attempts = %d times; "
                    "last: %s", key, c.run.retry.max_attempts, exc)


async def selection_deadline(c: Controller, key: str) -> None:
    await asyncio.sleep(c.run.selection_deadline_s)
    for tid in c.buffer.close_group(key):
        cancel_traj(c, tid)
    c._notify()
