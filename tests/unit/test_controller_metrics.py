"""Step metrics across a resume: a restored sample's start time predates this process."""

from __future__ import annotations

from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.buffer.sample import Sample
from rollart.controller.observe.metrics import step_metrics


def _sample(sid: str, t_start: float, t_end: float) -> Sample:
    return Sample(sample_id=sid, group_key="g", token_ids=[1, 2], loss_mask=[0, 1],
                  behaviour_logprobs=[0.0, -1.0], versions=[-1, 0], reward=1.0,
                  metadata={"t_start": t_start, "t_end": t_end})


def test_rollout_span_of_restored_samples_starts_at_the_controllers_start() -> None:
    stats = SampleBuffer(alpha=1, batch_size=2, group_size=2).stats()
    # s0 was restored from a checkpoint written 1000 s before this controller started (t=5000).
    batch = [_sample("s0", 4000.0, 5010.0), _sample("s1", 5002.0, 5012.0)]
    common = dict(step=1, mode="rollart", policy_version=1, batch=batch, before=stats,
                  after=stats, step_time_s=12.0, trainer_idle_s=0.0, train_time_s=1.0,
                  weight_sync_total_s=0.0, weight_sync_exposed_s=0.0, num_generated_tokens=2)
    assert step_metrics(**common).rollout_time_s == 1012.0  # the old, misleading span
    assert step_metrics(**common, rollout_not_before=5000.0).rollout_time_s == 12.0
    # A batch of restored samples only: all ended before this process started. Its span in
    # this process is 0 (it was -990 when only the starts were clamped).
    restored = [_sample("s2", 4000.0, 4010.0), _sample("s3", 4001.0, 4005.0)]
    assert step_metrics(**{**common, "batch": restored},
                        rollout_not_before=5000.0).rollout_time_s == 0.0


def test_flat_groups_are_counted_per_domain() -> None:
    stats = SampleBuffer(alpha=1, batch_size=6, group_size=2).stats()

    def s(sid: str, group: str, domain: str, reward: float) -> Sample:
        return Sample(sample_id=sid, group_key=group, token_ids=[1, 2], loss_mask=[0, 1],
                      behaviour_logprobs=[0.0, -1.0], versions=[-1, 0], reward=reward,
                      domain=domain)

    # arith: one group all 0 (flat), one mixed; game: one group all 1 (flat)
    batch = [s("a", "g0", "arith", 0.0), s("b", "g0", "arith", 0.0),
             s("c", "g1", "arith", 0.0), s("d", "g1", "arith", 1.0),
             s("e", "g2", "game", 1.0), s("f", "g2", "game", 1.0)]
    m = step_metrics(step=1, mode="rollart", policy_version=1, batch=batch, before=stats,
                     after=stats, step_time_s=1.0, trainer_idle_s=0.0, train_time_s=1.0,
                     weight_sync_total_s=0.0, weight_sync_exposed_s=0.0, num_generated_tokens=6)
    assert m.groups_by_domain == {"arith": 2, "game": 1}
    assert m.flat_groups_by_domain == {"arith": 1, "game": 1}
