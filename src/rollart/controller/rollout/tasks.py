"""The controller's trajectory tasks: one asyncio task per trajectory, and what its outcome
does to the sample buffer.

A task runs :func:`~rollart.controller.rollout.trajectory.run_trajectory`; its outcome becomes a
buffer call (complete / fail -> retry or give the group up / restart / cancel); siblings the
buffer asks to cancel are cancelled (aborting generation, closing the env session); slots the
buffer refilled on its own (stale replacements, a restore) get their tasks here.
:class:`TrajectoryTasks` owns the tasks and supervises them with the controller's other
background tasks: one that raises anything but a per-trajectory outcome is *fatal*, kept for the
training step to re-raise (:meth:`TrajectoryTasks.raise_if_fatal`).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any

from rollart.config import RunConfig
from rollart.controller.observe.stall import ControllerStalledError
from rollart.controller.rollout.offloop import requested_cancel
from rollart.controller.rollout.trajectory import (
    Activity,
    TrajectoryContext,
    TrajectoryFailed,
    TrajectoryNotNeeded,
    TrajectoryStale,
    run_trajectory,
)
from rollart.controller.training.remote import INVALID_SAMPLE_REASON, trainable_problem

if TYPE_CHECKING:
    from rollart.controller.agents.runner import AgentRunner
    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.observe.transcripts import TranscriptRecorder
    from rollart.controller.rollout.admitted import AdmittedGroups
    from rollart.controller.rollout.pacing import Pacer

log = logging.getLogger(__name__)
#: the context trajectory tasks' done callbacks run in (they read no context variable)
_DONE_CONTEXT = contextvars.Context()


class Signal:
    """Wake every current waiter on ``notify()`` (an Event re-armed after each notify)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()


def last_failures(reasons: list[str]) -> str:
    """``reasons`` for one message: each distinct reason once, in first-seen order, with how
    many times it came (a misconfigured env fails every trajectory with the same long reason,
    which the run's last line would otherwise repeat)."""
    counts = dict.fromkeys(reasons, 0)
    for r in reasons:
        counts[r] += 1
    return "; ".join(f"{n}x {r!r}" if n > 1 else repr(r) for r, n in counts.items())


class TrajectoryTasks:
    """The running trajectories (one task each) and the controller's background tasks.

    Args:
        run: the scenario's run settings (retry budgets, selection, timeouts).
        buffer: the sample buffer the outcomes go to.
        groups: the admitted groups (each member's domain and env seed are looked up there).
        clock: monotonic seconds (the controller's clock).
        transcripts: told of every finished trajectory; ``None``: no transcripts.
        agents: agent domains' trajectory bodies; ``None``: none.
        pacer: paced admission's pacer (told each trajectory's duration); ``None``: not paced.

    :attr:`changed` is notified on every trajectory outcome and background task end: the
    admission loop and the training step wait on it.
    """

    def __init__(self, run: RunConfig, buffer: SampleBuffer, groups: AdmittedGroups, *,
                 clock: Callable[[], float], transcripts: TranscriptRecorder | None = None,
                 agents: AgentRunner | None = None, pacer: Pacer | None = None) -> None:
        self.run, self.buffer, self.groups = run, buffer, groups
        self.clock, self.transcripts, self.agents, self.pacer = clock, transcripts, agents, pacer
        #: notified on every trajectory outcome and background task end
        self.changed = Signal()
        self._ctx: TrajectoryContext | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        #: trajectories cancelled on purpose (a sibling finished, the group was dropped, ...)
        self._cancelled: set[str] = set()
        self._aux: set[asyncio.Task[Any]] = set()
        self._fatal: BaseException | None = None
        #: unbiased selection: per group, members finished so far
        self._finished: Counter[str] = Counter()
        self._group_failures: Counter[str] = Counter()
        self._exhausted_seen = self._attempts_seen = 0
        self._failures_in_a_row = 0
        #: when generate timeouts under overload began, with no trajectory finishing since
        #: (:meth:`_on_failed`); ``None``: not overloaded
        self._overload_since: float | None = None
        self._last_failures: list[str] = []
        self._closed = False
        self._stopping = False

    # ------------------------------------------------------------------ state
    @property
    def num_running(self) -> int:
        """Trajectory tasks alive now."""
        return len(self._tasks)

    @property
    def closed(self) -> bool:
        """:meth:`close` was called."""
        return self._closed

    @property
    def stopping(self) -> bool:
        """:meth:`stop_soon` was called: failures are neither fatal nor retried."""
        return self._stopping

    @property
    def ctx(self) -> TrajectoryContext | None:
        """The context trajectories run with (``None`` until :meth:`start`)."""
        return self._ctx

    @property
    def finishing_groups(self) -> frozenset[str]:
        """Unbiased selection: the groups whose finished members are being counted (until
        all ``run.group_size`` have finished, or the group is forgotten)."""
        return frozenset(self._finished)

    def activity(self) -> Mapping[str, Activity]:
        """Running trajectory id -> what it is doing now."""
        return self._ctx.activity if self._ctx is not None else {}

    def start(self, ctx: TrajectoryContext) -> None:
        """Trajectories launched from now on run with ``ctx``."""
        self._ctx = ctx

    def stop_soon(self) -> None:
        """The owner is about to close the controller for a fault found outside it: failures
        that follow are neither reported as fatal nor retried."""
        self._stopping = True

    def counted_groups(self) -> set[str]:
        """Keys of the groups whose failures are counted now (the buffer still knows each)."""
        return set(self._group_failures)

    def forget(self, key: str) -> None:
        """The buffer forgot group ``key``: drop its counters."""
        self._finished.pop(key, None)
        self._group_failures.pop(key, None)

    async def close(self) -> None:
        """Cancel every trajectory and background task and wait for them to end."""
        self._closed = True
        tasks = [*self._tasks.values(), *self._aux]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ supervision
    def notify(self) -> None:
        """Wake the waiters of :attr:`changed`."""
        self.changed.notify()

    def supervise(self, task: asyncio.Task[Any]) -> None:
        """Done callback of every background task: an exception is fatal (kept for
        :meth:`raise_if_fatal`) unless the controller is closing or stopping."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._fatal is None and not self._closed and not self._stopping:
            log.error("fatal error in %s: %s: %s", task.get_name(), type(exc).__name__, exc)
            self._fatal = exc
        self.notify()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run ``coro`` as a supervised background task (cancelled by :meth:`close`)."""
        task = asyncio.create_task(coro, name=name)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)
        task.add_done_callback(self.supervise)
        return task

    def raise_if_fatal(self) -> None:
        """Re-raise the first fatal background error, if any."""
        if self._fatal is not None:
            raise self._fatal

    # ------------------------------------------------------------------ trajectories
    def launch(self, tid: str, group_key: str) -> None:
        """Start trajectory ``tid`` of admitted group ``group_key``."""
        if self._ctx is not None and self._ctx.barrier is not None:
            # Join now, not when the task first runs: otherwise the first member to reach the
            # barrier would find itself alone and go ahead.
            self._ctx.barrier.join(tid)
        task = asyncio.create_task(self._run_one(tid, group_key), name=f"traj-{tid}")
        self._tasks[tid] = task
        # One done callback, not three, run in one shared empty context (it reads no context
        # variable): each add_done_callback would otherwise copy the context and keep a
        # closure, GC-tracked objects every running trajectory holds.
        task.add_done_callback(functools.partial(self._traj_done, tid), context=_DONE_CONTEXT)

    def _traj_done(self, tid: str, task: asyncio.Task[Any]) -> None:
        self._tasks.pop(tid, None)
        if self._ctx is not None and self._ctx.barrier is not None:
            # Also when cancelled before its first step (its finally blocks never run).
            self._ctx.barrier.leave(tid)
        if self._closed and task.cancelled() and self.buffer.is_live(tid):
            # Shut down before its first step, _run_one's handler never ran: the buffer must
            # still learn that it ended (one whose handler ran is no longer live).
            self.buffer.cancel(tid, "shutdown")
        self.supervise(task)

    def launch_restarts(self) -> None:
        """Act on what the buffer queued: stale trajectories to stop and restart, refilled
        slots to launch, members of given-up groups to cancel."""
        buffer = self.buffer
        for tid in buffer.drain_aborts():
            # Stale mid-generation (abort_stale): stop it now, restart its slot fresh.
            task = self._tasks.get(tid)
            if task is not None:
                self._cancelled.add(tid)
                task.cancel()
            fresh = buffer.restart_trajectory(tid)
            if fresh is not None:
                self.launch(fresh, buffer.group_of(fresh))
        for tid in buffer.drain_restarts():
            self.launch(tid, buffer.group_of(tid))
        cancels = buffer.drain_cancels()
        for tid in cancels:
            # A group given up by the buffer (run.max_group_attempts): its members stop.
            self.cancel(tid)
        given_up = buffer.stats_dropped("group_attempts")
        if given_up > self._attempts_seen:
            log.warning("%d group(s) dropped: each started run.max_group_attempts = %d "
                        "trajectories per member slot without completing; %d live member(s) "
                        "cancelled", given_up - self._attempts_seen, self.run.max_group_attempts,
                        len(cancels))
            self._attempts_seen = given_up

    def cancel(self, tid: str) -> None:
        """Cancel trajectory ``tid``: the buffer learns at once (so this step's counters
        include it); its task then aborts its generation and closes its env session."""
        self.buffer.cancel(tid)
        task = self._tasks.get(tid)
        if task is not None:
            self._cancelled.add(tid)
            task.cancel()

    async def _run_one(self, tid: str, key: str) -> None:
        ctx = self._ctx
        assert ctx is not None
        domain, seed = self.groups[key]
        t_start = self.clock()
        try:
            body = self.agents.body_for(domain.name) if self.agents is not None else None
            sample = await (run_trajectory(ctx, tid, key, domain, seed) if body is None
                            else run_trajectory(ctx, tid, key, domain, seed, body))
            problem = trainable_problem(sample)
            if problem is not None:  # caught here, it costs a retry, not a training step
                raise TrajectoryFailed(INVALID_SAMPLE_REASON, problem, sample.num_generated)
        except TrajectoryFailed as exc:
            log.info("trajectory %s failed: %s", tid, exc)
            self._on_failed(tid, key, exc)
        except TrajectoryStale:
            fresh = self.buffer.restart_trajectory(tid)
            if fresh is not None:
                self.launch(fresh, key)
        except TrajectoryNotNeeded:
            self.buffer.cancel(tid)
        except asyncio.CancelledError:
            if tid in self._cancelled or self._closed or requested_cancel():
                if tid not in self._cancelled:  # shutdown, not a sibling cancel
                    self.buffer.cancel(tid, "shutdown")
                raise
            # Nobody cancelled this task: env / reward / user code raised CancelledError on
            # its own. A failure of this trajectory (counted, retried), not a silent
            # retirement.
            log.warning("trajectory %s: CancelledError raised inside it although nothing "
                        "cancelled it; counted as failure 'unrequested_cancel' and retried", tid)
            self._on_failed(tid, key, TrajectoryFailed(
                "unrequested_cancel", "CancelledError raised by env, reward or user code"))
        else:
            self._failures_in_a_row = 0
            self._overload_since = None
            if self.transcripts is not None:
                self.transcripts.finished(sample)
            if self.pacer is not None:
                self.pacer.on_finished(domain.name, self.clock() - t_start)
            for sibling in self.buffer.complete(tid, sample):
                self.cancel(sibling)
            if self.run.selection == "unbiased":
                self._finished[key] += 1
                if self._finished[key] == self.run.group_size:
                    del self._finished[key]
                    self.spawn(self._selection_deadline(key), f"deadline-{key}")
        finally:
            self._cancelled.discard(tid)
            if not self._closed and not self._stopping:
                self.launch_restarts()
            self.notify()

    def _on_failed(self, tid: str, key: str, exc: TrajectoryFailed) -> None:
        """Count a failed trajectory, retry its slot, or give its group up when the group's
        failure budget (``run.retry.max_failures_per_group``) is spent. A generate timeout
        under overload (``LLMProxy.generate``: its worker was busy, or no worker answered) is
        not a failure in a row; only ``run.retry.max_overload_s`` of them without a finished
        trajectory stop the run."""
        run = self.run
        self._last_failures = [*self._last_failures[-4:], str(exc)]
        if exc.reason == "generation_timeout" and getattr(exc.__cause__, "overload", False):
            now = self.clock()
            if self._overload_since is None:  # the call timed out after generate_timeout_s
                self._overload_since = now - run.generate_timeout_s
            if now - self._overload_since >= run.retry.max_overload_s:
                raise ControllerStalledError(
                    f"generate calls kept timing out under overload for "
                    f"{now - self._overload_since:.0f} s with no trajectory finishing "
                    f"(run.retry.max_overload_s = {run.retry.max_overload_s:g}): every worker "
                    f"busy or silent, or the controller's loop stalled; last "
                    f"{len(self._last_failures)}: {last_failures(self._last_failures)}"
                ) from exc
        else:
            self._failures_in_a_row += 1
        if self._failures_in_a_row >= run.retry.max_failures_in_a_row:
            raise ControllerStalledError(
                f"{self._failures_in_a_row} trajectory failures in a row "
                f"(run.retry.max_failures_in_a_row); last {len(self._last_failures)}: "
                f"{last_failures(self._last_failures)}"
            ) from exc
        retry = self.buffer.fail(tid, exc.reason)
        if self.buffer.group_status(key) is None:
            # The failure ended the group (attempts exhausted): the buffer forgot it and
            # ``forget`` dropped its counters; counting now would leave one behind for good.
            if self.buffer.stats_dropped("attempts_exhausted") > self._exhausted_seen:
                self._exhausted_seen += 1
                log.warning("group %s dropped: a member failed run.retry.max_attempts = %d "
                            "times; last: %s", key, run.retry.max_attempts, exc)
            return
        self._group_failures[key] += 1
        budget = run.retry.max_failures_per_group
        if budget is not None and self._group_failures[key] >= budget:
            log.warning("group %s dropped: %d failures (run.retry.max_failures_per_group = "
                        "%d); last: %s", key, self._group_failures[key], budget, exc)
            for other in self.buffer.drop_group(key, "failure_budget"):
                self.cancel(other)
            return
        if retry is not None and not self._stopping:
            self.launch(retry, key)
        elif self.buffer.stats_dropped("attempts_exhausted") > self._exhausted_seen:
            self._exhausted_seen += 1
            log.warning("group %s dropped: a member failed run.retry.max_attempts = %d times; "
                        "last: %s", key, run.retry.max_attempts, exc)

    async def _selection_deadline(self, key: str) -> None:
        await asyncio.sleep(self.run.selection_deadline_s)
        for tid in self.buffer.close_group(key):
            self.cancel(tid)
        self.notify()
