"""One training step of the controller, per the paper's protocol (§6.2).

:meth:`StepRunner.step`: get a batch (waking on every trajectory outcome, with the stall
watchdog running), screen it (a sample the trainer would refuse is dropped, not the batch),
then pause generation -> apply the newest weights -> resume -> train (overlap modes; rollout
keeps going during training), or pause -> train -> apply the new weights -> resume (no
overlap); act on workers whose tokens disagree with the trainer. The step's counting is the
:class:`~rollart.controller.observe.stepcounters.StepCounters`'.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from rollart.config import RunConfig
from rollart.controller.buffer.sample import Sample
from rollart.controller.modes import ModeSpec
from rollart.controller.observe.metrics import StepMetrics
from rollart.controller.observe.stall import ControllerStalledError, StallWatchdog
from rollart.controller.observe.stepcounters import StepCounters
from rollart.controller.ports import TrainerBackend, TrainResult
from rollart.controller.rollout.admission import Admission
from rollart.controller.rollout.tasks import TrajectoryTasks
from rollart.controller.training.agreement import (
    UNKNOWN_WORKER,
    WorkerAgreement,
    WorkerDisagreementError,
    by_worker,
    offenders,
)
from rollart.controller.training.remote import INVALID_SAMPLE_REASON, trainable_problem
from rollart.controller.training.weightsync import WeightSync
from rollart.transport.errors import RollartError

if TYPE_CHECKING:
    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.observe.transcripts import TranscriptRecorder
    from rollart.controller.rollout.pacing import Pacer
    from rollart.controller.routing.proxy import LLMProxy

log = logging.getLogger(__name__)


class StepRunner:
    """Runs training steps (module docstring).

    Args:
        run, spec: the scenario's run settings and the mode's switches (``overlap``).
        buffer: the sample buffer batches come from.
        proxy: the LLM proxy (workers disagreeing with the trainer are quarantined there).
        trainer: the trainer port.
        tasks: the trajectory tasks (restarts the buffer queues, fatal errors, wake-ups).
        admission: closed while weights are applied.
        sync: the weight sync between trainer and workers.
        counters: the step's counting.
        clock: monotonic seconds.
        watchdog: logs what a slow batch waits on; ``None``: off.
        pacer: paced admission's pacer (told of each batch); ``None``: not paced.
        transcripts: told of every trained batch; ``None``: no transcripts.
    """

    def __init__(self, run: RunConfig, spec: ModeSpec, *, buffer: SampleBuffer, proxy: LLMProxy,
                 trainer: TrainerBackend, tasks: TrajectoryTasks, admission: Admission,
                 sync: WeightSync, counters: StepCounters, clock: Callable[[], float],
                 watchdog: StallWatchdog | None = None, pacer: Pacer | None = None,
                 transcripts: TranscriptRecorder | None = None) -> None:
        self.run, self.spec, self.buffer, self.proxy, self.trainer = (
            run, spec, buffer, proxy, trainer)
        self.tasks, self.admission, self.sync, self.counters = tasks, admission, sync, counters
        self.clock, self.watchdog, self.pacer, self.transcripts = (
            clock, watchdog, pacer, transcripts)
        self._step = 0
        # (version, kept-sample count) at the last take_batch that found no batch: until one
        # changes no batch can be ready, so a wake-up does not rescan every group.
        self._no_batch_at: tuple[int, int] | None = None
        #: the samples of the last training step
        self.last_batch: list[Sample] = []

    @property
    def step_index(self) -> int:
        """Training steps done (a resumed run counts its checkpoint's)."""
        return self._step

    def restore(self, step_index: int) -> None:
        """Continue counting steps from a checkpoint's ``step_index``."""
        self._step = step_index

    async def apply_newest_weights(self) -> None:
        """``Controller.apply_newest_weights`` (its docstring)."""
        if not self.spec.overlap:  # these modes apply right after training
            return
        self.admission.pause()
        try:
            await self.sync.apply_newest()
        finally:
            self.admission.resume()

    async def step(self) -> StepMetrics:
        """``Controller.step`` (its docstring)."""
        start = self.counters.begin()
        batch = self.last_batch = self._screen(await self._get_batch())
        t_batch = self.clock()
        version = self.buffer.version
        if self.pacer is not None:
            self.pacer.on_batch(t_batch, version)
        self.admission.pause()
        try:
            if self.spec.overlap:
                sync_total, sync_exposed = await self.sync.apply_newest()
                self.admission.resume()  # rollout goes on while the trainer trains
                result, train_s = await self._train(batch, version)
                self.sync.start_push(result.version)
            else:
                pause_s = await self.sync.pause()
                result, train_s = await self._train(batch, version)
                # Nothing overlaps in these modes: the whole sync is exposed.
                sync_total = sync_exposed = pause_s + await self.sync.push_apply_resume(
                    result.version)
        finally:
            self.admission.resume()
        if result.dropped:
            batch = self.last_batch = [s for s in batch if s.sample_id not in result.dropped]
        t_end = self.clock()
        self._step += 1
        metrics = self.counters.metrics(
            start, step=self._step, mode=self.run.mode, policy_version=result.version,
            batch=batch, t_batch=t_batch, t_end=t_end, train_s=train_s,
            sync_total_s=sync_total, sync_exposed_s=sync_exposed,
            train_metrics=result.metrics)
        agreement = by_worker(batch, result.agreement, self.run.worker_checks.min_current_tokens)
        _record_agreement(metrics, agreement)
        metrics.disagreeing_workers = sorted(self._act_on_disagreement(agreement))
        self.counters.end(metrics, start, t_end)
        if self.transcripts is not None:
            self.transcripts.step(self._step, batch)  # decoded and written on its own thread
        return metrics

    async def _get_batch(self) -> list[Sample]:
        tasks, buffer = self.tasks, self.buffer
        # The stall watchdog: a batch that does not come says what it waits on (one task per
        # step, not a timer per wake-up: get_batch wakes on every trajectory outcome).
        watchdog = (asyncio.create_task(self.watchdog.watch(), name="stall-watchdog")
                    if self.watchdog is not None else None)
        # run.hold_batch_for_groups: when this step's batch was first held; past
        # run.hold_batch_max_s it goes ahead (a hung group must not stall training).
        held_since: float | None = None
        # Set once, by the timer or the clock: a timer may fire up to the loop's clock
        # resolution before its deadline, so re-reading the clock alone could find the bound
        # not yet passed and wait again on a timer due at once, forever (virtual time never
        # advances while a timer is ready).
        released = False
        try:
            while True:
                tasks.raise_if_fatal()
                batch = self._try_take_batch(hold=not released)
                tasks.launch_restarts()
                if batch is not None:
                    return batch
                if buffer.holding and not released:
                    # A group the batch would make stale is still generating: wait for it,
                    # up to the bound (a timer, as nothing may change before it passes).
                    if held_since is None:
                        held_since = self.clock()
                    left = held_since + self.run.hold_batch_max_s - self.clock()
                    try:
                        if left <= 0:
                            raise TimeoutError
                        await asyncio.wait_for(tasks.changed.wait(), left)
                    except TimeoutError:
                        released = True
                        log.info("batch at version %d: held %.1f s for a group still "
                                 "generating (run.hold_batch_max_s); it goes ahead",
                                 buffer.version, self.run.hold_batch_max_s)
                    continue
                if not tasks.num_running and not (buffer.has_room()
                                                  and self.admission.can_admit()):
                    raise ControllerStalledError(
                        f"no batch can be produced at version {buffer.version}: nothing is "
                        f"running and admission is paused ({buffer.stats()})"
                    )
                await tasks.changed.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()

    def _try_take_batch(self, hold: bool = True) -> list[Sample] | None:
        # A batch becomes ready only when a sample is kept or the version advances (held
        # samples only become stale then, and advance_version sweeps them itself), so
        # take_batch, which scans every group, runs once per such change, not per wake-up.
        # A held batch is not cached: the group it waits for may leave without a sample kept
        # (dropped, given up), and the hold's bound must reach take_batch.
        at = (self.buffer.version, self.buffer.num_kept)
        if at == self._no_batch_at and hold:
            return None
        # take_batch() when holding: a buffer policy overriding it without `hold` still works
        batch = self.buffer.take_batch() if hold else self.buffer.take_batch(hold=False)
        self._no_batch_at = at if batch is None and not self.buffer.holding else None
        return batch

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
        self.tasks.launch_restarts()
        return result, self.clock() - t0

    def _act_on_disagreement(self, agreement: dict[str, WorkerAgreement]) -> dict[str, str]:
        """Apply ``run.worker_checks.agreement_policy`` to the workers whose tokens disagree
        with the trainer (see ``rollart.controller.training.agreement``); returns them -> why.

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


def _record_agreement(metrics: StepMetrics, agreement: dict[str, WorkerAgreement]) -> None:
    metrics.logprob_mismatch_by_worker = {
        k: round(w.logprob_mismatch, 6) for k, w in agreement.items()}
    metrics.iw_capped_fraction_by_worker = {
        k: round(w.iw_capped_fraction, 6) for k, w in agreement.items()}
    metrics.agreement_tokens_by_worker = {k: w.num_tokens for k, w in agreement.items()}
    metrics.agreement_basis_by_worker = {k: w.basis for k, w in agreement.items()}
