"""The asyncio controller: admission of groups, trajectory tasks, and the training loop.

One :class:`Controller` wires the LLM proxy, env and reward routers, the
:class:`~rollart.controller.buffer.SampleBuffer` (pure state machine, driven from here) and the
trainer. Background work:

- the *admission loop* starts GRPO groups whenever the buffer's in-flight bound allows (and, in
  ``sync`` / ``sync_plus`` / ``one_off``, while at most one batch of groups is in flight), mixing
  domains by weight with a seeded RNG; each group gets one env seed shared by its members;
- one task per trajectory (:func:`~rollart.controller.trajectory.run_trajectory`) whose outcome
  becomes a buffer call (complete / fail -> retry / restart / cancel); siblings the buffer asks
  to cancel are cancelled (aborting generation, closing the env session);
- the weight push of the newest version (trainer -> workers, staged), overlapping rollout;
  with ``run.weight_apply = "eager"`` it is applied as soon as it is staged, in waves.

Staleness policies (``rollart.config.RunConfig``; all keep the bound strict): ``admission``
``greedy`` (any free slot), ``capacity`` (a group starts only if some batch it could still
join has room: ``SampleBuffer.has_capacity``) or ``paced`` (``rollart.controller.pacing``);
``domain_mix`` ``weight`` or ``yield`` (see :meth:`Controller.domain_weights`); ``fresh_start``
and ``abort_stale`` (``SampleBuffer``); ``DomainConfig.alpha`` per-domain bounds. A domain
held back by admission keeps its turn, so waiting never favours short domains.

:meth:`Controller.step` is one training step, per the paper's protocol (§6.2): get batch ->
pause generation -> apply the newest weights -> resume -> train (overlap modes; rollout keeps
going during training), or get batch -> pause -> train -> apply the new weights -> resume (no
overlap). A background task that raises anything but a per-trajectory outcome is *fatal*: it is
re-raised by the next (or the pending) ``step`` call, never left to hang.

Time is ``loop.time()`` unless a ``clock`` is injected, so a simulator's virtual clock works.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

from rollart.config import DomainConfig, Scenario
from rollart.controller.agents.runner import AgentRunner
from rollart.controller.agreement import (
    UNKNOWN_WORKER,
    WorkerAgreement,
    WorkerDisagreementError,
    by_worker,
    offenders,
)
from rollart.controller.buffer import SampleBuffer
from rollart.controller.loophealth import LoopLagMonitor
from rollart.controller.metrics import StepMetrics, step_metrics
from rollart.controller.modes import TurnBarrier, mode_spec
from rollart.controller.offloop import requested_cancel
from rollart.controller.pacing import Pacer
from rollart.controller.ports import Tokenizer, TrainerBackend, TrainResult
from rollart.controller.proxy import LLMProxy
from rollart.controller.sample import BufferStats, Sample
from rollart.controller.services import EnvRouter, RewardRouter
from rollart.controller.tokens import ChatTokens
from rollart.controller.training import INVALID_SAMPLE_REASON, trainable_problem
from rollart.controller.trajectory import (
    TrajectoryContext,
    TrajectoryFailed,
    TrajectoryNotNeeded,
    TrajectoryStale,
    run_trajectory,
)
from rollart.controller.transcripts import TranscriptRecorder
from rollart.controller.weightsync import WeightSync
from rollart.controller.workercheck import ViolationWindow
from rollart.transport.errors import RollartError

log = logging.getLogger(__name__)
#: the context trajectory tasks' done callbacks run in (they read no context variable)
_DONE_CONTEXT = contextvars.Context()


#: scenario field of each ``SampleBuffer`` setting whose name differs (for resume errors)
_SCENARIO_FIELD = {"check": "run.mode", "max_attempts": "run.retry.max_attempts"}

class ControllerStalledError(RollartError):
    """Fatal: no batch can be produced (nothing running, admission cannot start a group)."""


class _Signal:
    """Wake every current waiter on ``notify()`` (an Event re-armed after each notify)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self) -> None:
        await self._event.wait()


class Controller:
    """Drives a scenario's rollout and training (see the module docstring).

    Args:
        scenario: a validated scenario (``run`` and ``domains`` are used here).
        proxy: LLM proxy over the scenario's pools (its ``version`` = weights the workers serve);
            one without a ``violations`` window gets ``run.worker_checks``' rule.
        envs, rewards: env and reward routers.
        trainer: the trainer port; its ``version`` must equal the workers' at start.
        tokenizer: the policy's tokenizer (chat template, encode, decode).
        clock: monotonic seconds; default the running loop's ``time``.
        resume: a :meth:`snapshot` to continue from (held samples kept, in-flight trajectories
            restarted, same group seeds and RNG stream); the trainer must be at its version.
        loop_lag: an event-loop lag monitor, started with the controller; each step reports
            its p99 / max (``None``: not measured; virtual-clock runs must not pass one).
        transcripts: told of every finished trajectory, discarded sample and batch
            (``rollart.controller.transcripts``); ``None``: no transcripts.
        buffer_class: the sample buffer's class: ``SampleBuffer`` or a subclass overriding its
            admission (``try_start_group`` / ``has_room``) or batch assembly
            (``assemble_batch`` / ``batch_order``)
            while keeping its protocol (``rollart.controller.buffer``); built with the same
            keyword arguments and restored with its ``restore`` classmethod.
        agents: trajectory bodies of agent domains (``cluster.agent``); ``None``: none.
        stall_watchdog: log what ``get_batch`` waits on every ``run.stall_log_s`` (simulators
            on a virtual clock turn it off: its timer would hide a deadlock from the clock's
            idle detection).

    Raises:
        ConfigError: a domain whose reward cannot be routed, or an unknown pool affinity.
    """

    def __init__(
        self,
        scenario: Scenario,
        *,
        proxy: LLMProxy,
        envs: EnvRouter,
        rewards: RewardRouter,
        trainer: TrainerBackend,
        tokenizer: Tokenizer,
        clock: Callable[[], float] | None = None,
        resume: dict[str, Any] | None = None,
        loop_lag: LoopLagMonitor | None = None,
        transcripts: TranscriptRecorder | None = None,
        buffer_class: type[SampleBuffer] = SampleBuffer,
        stall_watchdog: bool = True,
        agents: AgentRunner | None = None,
    ) -> None:
        run = scenario.run
        self._stall_watchdog_on = stall_watchdog
        self.scenario, self.run = scenario, run
        self.spec = mode_spec(run.mode)
        self.proxy, self.envs, self.rewards, self.trainer = proxy, envs, rewards, trainer
        #: agent domains' trajectory bodies (``rollart.controller.agents``); the owner starts
        #: and closes its endpoint
        self.agents = agents
        if proxy.violations is None:  # the scenario's quarantine rule for bad worker output
            wc = run.worker_checks
            proxy.violations = ViolationWindow(wc.max_invalid_replies, wc.invalid_window)
        self._rng = random.Random(run.seed)
        self.transcripts = transcripts
        self._buffer_class = buffer_class
        self.buffer = buffer_class(
            alpha=run.alpha,
            batch_size=run.batch_size,
            group_size=run.group_size,
            redundancy=run.redundancy,
            selection=run.selection,
            check=self.spec.check,
            on_stale=run.on_stale,
            max_attempts=run.retry.max_attempts,
            initial_version=trainer.version,
            rng=random.Random(run.seed + 1),
            on_forget=self._forget_group,
            on_drop=transcripts.dropped if transcripts is not None else None,
            fresh_start=run.fresh_start,
            abort_stale=run.abort_stale,
            staleness_control=self.spec.staleness_control,
        )
        self.domains: dict[str, DomainConfig] = {d.name: d for d in scenario.domains}
        self._groups: dict[str, tuple[DomainConfig, int]] = {}
        self._group_seq = 0
        self._step = 0
        if resume is not None:
            self._restore(resume)
        for d in scenario.domains:
            rewards.check(d.name, d.reward, d.reward_url)
            proxy.pool_of(d.name)
        chats: dict[str, ChatTokens] = {}
        by_kwargs: dict[str, ChatTokens] = {}
        for d in scenario.domains:
            key = repr(sorted(d.chat_template_kwargs.items()))
            if key not in by_kwargs:
                by_kwargs[key] = ChatTokens(tokenizer, d.chat_template_kwargs)
            chats[d.name] = by_kwargs[key]
        self._clock = clock
        self._loop_lag = loop_lag
        self._chats = chats
        self._ctx: TrajectoryContext | None = None
        self._finished: Counter[str] = Counter()
        self._group_failures: Counter[str] = Counter()
        self._exhausted_seen = 0
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._cancelled: set[str] = set()
        self._aux: set[asyncio.Task[Any]] = set()
        self._changed: _Signal | None = None
        self._weights_changed: _Signal | None = None
        self._admission_open = True
        self._fatal: BaseException | None = None
        self._sync: WeightSync | None = None
        self._align_s = 0.0
        self._started_at = 0.0
        self._failures_in_a_row = 0
        self._last_failures: list[str] = []
        self._started = False
        self._closed = False
        self._stopping = False
        self._last_step_end = 0.0
        # (version, kept-sample count) at the last take_batch that found no batch: until one
        # changes no batch can be ready, so a wake-up does not rescan every group.
        self._no_batch_at: tuple[int, int] | None = None
        self._pacer = Pacer(run.group_size) if run.admission == "paced" else None
        self._pending_domain: DomainConfig | None = None
        self._stats_at_end: BufferStats | None = None
        #: the samples of the last training step
        self.last_batch: list[Sample] = []

    # ------------------------------------------------------------------ lifecycle
    def clock(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def start(self) -> None:
        """Start admitting groups (idempotent). Must run inside the event loop."""
        if self._started:
            return
        await self.trainer.set_workers(self.proxy.workers())
        t_align = self.clock()
        await self._align_worker_versions()
        # A resumed run's first weight sync happens here; it is reported with the first step.
        self._align_s = self.clock() - t_align
        self._started = True
        self._changed, self._weights_changed = _Signal(), _Signal()
        self._ctx = TrajectoryContext(
            run=self.run, proxy=self.proxy, envs=self.envs, rewards=self.rewards,
            chat=self._chats, buffer=self.buffer,
            # the loop's own clock, bound once (what ``clock`` reads, minus two calls per read)
            clock=self._clock or asyncio.get_running_loop().time,
            wait_for_weights=self._wait_for_weights,
            barrier=TurnBarrier() if self.spec.turn_barrier else None,
        )
        self._sync = WeightSync(
            self.proxy, self.trainer, self.clock, reprefill=self.run.reprefill,
            on_applied=self._on_applied, on_push_done=self._on_done,
            eager=self.spec.overlap and self.run.weight_apply == "eager",
            waves=self.run.apply_waves,
        )
        self._last_step_end = self._started_at = self.clock()
        self._spawn_aux(self._admission_loop(), "admission")
        self._launch_restarts()
        if self._loop_lag is not None:
            self._loop_lag.start()

    async def _align_worker_versions(self) -> None:
        """Make every worker serve the trainer's version before the first turn (a resumed run
        restarts workers from the base checkpoint: push and apply the trainer's weights)."""
        workers = self.proxy.workers()
        served = [s.version for s in await asyncio.gather(*(w.stats() for w in workers))]
        want = self.trainer.version
        if any(v > want for v in served):
            raise RollartError(
                f"workers serve versions {served}, newer than the trainer's {want}: they hold "
                "weights of another (or a later) run; restart them from the checkpoint the "
                "trainer starts from")
        if any(v < want for v in served):
            log.info("workers serve %s; applying the trainer's version %d", served, want)
            # Paused before the push: a collective broadcast writes into the serving models.
            await self.proxy.pause("keep")
            try:
                await self.trainer.push_weights(want, workers)
                await self.proxy.apply_weights(want, reprefill=False)
            finally:
                await self.proxy.resume()
        self.proxy.version = want

    async def close(self) -> None:
        """Cancel every trajectory and background task and wait for their cleanup."""
        if self._closed:
            return
        self._closed = True
        tasks = [*self._tasks.values(), *self._aux]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sync is not None:
            await self._sync.close()
        if self._loop_lag is not None:
            await self._loop_lag.stop()

    def stop_soon(self) -> None:
        """The owner found a fatal fault outside the controller (e.g. a service process died)
        and is about to close it: failures that follow from that fault are neither reported as
        the run's error nor retried (the owner reports the cause, once)."""
        self._stopping = True

    def remove_worker(self, name: str, why: str) -> int:
        """Take inference worker ``name`` out of its pool (:meth:`LLMProxy.remove_worker`) and
        unregister it at the trainer at once, so that no weight push waits on it. Returns the
        live workers left in its pool (0: its domains cannot generate; the caller decides).
        Idempotent. Raises ConfigError if no worker has that name."""
        left = len(self.proxy.remove_worker(name, why).workers)
        if self._started and left and not self._closed:
            self._spawn_aux(self.trainer.set_workers(self.proxy.workers()), f"unregister-{name}")
        return left

    @property
    def barrier(self) -> TurnBarrier | None:
        return self._ctx.barrier if self._ctx is not None else None

    @property
    def num_running(self) -> int:
        """Trajectory tasks alive now."""
        return len(self._tasks)

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for checkpoint/resume: the buffer's snapshot (between steps: no
        batch outstanding), the domain and seed of every group it holds, the admission RNG."""
        snap = self.buffer.snapshot()
        keys = {g["key"] for g in snap["groups"]}
        return {
            "format": 1,
            "step": self._step,
            "buffer": snap,
            "groups": {k: [self._groups[k][0].name, self._groups[k][1]] for k in sorted(keys)},
            "group_seq": self._group_seq,
            "rng": list(self._rng.getstate()[1]),
        }

    def _restore(self, snap: dict[str, Any]) -> None:
        if snap.get("format") != 1:
            raise RollartError(f"controller snapshot: unknown format {snap.get('format')!r}")
        wanted = self.buffer.snapshot()["config"]  # the scenario's, before the restore
        self.buffer = self._buffer_class.restore(
            snap["buffer"], rng=random.Random(self.run.seed + 1), on_forget=self._forget_group,
            on_drop=self.transcripts.dropped if self.transcripts is not None else None)
        # The restored buffer runs on the snapshot's settings: a scenario edited since (alpha,
        # abort_stale, ...) would be ignored without a word.
        had = {k: getattr(self.buffer, k) for k in wanted}
        changed = [f"{_SCENARIO_FIELD.get(k, 'run.' + k)} (checkpoint {had[k]!r}, scenario "
                   f"{v!r})" for k, v in wanted.items() if had.get(k) != v]
        if changed:
            raise RollartError("controller snapshot was taken with other settings: "
                               f"{', '.join(changed)}; resume with the scenario it was taken with")
        if self.buffer.version != self.trainer.version:
            raise RollartError(
                f"controller snapshot is at version {self.buffer.version}, the trainer at "
                f"{self.trainer.version}"
            )
        for key, (domain, seed) in snap["groups"].items():
            if domain not in self.domains:
                raise RollartError(f"controller snapshot: group {key!r} of unknown domain "
                                   f"{domain!r}")
            self._groups[key] = (self.domains[domain], seed)
        self._group_seq = snap["group_seq"]
        self._step = snap["step"]
        self._rng.setstate((3, tuple(snap["rng"]), None))

    def _forget_group(self, key: str) -> None:
        """The buffer forgot group ``key`` (consumed or retired, no member live): so does the
        controller, so that its per-group state holds only groups in flight."""
        self._groups.pop(key, None)
        self._finished.pop(key, None)
        self._group_failures.pop(key, None)

    # ------------------------------------------------------------------ supervision
    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.notify()

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and self._fatal is None and not self._closed and not self._stopping:
            log.error("fatal error in %s: %s: %s", task.get_name(), type(exc).__name__, exc)
            self._fatal = exc
        self._notify()

    def _spawn_aux(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)
        task.add_done_callback(self._on_done)
        return task

    def _raise_if_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _on_applied(self) -> None:
        if self._pacer is not None:
            self._pacer.on_apply(self.clock())
        assert self._weights_changed is not None
        self._weights_changed.notify()
        self._notify()

    async def _wait_for_weights(self, version: int) -> None:
        assert self._weights_changed is not None
        while self.proxy.version <= version:
            await self._weights_changed.wait()

    # ------------------------------------------------------------------ admission
    def _can_admit(self) -> bool:
        if not self._admission_open or self._closed:
            return False
        if self.spec.one_batch_in_flight:
            per_batch = self.run.batch_size // self.run.group_size
            return self.buffer.groups_in_flight < per_batch
        return True

    def domain_weights(self) -> list[float]:
        """Admission weight of each domain (in ``self.domains`` order).

        ``run.domain_mix = "weight"``: ``domain.weight``. ``"yield"``: ``weight / yield`` with
        ``yield = (trained + G) / (G * resolved + G)``, ``resolved`` = groups started and no
        longer in flight (samples trained per member slot of a finished group, with one group's
        worth of prior so a new domain starts at 1; groups still in flight are left out, or a
        long-horizon domain would look unproductive while its groups run): for trained shares
        proportional to the weights, domain d must be started at a rate proportional to
        ``weight_d / yield_d`` (trained_d = started_d * yield_d).
        """
        domains = list(self.domains.values())
        if self.run.domain_mix == "weight":
            return [d.weight for d in domains]
        counts = self.buffer.domain_counts()
        in_flight = self.buffer.groups_in_flight_by_domain()
        g = self.run.group_size
        out = []
        for d in domains:
            c = counts.get(d.name)
            trained, groups = (c.trained, c.groups_started) if c is not None else (0, 0)
            resolved = max(0, groups - in_flight.get(d.name, 0))
            out.append(d.weight * (g * resolved + g) / (trained + g))
        return out

    def _pick_domain(self) -> DomainConfig:
        domains = list(self.domains.values())
        return self._rng.choices(domains, weights=self.domain_weights())[0]

    def _pace_wait_s(self, domain: DomainConfig) -> float:
        """Paced admission: seconds to hold ``domain``'s next group back (0: start now)."""
        if self._pacer is None:
            return 0.0
        now = self.clock()
        alpha = domain.alpha if domain.alpha is not None else self.run.alpha
        if not self._pacer.should_wait(domain.name, now, self.proxy.version, alpha):
            return 0.0
        period = self._pacer.period_s() or 0.0
        return max(1e-3, period)

    async def _admission_loop(self) -> None:
        assert self._changed is not None and self._weights_changed is not None
        while True:
            started = False
            if self._can_admit() and self.buffer.has_room():
                key = f"g{self._group_seq}"
                # A held-back domain keeps its turn (else pacing would favour short domains).
                domain = self._pending_domain or self._pick_domain()
                self._pending_domain = None
                if self.run.admission == "capacity" and not self.buffer.has_capacity(
                        self.proxy.version, domain.alpha):
                    # Every batch this group could join is already spoken for: wait for a
                    # batch, an apply or a group that fails or goes stale.
                    self._pending_domain = domain
                    await self._changed.wait()
                    continue
                wait_s = self._pace_wait_s(domain)
                if wait_s > 0:
                    self._pending_domain = domain
                    # Until the next apply (or one period, if it does not come).
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._weights_changed.wait(), wait_s)
                    continue
                ids = self.buffer.try_start_group(key, domain.name, domain.alpha)
                if ids is not None:
                    self._group_seq += 1
                    self._groups[key] = (domain, self._rng.randrange(2**31))
                    for tid in ids:
                        self._launch(tid, key)
                    started = True
            if not started:
                await self._changed.wait()

    def _launch(self, tid: str, group_key: str) -> None:
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
        self._on_done(task)

    def _launch_restarts(self) -> None:
        for tid in self.buffer.drain_aborts():
            # Stale mid-generation (abort_stale): stop it now, restart its slot fresh.
            task = self._tasks.get(tid)
            if task is not None:
                self._cancelled.add(tid)
                task.cancel()
            fresh = self.buffer.restart_trajectory(tid)
            if fresh is not None:
                self._launch(fresh, self.buffer.group_of(fresh))
        for tid in self.buffer.drain_restarts():
            self._launch(tid, self.buffer.group_of(tid))

    def _cancel_traj(self, tid: str) -> None:
        # The buffer learns at once (so this step's counters include it); the task then aborts
        # its generation and closes its env session.
        self.buffer.cancel(tid)
        task = self._tasks.get(tid)
        if task is not None:
            self._cancelled.add(tid)
            task.cancel()

    # ------------------------------------------------------------------ one trajectory
    async def _run_one(self, tid: str, key: str) -> None:
        assert self._ctx is not None
        domain, seed = self._groups[key]
        t_start = self.clock()
        try:
            body = self.agents.body_for(domain.name) if self.agents is not None else None
            sample = await (run_trajectory(self._ctx, tid, key, domain, seed) if body is None
                            else run_trajectory(self._ctx, tid, key, domain, seed, body))
            problem = trainable_problem(sample)
            if problem is not None:  # caught here, it costs a retry, not a training step
                raise TrajectoryFailed(INVALID_SAMPLE_REASON, problem, sample.num_generated)
        except TrajectoryFailed as exc:
            log.info("trajectory %s failed: %s", tid, exc)
            self._on_failed(tid, key, exc)
        except TrajectoryStale:
            fresh = self.buffer.restart_trajectory(tid)
            if fresh is not None:
                self._launch(fresh, key)
        except TrajectoryNotNeeded:
            self.buffer.cancel(tid)
        except asyncio.CancelledError:
            if tid in self._cancelled or self._closed or requested_cancel():
                if tid not in self._cancelled:  # shutdown, not a sibling cancel
                    self.buffer.cancel(tid, "shutdown")
                raise
            # Nobody cancelled this task: env / reward / user code raised CancelledError on
            # its own. A failure of this trajectory (counted, retried), not a silent retirement.
            log.warning("trajectory %s: CancelledError raised inside it although nothing "
                        "cancelled it; counted as failure 'unrequested_cancel' and retried", tid)
            self._on_failed(tid, key, TrajectoryFailed(
                "unrequested_cancel", "CancelledError raised by env, reward or user code"))
        else:
            self._failures_in_a_row = 0
            if self.transcripts is not None:
                self.transcripts.finished(sample)
            if self._pacer is not None:
                self._pacer.on_finished(domain.name, self.clock() - t_start)
            for sibling in self.buffer.complete(tid, sample):
                self._cancel_traj(sibling)
            if self.run.selection == "unbiased":
                self._finished[key] += 1
                if self._finished[key] == self.run.group_size:
                    del self._finished[key]
                    self._spawn_aux(self._selection_deadline(key), f"deadline-{key}")
        finally:
            self._cancelled.discard(tid)
            if not self._closed and not self._stopping:
                self._launch_restarts()
            self._notify()

    def _on_failed(self, tid: str, key: str, exc: TrajectoryFailed) -> None:
        """Count a failed trajectory, retry its slot, or give its group up when the group's
        failure budget (``run.retry.max_failures_per_group``) is spent."""
        self._failures_in_a_row += 1
        self._last_failures = [*self._last_failures[-4:], str(exc)]
        if self._failures_in_a_row >= self.run.retry.max_failures_in_a_row:
            raise ControllerStalledError(
                f"{self._failures_in_a_row} trajectory failures in a row "
                f"(run.retry.max_failures_in_a_row); last: {self._last_failures}"
            ) from exc
        retry = self.buffer.fail(tid, exc.reason)
        self._group_failures[key] += 1
        budget = self.run.retry.max_failures_per_group
        if budget is not None and self._group_failures[key] >= budget:
            log.warning("group %s dropped: %d failures (run.retry.max_failures_per_group = %d); "
                        "last: %s", key, self._group_failures[key], budget, exc)
            for other in self.buffer.drop_group(key, "failure_budget"):
                self._cancel_traj(other)
            return
        if retry is not None and not self._stopping:
            self._launch(retry, key)
        elif self.buffer.stats_dropped("attempts_exhausted") > self._exhausted_seen:
            self._exhausted_seen += 1
            log.warning("group %s dropped: a member failed run.retry.max_attempts = %d times; "
                        "last: %s", key, self.run.retry.max_attempts, exc)

    async def _selection_deadline(self, key: str) -> None:
        await asyncio.sleep(self.run.selection_deadline_s)
        for tid in self.buffer.close_group(key):
            self._cancel_traj(tid)
        self._notify()

    # ------------------------------------------------------------------ training side
    async def _get_batch(self) -> list[Sample]:
        assert self._changed is not None
        # The stall watchdog: a batch that does not come says what it waits on (one task per
        # step, not a timer per wake-up: get_batch wakes on every trajectory outcome).
        watchdog = (asyncio.create_task(self._stall_watchdog(), name="stall-watchdog")
                    if self._stall_watchdog_on else None)
        try:
            while True:
                self._raise_if_fatal()
                batch = self._try_take_batch()
                self._launch_restarts()
                if batch is not None:
                    return batch
                if not self._tasks and not (self.buffer.has_room() and self._can_admit()):
                    raise ControllerStalledError(
                        f"no batch can be produced at version {self.buffer.version}: nothing is "
                        f"running and admission is paused ({self.buffer.stats()})"
                    )
                await self._changed.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()

    async def _stall_watchdog(self) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        while True:
            await asyncio.sleep(self.run.stall_log_s)
            log.warning("%s", self.stall_report(loop.time() - t0))

    def stall_report(self, waited_s: float, max_groups: int = 8, max_members: int = 8) -> str:
        """What the training loop's ``get_batch`` waits on: the open groups (oldest first) with
        their kept members, and what each running member is doing and for how long."""
        now = self.clock()
        activity = self._ctx.activity if self._ctx is not None else {}
        groups = self.buffer.open_groups()
        lines = [f"no batch for {waited_s:.0f} s at version {self.buffer.version}: "
                 f"{self.buffer.ready_samples()}/{self.run.batch_size} samples ready, "
                 f"{len(groups)} group(s) collecting, {len(self._tasks)} trajectories running"]
        for key, domain, kept, live in groups[:max_groups]:
            doing = []
            for tid in live[:max_members]:
                act = activity.get(tid)
                doing.append(f"{tid} {act.phase} for {now - act.since:.0f} s" if act is not None
                             else f"{tid} not started")
            more = f", +{len(live) - max_members} more" if len(live) > max_members else ""
            lines.append(f"  group {key} ({domain}): {kept}/{self.run.group_size} kept; "
                         f"{'; '.join(doing) or 'no member running'}{more}")
        if len(groups) > max_groups:
            lines.append(f"  +{len(groups) - max_groups} more group(s)")
        return "\n".join(lines)

    def _try_take_batch(self) -> list[Sample] | None:
        # A batch becomes ready only when a sample is kept or the version advances (held
        # samples only become stale then, and advance_version sweeps them itself), so
        # take_batch, which scans every group, runs once per such change, not per wake-up.
        at = (self.buffer.version, self.buffer.num_kept)
        if at == self._no_batch_at:
            return None
        batch = self.buffer.take_batch()
        self._no_batch_at = at if batch is None else None
        return batch

    async def step(self) -> StepMetrics:
        """Run one training step and return its metrics.

        Raises:
            the first fatal background error (PoolExhaustedError, EnvHostsExhaustedError,
            ControllerStalledError, a bug), or an error of the trainer / weight sync.
        """
        if not self._started:
            await self.start()
        # The previous step's end, so counters between steps (checkpoints) land in this step.
        stats_before = self._stats_at_end or self.buffer.stats()
        tokens_before = self._ctx.generated_tokens if self._ctx else 0
        invalid_actions_before = self._ctx.invalid_actions if self._ctx else 0
        rerouted_before = self.proxy.num_rerouted
        invalid_before = self.proxy.num_invalid_replies
        quarantined_before = len(self.proxy.quarantined)
        t0 = self.clock()
        batch = self._screen(await self._get_batch())
        self.last_batch = batch
        t_batch = self.clock()
        version = self.buffer.version
        if self._pacer is not None:
            self._pacer.on_batch(t_batch, version)
        self._admission_open = False
        assert self._sync is not None
        try:
            if self.spec.overlap:
                sync_total, sync_exposed = await self._sync.apply_newest()
                self._admission_open = True  # rollout goes on while the trainer trains
                self._notify()
                result, train_s = await self._train(batch, version)
                self._sync.start_push(result.version)
            else:
                pause_s = await self._sync.pause()
                result, train_s = await self._train(batch, version)
                # Nothing overlaps in these modes: the whole sync is exposed.
                sync_total = sync_exposed = pause_s + await self._sync.push_apply_resume(
                    result.version
                )
        finally:
            self._admission_open = True
            self._notify()
        if result.dropped:
            batch = self.last_batch = [s for s in batch if s.sample_id not in result.dropped]
        t_end = self.clock()
        self._step += 1
        lag = self._loop_lag.take() if self._loop_lag is not None else None
        self._stats_at_end = stats_after = self.buffer.stats()
        metrics = step_metrics(
            step=self._step,
            mode=self.run.mode,
            policy_version=result.version,
            batch=batch,
            before=stats_before,
            after=stats_after,
            step_time_s=t_end - self._last_step_end,
            trainer_idle_s=t_batch - t0,
            train_time_s=train_s,
            weight_sync_total_s=sync_total + self._align_s,
            weight_sync_exposed_s=sync_exposed + self._align_s,
            num_generated_tokens=(self._ctx.generated_tokens if self._ctx else 0) - tokens_before,
            num_rerouted=self.proxy.num_rerouted - rerouted_before,
            train_metrics=result.metrics,
            # Samples restored from a checkpoint started before this process did.
            rollout_not_before=self._started_at,
            loop_lag_p99_ms=lag.p99_ms if lag is not None else None,
            loop_lag_max_ms=lag.max_ms if lag is not None else None,
            num_invalid_actions=(self._ctx.invalid_actions if self._ctx else 0)
            - invalid_actions_before,
        )
        metrics.num_invalid_replies = self.proxy.num_invalid_replies - invalid_before
        agreement = by_worker(batch, result.agreement)
        metrics.logprob_mismatch_by_worker = {
            k: round(w.logprob_mismatch, 6) for k, w in agreement.items()}
        metrics.iw_capped_fraction_by_worker = {
            k: round(w.iw_capped_fraction, 6) for k, w in agreement.items()}
        metrics.disagreeing_workers = sorted(self._act_on_disagreement(agreement))
        metrics.quarantined_workers = self.proxy.quarantined[quarantined_before:]
        self._align_s = 0.0
        self._last_step_end = t_end
        if self.transcripts is not None:
            self.transcripts.step(self._step, batch)  # decoded and written on its own thread
        return metrics

    def _act_on_disagreement(self, agreement: dict[str, WorkerAgreement]) -> dict[str, str]:
        """Apply ``run.worker_checks.agreement_policy`` to the workers whose tokens disagree
        with the trainer (see ``rollart.controller.agreement``); returns them -> why.

        Raises:
            WorkerDisagreementError: policy ``stop``.
            PoolExhaustedError: policy ``quarantine`` emptied a pool.
        """
        cfg = self.run.worker_checks
        bad = offenders(agreement, cfg)
        for name, why in bad.items():
            log.warning("step %d: worker %s disagrees with the trainer: %s (policy %s)",
                        self._step, name, why, cfg.agreement_policy)
        if bad and cfg.agreement_policy == "stop":
            raise WorkerDisagreementError(
                f"step {self._step}: engine/trainer disagreement on worker(s) "
                f"{sorted(bad)}: {bad} (run.worker_checks.agreement_policy = 'stop')")
        if cfg.agreement_policy == "quarantine":
            for name in bad:
                if name != UNKNOWN_WORKER:
                    self.proxy.quarantine(name, f"disagrees with the trainer: {bad[name]}")
        return bad

    def _screen(self, batch: list[Sample]) -> list[Sample]:
        """The train path's last check: a sample the trainer would refuse is dropped from the
        batch (counted as dropped / wasted ``invalid_sample``), never the whole batch.

        Raises:
            RollartError: no sample of the batch is usable.
        """
        kept = []
        for s in batch:
            problem = trainable_problem(s)
            if problem is None:
                kept.append(s)
                continue
            log.warning("batch at version %d: dropped sample %s (%s)", self.buffer.version,
                        s.sample_id, problem)
            self.buffer.drop_consumed(s.sample_id, INVALID_SAMPLE_REASON)
        if not kept:
            raise RollartError(f"no sample of the batch at version {self.buffer.version} can "
                               "be trained on (see the dropped samples above)")
        return kept

    async def _train(self, batch: list[Sample], version: int) -> tuple[TrainResult, float]:
        t0 = self.clock()
        result = await self.trainer.train(batch)
        if result.version != version + 1:
            raise RollartError(
                f"trainer returned version {result.version} after training at {version}"
            )
        for sid, why in result.dropped.items():  # the trainer's own last check
            log.warning("batch at version %d: the trainer dropped sample %s (%s)", version,
                        sid, why)
            self.buffer.drop_consumed(sid, INVALID_SAMPLE_REASON)
        self.buffer.advance_version()
        self._launch_restarts()
        return result, self.clock() - t0
