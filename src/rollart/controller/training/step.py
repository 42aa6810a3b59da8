"""One training step of the controller, per the paper's protocol (§6.2).

Get a batch (waking on every trajectory outcome, with the stall watchdog running), screen it
(a sample the trainer would refuse is dropped, not the batch), then pause generation -> apply
the newest weights -> resume -> train (overlap modes; rollout keeps going during training), or
pause -> train -> apply the new weights -> resume (no overlap); act on workers whose tokens
disagree with the trainer; report the step's metrics. Plain functions over the
:class:`~rollart.controller.controller.Controller`'s state; ``Controller.step`` runs
:func:`step`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from rollart.controller.buffer.sample import Sample
from rollart.controller.observe.metrics import StepMetrics, step_metrics
from rollart.controller.observe.stall import ControllerStalledError, stall_watchdog
from rollart.controller.ports import TrainResult
from rollart.controller.rollout.admission import can_admit
from rollart.controller.rollout.tasks import launch_restarts
from rollart.controller.training.advantages import INVALID_SAMPLE_REASON, trainable_problem
from rollart.controller.training.agreement import (
    UNKNOWN_WORKER,
    WorkerAgreement,
    WorkerDisagreementError,
    by_worker,
    offenders,
)
from rollart.transport.errors import RollartError

if TYPE_CHECKING:
    from rollart.controller.controller import Controller

# The controller's messages keep the logger name they always had (``trajtasks`` says why).
log = logging.getLogger("rollart.controller.controller")


async def step(c: Controller) -> StepMetrics:
    """``Controller.step`` (its docstring)."""
    if not c._started:
        await c.start()
    # The previous step's end, so counters between steps (checkpoints) land in this step.
    stats_before = c._stats_at_end or c.buffer.stats()
    tokens_before = c._ctx.generated_tokens if c._ctx else 0
    invalid_actions_before = c._ctx.invalid_actions if c._ctx else 0
    rerouted_before = c.proxy.num_rerouted
    resends_before = c.proxy.num_prefix_resends
    window_waits_before = c.proxy.num_window_waits
    invalid_before = c.proxy.num_invalid_replies
    quarantined_before = len(c.proxy.quarantined)
    t0 = c.clock()
    batch = screen(c, await get_batch(c))
    c.last_batch = batch
    t_batch = c.clock()
    version = c.buffer.version
    if c._pacer is not None:
        c._pacer.on_batch(t_batch, version)
    c._admission_open = False
    assert c._sync is not None
    try:
        if c.spec.overlap:
            sync_total, sync_exposed = await c._sync.apply_newest()
            c._admission_open = True  # rollout goes on while the trainer trains
            c._notify()
            result, train_s = await train(c, batch, version)
            c._sync.start_push(result.version)
        else:
            pause_s = await c._sync.pause()
            result, train_s = await train(c, batch, version)
            # Nothing overlaps in these modes: the whole sync is exposed.
            sync_total = sync_exposed = pause_s + await c._sync.push_apply_resume(
                result.version
            )
    finally:
        c._admission_open = True
        c._notify()
    if result.dropped:
        batch = c.last_batch = [s for s in batch if s.sample_id not in result.dropped]
    t_end = c.clock()
    c._step += 1
    lag = c._loop_lag.take() if c._loop_lag is not None else None
    c._stats_at_end = stats_after = c.buffer.stats()
    metrics = step_metrics(
        step=c._step,
        mode=c.run.mode,
        policy_version=result.version,
        batch=batch,
        before=stats_before,
        after=stats_after,
        step_time_s=t_end - c._last_step_end,
        trainer_idle_s=t_batch - t0,
        train_time_s=train_s,
        weight_sync_total_s=sync_total + c._align_s,
        weight_sync_exposed_s=sync_exposed + c._align_s,
        num_generated_tokens=(c._ctx.generated_tokens if c._ctx else 0) - tokens_before,
        num_rerouted=c.proxy.num_rerouted - rerouted_before,
        num_prefix_resends=c.proxy.num_prefix_resends - resends_before,
        num_window_waits=c.proxy.num_window_waits - window_waits_before,
        train_metrics=result.metrics,
        # Samples restored from a checkpoint started before this process did.
        rollout_not_before=c._started_at,
        loop_lag_p99_ms=lag.p99_ms if lag is not None else None,
        loop_lag_max_ms=lag.max_ms if lag is not None else None,
        num_invalid_actions=(c._ctx.invalid_actions if c._ctx else 0)
        - invalid_actions_before,
    )
    metrics.num_invalid_replies = c.proxy.num_invalid_replies - invalid_before
    agreement = by_worker(batch, result.agreement, c.run.worker_checks.min_current_tokens)
    metrics.logprob_mismatch_by_worker = {
        k: round(w.logprob_mismatch, 6) for k, w in agreement.items()}
    metrics.iw_capped_fraction_by_worker = {
        k: round(w.iw_capped_fraction, 6) for k, w in agreement.items()}
    metrics.agreement_tokens_by_worker = {k: w.num_tokens for k, w in agreement.items()}
    metrics.agreement_basis_by_worker = {k: w.basis for k, w in agreement.items()}
    metrics.disagreeing_workers = sorted(act_on_disagreement(c, agreement))
    metrics.quarantined_workers = c.proxy.quarantined[quarantined_before:]
    c._align_s = 0.0
    c._last_step_end = t_end
    if c.transcripts is not None:
        c.transcripts.step(c._step, batch)  # decoded and written on its own thread
    return metrics


async def get_batch(c: Controller) -> list[Sample]:
    assert c._changed is not None
    # The stall watchdog: a batch that does not come says what it waits on (one task per
    # step, not a timer per wake-up: get_batch wakes on every trajectory outcome).
    watchdog = (asyncio.create_task(stall_watchdog(c), name="stall-watchdog")
                if c._stall_watchdog_on else None)
    try:
        while True:
            c._raise_if_fatal()
            batch = try_take_batch(c)
            launch_restarts(c)
            if batch is not None:
                return batch
            if not c._tasks and not (c.buffer.has_room() and can_admit(c)):
                raise ControllerStalledError(
                    f"no batch can be produced at version {c.buffer.version}: nothing is "
                    f"running and admission is paused ({c.buffer.stats()})"
                )
            await c._changed.wait()
    finally:
        if watchdog is not None:
            watchdog.cancel()


def try_take_batch(c: Controller) -> list[Sample] | None:
    # A batch becomes ready only when a sample is kept or the version advances (held
    # samples only become stale then, and advance_version sweeps them itself), so
    # take_batch, which scans every group, runs once per such change, not per wake-up.
    at = (c.buffer.version, c.buffer.num_kept)
    if at == c._no_batch_at:
        return None
    batch = c.buffer.take_batch()
    c._no_batch_at = at if batch is None else None
    return batch


def screen(c: Controller, batch: list[Sample]) -> list[Sample]:
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
        log.warning("batch at version %d: dropped sample %s (%s)", c.buffer.version,
                    s.sample_id, problem)
        c.buffer.drop_consumed(s.sample_id, INVALID_SAMPLE_REASON)
    if not kept:
        raise RollartError(f"no sample of the batch at version {c.buffer.version} can "
                           "be trained on (see the dropped samples above)")
    return kept


async def train(c: Controller, batch: list[Sample], version: int) -> tuple[TrainResult, float]:
    t0 = c.clock()
    result = await c.trainer.train(batch)
    if result.version != version + 1:
        raise RollartError(
            f"trainer returned version {result.version} after training at {version}"
        )
    for sid, why in result.dropped.items():  # the trainer's own last check
        log.warning("batch at version %d: the trainer dropped sample %s (%s)", version,
                    sid, why)
        c.buffer.drop_consumed(sid, INVALID_SAMPLE_REASON)
    c.buffer.advance_version()
    launch_restarts(c)
    return result, c.clock() - t0


def act_on_disagreement(c: Controller, agreement: dict[str, WorkerAgreement]) -> dict[str, str]:
    """Apply ``run.worker_checks.agreement_policy`` to the workers whose tokens disagree
    with the trainer (see ``rollart.controller.training.agreement``); returns them -> why.

    Raises:
        WorkerDisagreementError: policy ``stop``.
        PoolExhaustedError: policy ``quarantine`` emptied a pool.
    """
    cfg = c.run.worker_checks
    bad = offenders(agreement, cfg)
    for name, why in bad.items():
        log.warning("step %d: worker %s disagrees with the trainer: %s (policy %s)",
                    c._step, name, why, cfg.agreement_policy)
    if bad and cfg.agreement_policy == "stop":
        raise WorkerDisagreementError(
            f"step {c._step}: engine/trainer disagreement on worker(s) "
            f"{sorted(bad)}: {bad} (run.worker_checks.agreement_policy = 'stop')")
    if cfg.agreement_policy == "quarantine":
        for name in bad:
            if name != UNKNOWN_WORKER:
                c.proxy.quarantine(name, f"disagrees with the trainer: {bad[name]}")
    return bad
