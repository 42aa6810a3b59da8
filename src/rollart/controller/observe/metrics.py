"""Per-step metrics of a run: one :class:`StepMetrics` per training step (``metrics.jsonl``).

Counters (``num_aborted``, ``num_failed``, ``wasted_tokens``, ...) are the change of the sample
buffer's cumulative counters over the step, so each trajectory is counted in exactly one step.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from rollart.controller.buffer.sample import BufferStats, DomainCounts, Sample
from rollart.controller.evaluation.stats import EvalRecord


class StepMetrics(msgspec.Struct, kw_only=True):
    """Metrics of one training step. Times are seconds of the controller's clock.

    - ``policy_version``: trainer version after this step's update.
    - ``reward_mean`` / ``reward_mean_by_domain``: mean reward of the batch's samples.
    - ``step_time_s``: end of the previous step (or start) to end of this one.
    - ``rollout_time_s``: first start to last finish of the batch's trajectories.
    - ``trainer_idle_s``: time the trainer waited for the batch (get batch).
    - ``train_time_s``: the trainer's update.
    - ``weight_sync_total_s``: weight push + pause/apply/resume time of the version applied in
      this step; ``weight_sync_exposed_s``: the part of it the training loop waited for.
    - ``staleness_max`` / ``staleness_mean``: trainer version minus each sample's oldest
      generated-token version, in versions.
    - ``num_aborted``: trajectories cancelled (redundancy, not needed) or restarted (stale).
    - ``num_failed``: failed trajectories (never scored); ``num_failed_by_reason``: the same by
      reason; ``num_retries``: of those, retried.
    - ``num_generated_tokens``: tokens the workers generated for training trajectories since
      the previous step's end (step 1: since the controller's start, the first held-out
      evaluation's wait included; the first step after a resume: plus what the checkpoint
      carried over since its step), so the rows of a run sum to its total. Held-out evaluation
      tokens are not counted. It equals ``buffer_generated_tokens`` but for replies the buffer
      refused (a turn that returned after its trajectory was cancelled or told to restart).
    - ``wasted_tokens``: generated tokens thrown away (cancelled, failed, stale, unselected).
    - ``wasted_tokens_by_reason``: the same by reason (``stale``, ``redundancy``, ``failed``,
      ``unselected``, ``retired``, ``shutdown``, ``resume``); ``buffer_generated_tokens``:
      tokens the sample buffer counted as generated in the step
      (``rollart.controller.buffer.core``: each one is trained, wasted for exactly one reason, or
      still in flight, so over a whole run, resumes included
      ``sum(wasted) + trained + in flight at the end == sum(buffer_generated_tokens)``);
      ``trained_tokens``: generated tokens of the batch; ``in_flight_tokens``: generated tokens of
      running or held trajectories at the end of the step.
    - ``flat_groups_by_domain``: per task domain, the batch's groups whose rewards are all equal
      (zero GRPO advantage: they give the policy no gradient), out of
      ``groups_by_domain``; a domain whose groups are all flat cannot learn.
    - ``by_domain``: per task domain, this step's ``DomainStepMetrics`` (started vs trained,
      finished vs trained lengths and turns, waste by reason): the selection bias.
    - ``response_len_kept_mean``: mean generated tokens of the batch's samples;
      ``response_len_all_mean``: of every trajectory that finished during the step (kept or
      not), so the selection bias of redundancy is visible.
    - ``num_invalid_replies``: worker replies that broke the ``GenerateResult`` contract
      (their trajectories failed with reason ``invalid_worker_output``);
      ``quarantined_workers``: workers taken out of their pool during the step (bad output or
      engine/trainer disagreement); ``logprob_mismatch_by_worker`` /
      ``iw_capped_fraction_by_worker``: the batch's engine/trainer agreement per serving
      worker (``rollart.controller.training.agreement``), over ``agreement_tokens_by_worker`` tokens:
      ``agreement_basis_by_worker`` ``"current"``, those generated under the weights the
      trainer recomputed with (older tokens also differ by the policy's change within the
      staleness bound), or ``"all"`` when it had fewer than
      ``run.worker_checks.min_current_tokens`` of them; ``disagreeing_workers``: those over
      ``run.worker_checks``' thresholds.
    - ``loop_lag_p99_ms`` / ``loop_lag_max_ms``: how late the controller's event loop woke a
      periodic probe during the step (p99 / max, milliseconds; ``None`` when not monitored,
      0.0 when no probe woke: a step shorter than the probe interval): every trajectory's next
      request waits at least that long.
    """

    step: int
    mode: str
    policy_version: int
    reward_mean: float
    reward_mean_by_domain: dict[str, float]
    num_samples: int
    step_time_s: float
    rollout_time_s: float
    train_time_s: float
    weight_sync_total_s: float
    weight_sync_exposed_s: float
    trainer_idle_s: float
    staleness_max: int
    staleness_mean: float
    num_aborted: int
    num_failed: int
    num_failed_by_reason: dict[str, int]
    num_retries: int
    num_rerouted: int
    num_generated_tokens: int
    wasted_tokens: int
    response_len_kept_mean: float
    response_len_all_mean: float
    num_turns_mean: float
    train_metrics: dict[str, float] = {}
    loop_lag_p99_ms: float | None = None
    loop_lag_max_ms: float | None = None
    wasted_tokens_by_reason: dict[str, int] = {}
    buffer_generated_tokens: int = 0
    trained_tokens: int = 0
    in_flight_tokens: int = 0
    by_domain: dict[str, DomainStepMetrics] = {}
    groups_by_domain: dict[str, int] = {}
    flat_groups_by_domain: dict[str, int] = {}
    num_invalid_replies: int = 0
    quarantined_workers: list[str] = []
    logprob_mismatch_by_worker: dict[str, float] = {}
    agreement_tokens_by_worker: dict[str, int] = {}
    agreement_basis_by_worker: dict[str, str] = {}
    iw_capped_fraction_by_worker: dict[str, float] = {}
    disagreeing_workers: list[str] = []
    #: env steps rejected as invalid actions (model-caused; those trajectories are trained on)
    num_invalid_actions: int = 0
    #: groups given up during the step, by reason (``failure_budget``)
    groups_dropped_by_reason: dict[str, int] = {}
    #: turns a worker refused with ``prefix_unknown`` (it no longer held the trajectory's
    #: prefix: evicted under its ``max_prefix_tokens``, or restarted) and that were sent again
    #: with the whole prompt; more than a few per step means the workers' prefix stores are too
    #: small for the trajectories in flight, and each such turn costs a round trip and its
    #: context's bytes again
    num_prefix_resends: int = 0
    #: generate requests that waited in the controller for a slot in their worker's send
    #: window (``run.max_generate_in_flight`` outstanding per worker): a burst's share is
    #: expected; most turns of every step waiting means the workers are offered more than the
    #: window lets through
    num_window_waits: int = 0
    #: per task domain, mean generated tokens per trajectory of the batch's samples (all turns)
    response_len_mean_by_domain: dict[str, float] = {}
    #: the policy's mean entropy per generated token of the batch, nats, from the trainer's
    #: training forward (``rollart.trainer.step``; ``None`` from a trainer that does not report
    #: it, e.g. the simulated one); a fall towards 0 while reward stalls signals collapse
    entropy_mean: float | None = None
    #: the same per task domain
    entropy_by_domain: dict[str, float] = {}
    #: online affinity (``run.adaptive_affinity``): per task domain, trajectories started
    #: during the step on a pool other than the domain's own, because that pool was saturated
    num_spilled_by_domain: dict[str, int] = {}
    #: online affinity's moves during the step, in order, each
    #: ``"<domain>: <from pool> -> <to pool> (<why>)"``
    affinity_moves: list[str] = []
    #: online affinity's decisions during the step: per task domain, per pool, the times the
    #: domain's new trajectories were sent away from its own pool to that one
    affinity_spills_by_domain: dict[str, dict[str, int]] = {}
    #: the same for the returns: per task domain, the times its new trajectories came back to
    #: its own pool (the pressure fell, or the pool spilled to saturated in turn)
    affinity_returns_by_domain: dict[str, int] = {}
    #: held-out evaluations that ended by this step's end (``rollart.controller.evaluation.runner``;
    #: each names the step it started after in ``at_step``); empty on most steps
    eval: list[EvalRecord] = []


#: One domain's counters over one step: the change of the buffer's cumulative ``DomainCounts``
#: (same fields; sum the rows of a run for its totals).
DomainStepMetrics = DomainCounts


def domain_deltas(after: BufferStats, before: BufferStats) -> dict[str, DomainStepMetrics]:
    """Per-domain change of the buffer's ``DomainCounts`` from ``before`` to ``after``."""
    out = {}
    # A domain or reason only the baseline has (a resume's carried-over counts, whose restored
    # buffer has not seen it yet) changed too: from its baseline to nothing.
    for name in sorted(after.domains.keys() | before.domains.keys()):
        a = after.domains.get(name, DomainCounts())
        b = before.domains.get(name, DomainCounts())
        out[name] = DomainCounts(
            **{f: getattr(a, f) - getattr(b, f) for f in DomainCounts.__struct_fields__
               if f != "wasted_tokens"},
            wasted_tokens=_delta(a.wasted_tokens, b.wasted_tokens))
    return out


_ENTROPY_PREFIX = "entropy_mean/"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    out = {k: after.get(k, 0) - before.get(k, 0) for k in after.keys() | before.keys()}
    return {k: v for k, v in sorted(out.items()) if v}


def step_metrics(
    *,
    step: int,
    mode: str,
    policy_version: int,
    batch: Sequence[Sample],
    before: BufferStats,
    after: BufferStats,
    step_time_s: float,
    trainer_idle_s: float,
    train_time_s: float,
    weight_sync_total_s: float,
    weight_sync_exposed_s: float,
    num_generated_tokens: int,
    num_rerouted: int = 0,
    train_metrics: dict[str, float] | None = None,
    rollout_not_before: float | None = None,
    loop_lag_p99_ms: float | None = None,
    loop_lag_max_ms: float | None = None,
    num_invalid_actions: int = 0,
    num_prefix_resends: int = 0,
    num_window_waits: int = 0,
) -> StepMetrics:
    """Assemble a step's metrics from its batch and the buffer counters around it.

    ``rollout_not_before``: clock time the rollout span may not start before (the controller's
    start: a sample restored from a checkpoint started in an earlier process, and the span would
    otherwise include the downtime)."""
    by_domain: dict[str, list[float]] = {}
    lengths: dict[str, list[int]] = {}
    groups: dict[str, tuple[str, set[float]]] = {}
    for s in batch:
        by_domain.setdefault(s.domain, []).append(s.reward)
        lengths.setdefault(s.domain, []).append(s.num_generated)
        groups.setdefault(s.group_key, (s.domain, set()))[1].add(s.reward)
    n_groups: dict[str, int] = {}
    flat: dict[str, int] = {}
    for domain, rewards in groups.values():
        n_groups[domain] = n_groups.get(domain, 0) + 1
        flat[domain] = flat.get(domain, 0) + (len(rewards) == 1)
    starts = [s.metadata["t_start"] for s in batch if "t_start" in s.metadata]
    ends = [s.metadata["t_end"] for s in batch if "t_end" in s.metadata]
    if rollout_not_before is not None:
        # Ends too: a batch of samples restored from a checkpoint all ended before this
        # process started, and its span in this process is 0, not negative.
        starts = [max(t, rollout_not_before) for t in starts]
        ends = [max(t, rollout_not_before) for t in ends]
    # The trainer reports entropy as ``entropy_mean`` and ``entropy_mean/<domain>``: those get
    # fields of their own rather than a flat key per domain among the trainer's metrics.
    trainer = dict(train_metrics or {})
    entropy_mean = trainer.pop("entropy_mean", None)
    entropy_by_domain = {k.removeprefix(_ENTROPY_PREFIX): trainer.pop(k) for k in sorted(trainer)
                         if k.startswith(_ENTROPY_PREFIX)}
    finished = after.finished_members - before.finished_members
    finished_len = (after.finished_mean_len * after.finished_members
                    - before.finished_mean_len * before.finished_members)
    return StepMetrics(
        step=step,
        mode=mode,
        policy_version=policy_version,
        reward_mean=_mean([s.reward for s in batch]),
        reward_mean_by_domain={d: _mean(r) for d, r in sorted(by_domain.items())},
        num_samples=len(batch),
        step_time_s=step_time_s,
        rollout_time_s=(max(ends) - min(starts)) if starts and ends else 0.0,
        train_time_s=train_time_s,
        weight_sync_total_s=weight_sync_total_s,
        weight_sync_exposed_s=weight_sync_exposed_s,
        trainer_idle_s=trainer_idle_s,
        staleness_max=after.last_batch_max_staleness,
        staleness_mean=after.last_batch_mean_staleness,
        num_aborted=(after.cancelled - before.cancelled)
        + (after.restarted_stale - before.restarted_stale),
        num_failed=sum(_delta(after.failed, before.failed).values()),
        num_failed_by_reason=_delta(after.failed, before.failed),
        num_retries=after.retries - before.retries,
        num_rerouted=num_rerouted,
        num_generated_tokens=num_generated_tokens,
        wasted_tokens=sum(after.wasted_tokens.values()) - sum(before.wasted_tokens.values()),
        response_len_kept_mean=_mean([s.num_generated for s in batch]),
        response_len_all_mean=round(finished_len / finished, 6) if finished > 0 else 0.0,
        num_turns_mean=_mean([s.num_turns for s in batch]),
        train_metrics=trainer,
        entropy_mean=entropy_mean,
        entropy_by_domain=entropy_by_domain,
        loop_lag_p99_ms=loop_lag_p99_ms,
        loop_lag_max_ms=loop_lag_max_ms,
        wasted_tokens_by_reason=_delta(after.wasted_tokens, before.wasted_tokens),
        buffer_generated_tokens=after.generated_tokens - before.generated_tokens,
        trained_tokens=after.trained_tokens - before.trained_tokens,
        in_flight_tokens=after.in_flight_tokens,
        by_domain=domain_deltas(after, before),
        groups_by_domain=dict(sorted(n_groups.items())),
        flat_groups_by_domain=dict(sorted(flat.items())),
        num_invalid_actions=num_invalid_actions,
        num_prefix_resends=num_prefix_resends,
        num_window_waits=num_window_waits,
        response_len_mean_by_domain={d: _mean(n) for d, n in sorted(lengths.items())},
        groups_dropped_by_reason=_delta(after.groups_dropped, before.groups_dropped),
    )
