"""What a training step counts: the counters of the sample buffer, the LLM proxy and the
trajectories at the step's start, diffed at its end into the step's
:class:`~rollart.controller.observe.metrics.StepMetrics`.

Counters between two steps (a checkpoint taken between them, rollout before the first step
while the owner awaits a held-out evaluation) land in the next step, so each trajectory and
each generated token counts in exactly one step; a resumed run's first step reports what the
checkpoint carried over (:meth:`StepCounters.restore`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from rollart.controller.buffer.snapshot import carried_over, counts_since
from rollart.controller.observe.metrics import StepMetrics, step_metrics

if TYPE_CHECKING:
    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.buffer.sample import BufferStats, Sample
    from rollart.controller.observe.loophealth import LoopLagMonitor
    from rollart.controller.rollout.trajectory import TrajectoryContext
    from rollart.controller.routing.proxy import LLMProxy


@dataclass(slots=True)
class StepStart:
    """The counters at a step's start (:meth:`StepCounters.begin`); ``tokens``: the
    trajectories' generated tokens at the previous step's end; ``t0``: clock, s."""

    stats: BufferStats
    tokens: int
    invalid_actions: int
    rerouted: int
    prefix_resends: int
    window_waits: int
    invalid_replies: int
    quarantined: int
    t0: float
    #: online affinity's per-domain spilled trajectories, number of moves, spills per domain
    #: and pool, returns per domain, so far
    spilled: dict[str, int]
    moves: int
    spills: dict[str, dict[str, int]]
    returns: dict[str, int]
    #: the KV working-set hold's waits, seconds waited, and turns found evicted, so far
    kv_waits: int = 0
    kv_wait_s: float = 0.0
    evicted_turns: int = 0


class StepCounters:
    """The counting of every training step (module docstring).

    Args:
        buffer: the sample buffer (its cumulative ``stats()``).
        proxy: the LLM proxy (reroutes, prefix resends, send-window waits, invalid replies,
            quarantined workers).
        clock: monotonic seconds.
        loop_lag: the event-loop lag monitor; ``None``: not measured.
    """

    def __init__(self, buffer: SampleBuffer, proxy: LLMProxy, clock: Callable[[], float],
                 loop_lag: LoopLagMonitor | None = None) -> None:
        self.buffer, self.proxy, self.clock, self.loop_lag = buffer, proxy, clock, loop_lag
        # the buffer's counters at the last step's end: the next step's metrics are deltas
        # from them (a restore sets them to the carried-over counters)
        self._stats_at_end: BufferStats | None = None
        # the trajectory and proxy counters at the last step's end (or the controller's
        # start): the next step's deltas are from them, as the buffer's are from
        # ``_stats_at_end``, so what happens between two steps lands in the next one
        self._at_end: StepStart | None = None
        # generated tokens a restored checkpoint carried over since its step (its
        # ``since_last_step``): the first step reports them, as the buffer's counters do
        self._carried_tokens = 0
        self._ctx: TrajectoryContext | None = None
        self._align_s = 0.0
        self._started_at = 0.0
        self._last_step_end = 0.0

    def start(self, ctx: TrajectoryContext, align_s: float) -> None:
        """The controller started: trajectories count in ``ctx``; ``align_s``, the weight
        sync that aligned the workers' version, is reported with the first step."""
        self._ctx, self._align_s = ctx, align_s
        self._last_step_end = self._started_at = self.clock()
        if self._stats_at_end is None:
            # Step 1's counters are deltas from here: rollout before the first step (the
            # owner awaiting something else, e.g. a held-out evaluation) counts in it.
            self._stats_at_end = self.buffer.stats()
        self._at_end = self._counts(self._stats_at_end, self._started_at)
        self._at_end.tokens -= self._carried_tokens

    def since_last_step(self) -> dict[str, Any]:
        """The checkpoint's part: buffer counters gained since the last step's metrics."""
        return counts_since(self.buffer.stats(), self._stats_at_end)

    def restore(self, since_last_step: dict[str, Any] | None) -> None:
        """Continue from a checkpoint: its :meth:`since_last_step` (``None`` in older ones:
        nothing is added) counts in the first step, with the restart's waste."""
        self._stats_at_end = carried_over(self.buffer.stats(), since_last_step)
        self._carried_tokens = int((since_last_step or {}).get("generated_tokens", 0))

    def begin(self) -> StepStart:
        """The counters at a step's start: those at the previous step's end (or the
        controller's start), so counters between steps land in this step; ``t0`` is now."""
        if self._at_end is None:  # not started: nothing counted yet
            return self._counts(self._stats_at_end or self.buffer.stats(), self.clock())
        return replace(self._at_end, t0=self.clock())

    def _counts(self, stats: BufferStats, t0: float) -> StepStart:
        ctx, proxy = self._ctx, self.proxy
        return StepStart(
            stats=stats,
            tokens=ctx.generated_tokens if ctx else 0,
            invalid_actions=ctx.invalid_actions if ctx else 0,
            rerouted=proxy.num_rerouted, prefix_resends=proxy.num_prefix_resends,
            window_waits=proxy.num_window_waits, invalid_replies=proxy.num_invalid_replies,
            quarantined=len(proxy.quarantined), t0=t0,
            spilled=dict(proxy.spill.num_spilled) if proxy.spill else {},
            moves=proxy.spill.num_moves if proxy.spill else 0,
            spills={d: dict(to) for d, to in proxy.spill.num_spills.items()}
            if proxy.spill else {},
            returns=dict(proxy.spill.num_returns) if proxy.spill else {},
            kv_waits=proxy.working_set.num_waits if proxy.working_set else 0,
            kv_wait_s=proxy.working_set.wait_s if proxy.working_set else 0.0,
            evicted_turns=proxy.num_prefix_evicted_turns)

    def metrics(self, start: StepStart, *, step: int, mode: str, policy_version: int,
                batch: Sequence[Sample], t_batch: float, t_end: float, train_s: float,
                sync_total_s: float, sync_exposed_s: float,
                train_metrics: dict[str, float]) -> StepMetrics:
        """The step's metrics: deltas from ``start`` to now. ``t_batch``: when the batch was
        ready; ``t_end``: the step's end (clock, s)."""
        ctx, proxy = self._ctx, self.proxy
        lag = self.loop_lag.take() if self.loop_lag is not None else None
        self._stats_at_end = after = self.buffer.stats()
        tokens = ctx.generated_tokens if ctx else 0
        metrics = step_metrics(
            step=step,
            mode=mode,
            policy_version=policy_version,
            batch=batch,
            before=start.stats,
            after=after,
            step_time_s=t_end - self._last_step_end,
            trainer_idle_s=t_batch - start.t0,
            train_time_s=train_s,
            weight_sync_total_s=sync_total_s + self._align_s,
            weight_sync_exposed_s=sync_exposed_s + self._align_s,
            num_generated_tokens=tokens - start.tokens,
            num_rerouted=proxy.num_rerouted - start.rerouted,
            num_prefix_resends=proxy.num_prefix_resends - start.prefix_resends,
            num_window_waits=proxy.num_window_waits - start.window_waits,
            train_metrics=train_metrics,
            # Samples restored from a checkpoint started before this process did.
            rollout_not_before=self._started_at,
            loop_lag_p99_ms=lag.p99_ms if lag is not None else None,
            loop_lag_max_ms=lag.max_ms if lag is not None else None,
            num_invalid_actions=(ctx.invalid_actions if ctx else 0) - start.invalid_actions,
        )
        metrics.num_invalid_replies = proxy.num_invalid_replies - start.invalid_replies
        # the carried tokens are in the first step's count only (``start`` took them off)
        metrics.carried_generated_tokens, self._carried_tokens = self._carried_tokens, 0
        if proxy.spill is not None:
            now = proxy.spill.num_spilled
            metrics.num_spilled_by_domain = {
                d: now[d] - start.spilled.get(d, 0) for d in sorted(now)
                if now[d] > start.spilled.get(d, 0)}
            new = min(proxy.spill.num_moves - start.moves, len(proxy.spill.transitions))
            metrics.affinity_moves = [f"{t.domain}: {t.from_pool} -> {t.to_pool} ({t.why})"
                                      for t in list(proxy.spill.transitions)[-new:]] if new else []
            spills = {}
            for d, to in sorted(proxy.spill.num_spills.items()):
                before = start.spills.get(d, {})
                gained = {p: n - before.get(p, 0) for p, n in sorted(to.items())
                          if n > before.get(p, 0)}
                if gained:
                    spills[d] = gained
            metrics.affinity_spills_by_domain = spills
            metrics.affinity_returns_by_domain = {
                d: n - start.returns.get(d, 0)
                for d, n in sorted(proxy.spill.num_returns.items())
                if n > start.returns.get(d, 0)}
        if proxy.working_set is not None:
            metrics.num_kv_admission_waits = proxy.working_set.num_waits - start.kv_waits
            metrics.kv_admission_wait_s = proxy.working_set.wait_s - start.kv_wait_s
        metrics.num_prefix_evicted_turns = proxy.num_prefix_evicted_turns - start.evicted_turns
        return metrics

    def end(self, metrics: StepMetrics, start: StepStart, t_end: float) -> None:
        """Close the step: the workers quarantined during it go into ``metrics``."""
        metrics.quarantined_workers = self.proxy.quarantined[start.quarantined:]
        self._align_s = 0.0
        self._last_step_end = t_end
        # Here, not in ``metrics``: workers quarantined in between (disagreement) are this
        # step's, and must not count again in the next.
        self._at_end = self._counts(self._stats_at_end or self.buffer.stats(), t_end)
