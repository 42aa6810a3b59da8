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
  with ``run.weight_apply = "eager"`` (the default in overlap modes) it is applied as soon as it
  is staged, in waves.

Staleness policies (``rollart.config.RunConfig``, whose docstring names the default; all keep
the bound strict): ``admission``
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

This module wires the parts, starts and closes them; each part owns its state:
:class:`~rollart.controller.rollout.admission.Admission` (the admission loop, group timeouts,
the admission RNG), :class:`~rollart.controller.rollout.admitted.AdmittedGroups` (each group's
domain and env seed), :class:`~rollart.controller.rollout.tasks.TrajectoryTasks` (trajectory
tasks, their outcomes, the supervision of background tasks),
:class:`~rollart.controller.training.step.StepRunner` (a training step) with its
:class:`~rollart.controller.observe.stepcounters.StepCounters` (the step's counting), and
:class:`~rollart.controller.observe.stall.StallWatchdog`; ``rollart.controller.snapshot`` has
the checkpoint format.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable, Iterable
from typing import Any, Literal

import msgspec

from rollart.config import DomainConfig, Scenario
from rollart.controller import snapshot as controllersnapshot
from rollart.controller.agents.runner import AgentRunner
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.buffer.sample import Sample
from rollart.controller.modes import TurnBarrier, mode_spec
from rollart.controller.observe.loophealth import LoopLagMonitor
from rollart.controller.observe.metrics import StepMetrics
from rollart.controller.observe.stall import ControllerStalledError, StallWatchdog
from rollart.controller.observe.stepcounters import StepCounters
from rollart.controller.observe.transcripts import TranscriptRecorder
from rollart.controller.ports import Tokenizer, TrainerBackend
from rollart.controller.rollout.admission import Admission
from rollart.controller.rollout.admitted import AdmittedGroups
from rollart.controller.rollout.pacing import Pacer
from rollart.controller.rollout.tasks import Signal, TrajectoryTasks
from rollart.controller.rollout.tokens import ChatTokens
from rollart.controller.rollout.trajectory import TrajectoryContext
from rollart.controller.routing.proxy import LLMProxy
from rollart.controller.routing.routers import EnvRouter, RewardRouter
from rollart.controller.routing.workercheck import ViolationWindow
from rollart.controller.training.step import StepRunner
from rollart.controller.training.weightsync import WeightSync
from rollart.transport.errors import ConfigError, RollartError

__all__ = ["Controller", "ControllerStalledError"]

log = logging.getLogger(__name__)


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
        RollartError: a ``resume`` snapshot of an unknown format, other settings, another
            version than the trainer's, or a group of a domain the scenario lacks.

    Its parts (read them; the controller wires and drives them): ``buffer``, ``groups``
    (:class:`AdmittedGroups`), ``tasks`` (:class:`TrajectoryTasks`), ``admission``
    (:class:`Admission`), ``steps`` (:class:`StepRunner`, its ``counters``) and ``watchdog``
    (:class:`StallWatchdog`).
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
        self.scenario, self.run = scenario, run
        self.spec = spec = mode_spec(run.mode)
        self.proxy, self.envs, self.rewards, self.trainer = proxy, envs, rewards, trainer
        #: agent domains' trajectory bodies (``rollart.controller.agents``); the owner starts
        #: and closes its endpoint
        self.agents = agents
        if proxy.violations is None:  # the scenario's quarantine rule for bad worker output
            wc = run.worker_checks
            proxy.violations = ViolationWindow(wc.max_invalid_replies, wc.invalid_window)
        proxy.hang.probe_timeout_s = run.worker_checks.hang_probe_timeout_s
        proxy.hang.max_overload_s = run.retry.max_overload_s  # a pool's last worker, hung
        self.transcripts = transcripts
        on_drop = transcripts.dropped if transcripts is not None else None
        check = check if check is not None else spec.check
        # Unset, the hold applies where a version bump makes running groups stale: not under
        # a check override to "admission" (a simulator ablation), which SampleBuffer refuses.
        hold = (run.hold_batch_for_groups if run.hold_batch_for_groups is not None
                else run.effective_hold_batch and check == "per_turn")
        self.buffer = buffer_class(
            alpha=run.alpha,
            batch_size=run.batch_size,
            group_size=run.group_size,
            redundancy=run.redundancy,
            selection=run.selection,
            check=check,
            on_stale=run.on_stale,
            max_attempts=run.retry.max_attempts,
            max_group_attempts=run.max_group_attempts,
            initial_version=trainer.version,
            rng=random.Random(run.seed + 1),
            on_forget=self._forget_group,
            on_drop=on_drop,
            fresh_start=run.effective_fresh_start,
            abort_stale=run.abort_stale,
            staleness_control=spec.staleness_control,
            hold_for_groups=hold,
            readmit_stale_groups=run.admission == "capacity",
        )
        self.domains: dict[str, DomainConfig] = {d.name: d for d in scenario.domains}
        if resume is not None:
            self.buffer = controllersnapshot.restore_buffer(
                resume, scenario_buffer=self.buffer, buffer_class=buffer_class, seed=run.seed,
                trainer_version=trainer.version, on_forget=self._forget_group,
                on_drop=on_drop)
        self._clock = clock
        self._loop_lag = loop_lag
        pacer = Pacer(run.group_size) if run.admission == "paced" else None
        self._pacer = pacer
        #: the groups in flight: each one's domain and env seed
        self.groups = AdmittedGroups(self.domains)
        #: the trajectory tasks and the supervision of every background task
        self.tasks = TrajectoryTasks(run, self.buffer, self.groups, clock=self.clock,
                                     transcripts=transcripts, agents=agents, pacer=pacer)
        self._weights_changed = Signal()
        #: the admission loop
        self.admission = Admission(
            run, spec, self.domains, buffer=self.buffer, proxy=proxy, tasks=self.tasks,
            groups=self.groups, weights_changed=self._weights_changed, clock=self.clock,
            pacer=pacer)
        self._sync = WeightSync(
            proxy, trainer, self.clock, reprefill=run.reprefill,
            on_applied=self._on_applied, on_push_done=self.tasks.supervise,
            eager=spec.overlap and run.effective_weight_apply == "eager",
            waves=run.apply_waves,
        )
        #: what a slow batch waits on (``stall_report``)
        self.watchdog = StallWatchdog(run, self.buffer, self.tasks, self.clock)
        #: the training step
        self.steps = StepRunner(
            run, spec, buffer=self.buffer, proxy=proxy, trainer=trainer, tasks=self.tasks,
            admission=self.admission, sync=self._sync,
            counters=StepCounters(self.buffer, proxy, self.clock, loop_lag),
            clock=self.clock, watchdog=self.watchdog if stall_watchdog else None,
            pacer=pacer, transcripts=transcripts)
        if resume is not None:
            controllersnapshot.restore_parts(resume, self.admission, self.steps)
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
        self._chats = chats
        self._ctx: TrajectoryContext | None = None
        self._started = False

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
        align_s = self.clock() - t_align
        self._started = True
        self._ctx = ctx = TrajectoryContext(
            run=self.run, proxy=self.proxy, envs=self.envs, rewards=self.rewards,
            chat=self._chats, buffer=self.buffer,
            # the loop's own clock, bound once (what ``clock`` reads, minus two calls per read)
            clock=self._clock or asyncio.get_running_loop().time,
            wait_for_weights=self._wait_for_weights,
            barrier=TurnBarrier() if self.spec.turn_barrier else None,
        )
        self.tasks.start(ctx)
        self.steps.counters.start(ctx, align_s)
        self.tasks.spawn(self.admission.loop(), "admission")
        self.tasks.launch_restarts()
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
        if self.tasks.closed:
            return
        self.admission.close()
        await self.tasks.close()
        if self._ctx is not None and self._ctx.closing:
            # A trajectory cancelled here while closing its env session ends at once; its
            # shielded close goes on (each bounded by CLOSE_TIMEOUT_S) and must end before the
            # owner closes the env clients under it (else: "client closed", a warning each).
            # asyncio.wait, not gather: if close() is itself cancelled, the closes go on.
            await asyncio.wait(list(self._ctx.closing))
        await self._sync.close()
        if self._loop_lag is not None:
            await self._loop_lag.stop()

    def stop_soon(self) -> None:
        """The owner found a fatal fault outside the controller (e.g. a service process died)
        and is about to close it: failures that follow from that fault are neither reported as
        the run's error nor retried (the owner reports the cause, once)."""
        self.tasks.stop_soon()
        self.proxy.stopping = True

    def remove_worker(self, name: str, why: str) -> int:
        """Take inference worker ``name`` out of its pool (:meth:`LLMProxy.remove_worker`) and
        unregister it at the trainer at once, so that no weight push waits on it. Returns the
        live workers left in its pool (0: its domains cannot generate; the caller decides).
        Idempotent. Raises ConfigError if no worker has that name."""
        left = len(self.proxy.remove_worker(name, why).workers)
        if self._started and left and not self.tasks.closed:
            self.tasks.spawn(self.trainer.set_workers(self.proxy.workers()), f"unregister-{name}")
        return left

    @property
    def step_index(self) -> int:
        """Training steps done so far (a resumed run counts its checkpoint's steps too)."""
        return self.steps.step_index

    @property
    def trajectory_context(self) -> TrajectoryContext | None:
        """What every trajectory of this controller runs with (``None`` until :meth:`start`)."""
        return self._ctx

    @property
    def chats(self) -> dict[str, ChatTokens]:
        """Domain name -> its chat template over the policy's tokenizer (not to be changed)."""
        return self._chats

    @property
    def last_batch(self) -> list[Sample]:
        """The samples of the last training step."""
        return self.steps.last_batch

    @property
    def barrier(self) -> TurnBarrier | None:
        return self._ctx.barrier if self._ctx is not None else None

    @property
    def num_running(self) -> int:
        """Trajectory tasks alive now."""
        return self.tasks.num_running

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state for checkpoint/resume: the buffer's snapshot (between steps: no
        batch outstanding), the domain and seed of every group it holds, the admission RNG."""
        return controllersnapshot.snapshot(self.buffer, self.admission, self.steps)

    def _forget_group(self, key: str) -> None:
        """The buffer forgot group ``key`` (consumed or retired, no member live): so does the
        controller, so that its per-group state holds only groups in flight."""
        self.groups.forget(key)
        self.tasks.forget(key)
        self.admission.forget(key)

    # ------------------------------------------------------------------ weights
    def _on_applied(self) -> None:
        if self._pacer is not None:
            self._pacer.on_apply(self.clock())
        self._weights_changed.notify()
        self.tasks.notify()

    async def _wait_for_weights(self, version: int) -> None:
        while self.proxy.version <= version:
            await self._weights_changed.wait()

    # ------------------------------------------------------------------ admission, training
    async def apply_newest_weights(self) -> None:
        """Bring every worker to the trainer's newest version now, as the next step would
        before its batch (an overlapping mode's push still running is awaited, then applied);
        the final held-out evaluation then measures the policy the run trained. Raises what a
        step's weight sync raises (a failed push or apply: fatal)."""
        await self.steps.apply_newest_weights()

    def set_domain_weight(self, domain: str, weight: float) -> None:
        """Change ``domain``'s relative admission weight (``domains.weight``) from its next
        group on; groups in flight are untouched. Raises ConfigError for an unknown domain or
        a weight that is not a finite number > 0."""
        check_domain_weight(domain, weight, self.domains)
        # The dict is shared with admission, which reads it per group.
        self.domains[domain] = msgspec.structs.replace(self.domains[domain],
                                                       weight=float(weight))

    def domain_weights(self) -> list[float]:
        """Admission weight of each domain (in ``self.domains`` order).

        ``run.domain_mix = "weight"``: ``domain.weight``. ``"yield"``: ``weight / yield`` with
        ``yield = (trained + G) / (G * resolved + G)``, ``resolved`` = groups started and no
        longer in flight (samples trained per member slot of a finished group, with one group's
        worth of prior so a new domain starts at 1; groups still in flight are left out, or a
        long-horizon domain would look unproductive while its groups run): for trained shares
        proportional to the weights, domain d must be started at a rate proportional to
        ``weight_d / yield_d`` (trained_d = started_d * yield_d). The factor ``1 / yield`` is
        capped at ``rollout.admission.MAX_YIELD_BOOST`` (4): a domain whose groups keep failing
        is not started ever more often at the expense of the others.
        """
        return self.admission.domain_weights()

    def stall_report(self, waited_s: float, max_groups: int = 8, max_members: int = 8) -> str:
        """What the training loop's ``get_batch`` waits on: the open groups (oldest first) with
        their kept members, and what each running member is doing and for how long."""
        return self.watchdog.report(waited_s, max_groups, max_members)

    async def step(self) -> StepMetrics:
        """Run one training step and return its metrics.

        Raises:
            the first fatal background error (PoolExhaustedError, EnvHostsExhaustedError,
            ControllerStalledError, a bug), or an error of the trainer / weight sync.
        """
        if not self._started:
            await self.start()
        return await self.steps.step()


def check_domain_weight(domain: str, weight: float, names: Iterable[str]) -> None:
    """Raise ConfigError unless ``domain`` is among ``names`` and ``weight`` is a finite
    number > 0 (``set_domain_weight``'s arguments)."""
    names = list(names)
    if domain not in names:
        raise ConfigError(f"set_domain_weight: unknown domain {domain!r}; "
                          f"domains: {sorted(names)}")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
            math.isfinite(weight) and weight > 0):
        raise ConfigError(f"set_domain_weight: weight of {domain!r} must be a finite "
                          f"number > 0, got {weight!r}")
