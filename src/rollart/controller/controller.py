"""The asyncio controller: admission of groups, trajectory tasks, and the training loop.

One :class:`Controller` wires the LLM proxy, env and reward routers, the
:class:`~rollart.controller.buffer.core.SampleBuffer` (pure state machine, driven from here) and the
trainer. Background work:

- the *admission loop* starts GRPO groups whenever the buffer's in-flight bound allows (and, in
  ``sync`` / ``sync_plus`` / ``one_off``, while at most one batch of groups is in flight), mixing
  domains by weight with a seeded RNG; each group gets one env seed shared by its members;
- one task per trajectory (:func:`~rollart.controller.rollout.trajectory.run_trajectory`) whose outcome
  becomes a buffer call (complete / fail -> retry / restart / cancel); siblings the buffer asks
  to cancel are cancelled (aborting generation, closing the env session);
- the weight push of the newest version (trainer -> workers, staged), overlapping rollout;
  with ``run.weight_apply = "eager"`` it is applied as soon as it is staged, in waves.

Staleness policies (``rollart.config.RunConfig``; all keep the bound strict): ``admission``
``greedy`` (any free slot), ``capacity`` (a group starts only if some batch it could still
join has room: ``SampleBuffer.has_capacity``) or ``paced`` (``rollart.controller.rollout.pacing``);
``domain_mix`` ``weight`` or ``yield`` (see :meth:`Controller.domain_weights`); ``fresh_start``
and ``abort_stale`` (``SampleBuffer``); ``DomainConfig.alpha`` per-domain bounds. A domain
held back by admission keeps its turn, so waiting never favours short domains.

:meth:`Controller.step` is one training step, per the paper's protocol (§6.2): get batch ->
pause generation -> apply the newest weights -> resume -> train (overlap modes; rollout keeps
going during training), or get batch -> pause -> train -> apply the new weights -> resume (no
overlap). A background task that raises anything but a per-trajectory outcome is *fatal*: it is
re-raised by the next (or the pending) ``step`` call, never left to hang.

Time is ``loop.time()`` unless a ``clock`` is injected, so a simulator's virtual clock works.

This module wires the parts, starts and closes them and supervises the background tasks; the
parts are plain functions over the controller's state in their own modules: ``admission``
(the admission loop), ``trajtasks`` (trajectory tasks and their outcomes), ``trainstep`` (a
training step), ``stall`` (the stall error and watchdog) and ``controllersnapshot``
(checkpoint format).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

from rollart.config import DomainConfig, Scenario
from rollart.controller import snapshot as controllersnapshot
from rollart.controller.agents.runner import AgentRunner
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.buffer.sample import BufferStats, Sample
from rollart.controller.modes import TurnBarrier, mode_spec
from rollart.controller.observe import stall
from rollart.controller.observe.loophealth import LoopLagMonitor
from rollart.controller.observe.metrics import StepMetrics
from rollart.controller.observe.stall import ControllerStalledError
from rollart.controller.observe.transcripts import TranscriptRecorder
from rollart.controller.ports import Tokenizer, TrainerBackend
from rollart.controller.rollout import admission
from rollart.controller.rollout.pacing import Pacer
from rollart.controller.rollout.tasks import launch_restarts
from rollart.controller.rollout.tokens import ChatTokens
from rollart.controller.rollout.trajectory import TrajectoryContext
from rollart.controller.routing.proxy import LLMProxy
from rollart.controller.routing.routers import EnvRouter, RewardRouter
from rollart.controller.routing.workercheck import ViolationWindow
from rollart.controller.training import step as trainstep
from rollart.controller.training.weightsync import WeightSync
from rollart.transport.errors import RollartError

__all__ = ["Controller", "ControllerStalledError"]

log = logging.getLogger(__name__)


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
            (``rollart.controller.observe.transcripts``); ``None``: no transcripts.
        buffer_class: the sample buffer's class: ``SampleBuffer`` or a subclass overriding its
            admission (``try_start_group`` / ``has_room``) or batch assembly
            (``assemble_batch`` / ``batch_order``)
            while keeping its protocol (``rollart.controller.buffer.core``); built with the same
            keyword arguments and restored with its ``restore`` classmethod.
        agents: trajectory bodies of agent domains (``cluster.agent``); ``None``: none.
        stall_watchdog: log what ``get_batch`` waits on every ``run.stall_log_s`` (simulators
            on a virtual clock turn it off: its timer would hide a deadlock from the clock's
            idle detection).
        check: where the staleness bound is checked, overriding the mode's (``per_turn`` or
            ``admission``; the simulator compares the two on one mode); ``None``: the mode's.

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
        check: Literal["per_turn", "admission"] | None = None,
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
        proxy.hang.probe_timeout_s = run.worker_checks.hang_probe_timeout_s
        self._rng = random.Random(run.seed)
        self.transcripts = transcripts
        self._buffer_class = buffer_class
        self.buffer = buffer_class(
            alpha=run.alpha,
            batch_size=run.batch_size,
            group_size=run.group_size,
            redundancy=run.redundancy,
            selection=run.selection,
            check=check if check is not None else self.spec.check,
            on_stale=run.on_stale,
            max_attempts=run.retry.max_attempts,
            max_group_attempts=run.max_group_attempts,
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
        # the buffer's counters at the last step's end: the next step's metrics are deltas
        # from them (a restore sets them to the carried-over counters)
        self._stats_at_end: BufferStats | None = None
        if resume is not None:
            controllersnapshot.restore(self, resume)
            # not part of the checkpoint's settings: the scenario's limit applies
            self.buffer.max_group_attempts = run.max_group_attempts
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
        #: per open group, its ``run.group_timeout_s`` timer (``admission.arm_group_timeout``)
        self._group_timers: dict[str, asyncio.TimerHandle] = {}
        self._exhausted_seen = self._attempts_seen = 0
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
        #: when generate timeouts under overload began, with no trajectory finishing since
        #: (``trajtasks.on_failed``); ``None``: not overloaded
        self._overload_since: float | None = None
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
        if self._stats_at_end is None:
            # Step 1's counters are deltas from here: rollout before the first step() call
            # (the owner awaiting something else, e.g. a held-out evaluation) counts in it.
            self._stats_at_end = self.buffer.stats()
        self._spawn_aux(admission.admission_loop(self), "admission")
        launch_restarts(self)
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
        for timer in self._group_timers.values():
            timer.cancel()
        tasks = [*self._tasks.values(), *self._aux]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._ctx is not None and self._ctx.closing:
            # A trajectory cancelled here while closing its env session ends at once; its
            # shielded close goes on (each bounded by CLOSE_TIMEOUT_S) and must end before the
            # owner closes the env clients under it (else: "client closed", a warning each).
            # asyncio.wait, not gather: if close() is itself cancelled, the closes go on.
            await asyncio.wait(list(self._ctx.closing))
        if self._sync is not None:
            await self._sync.close()
        if self._loop_lag is not None:
            await self._loop_lag.stop()

    def stop_soon(self) -> None:
        """The owner found a fatal fault outside the controller (e.g. a service process died)
        and is about to close it: failures that follow from that fault are neither reported as
        the run's error nor retried (the owner reports the cause, once)."""
        self._stopping = True
        self.proxy.stopping = True

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
        return controllersnapshot.snapshot(self)

    def _forget_group(self, key: str) -> None:
        """The buffer forgot group ``key`` (consumed or retired, no member live): so does the
        controller, so that its per-group state holds only groups in flight."""
        self._groups.pop(key, None)
        self._finished.pop(key, None)
        self._group_failures.pop(key, None)
        timer = self._group_timers.pop(key, None)
        if timer is not None:
            timer.cancel()

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

    # ------------------------------------------------------------------ admission, training
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
        return admission.domain_weights(self)

    def stall_report(self, waited_s: float, max_groups: int = 8, max_members: int = 8) -> str:
        """What the training loop's ``get_batch`` waits on: the open groups (oldest first) with
        their kept members, and what each running member is doing and for how long."""
        return stall.stall_report(self, waited_s, max_groups, max_members)

    async def step(self) -> StepMetrics:
        """Run one training step and return its metrics.

        Raises:
            the first fatal background error (PoolExhaustedError, EnvHostsExhaustedError,
            ControllerStalledError, a bug), or an error of the trainer / weight sync.
        """
        return await trainstep.step(self)
