"""Policy entropy from the trainer to a metrics row: domains on the wire, the row's fields,
the scalars written to TensorBoard."""

from __future__ import annotations

import msgspec
import pytest
import torch

from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.buffer.sample import Sample
from rollart.controller.observe.metrics import StepMetrics, step_metrics
from rollart.controller.training.remote import to_train_samples, trainable_problem
from rollart.launcher.sinks import step_scalars
from rollart.transport import messages as m


def _sample(sid: str, group: str, domain: str, reward: float) -> Sample:
    return Sample(sample_id=sid, group_key=group, token_ids=[5, 9, 12, 40, 7],
                  loss_mask=[0, 0, 1, 1, 1], behaviour_logprobs=[-1.0, -2.0, -0.5],
                  versions=[0, 0, 0], reward=reward, domain=domain)


def test_train_samples_carry_their_domain_and_old_senders_still_decode() -> None:
    batch = [_sample("a", "g", "math", 1.0), _sample("b", "g", "math", 0.0),
             _sample("c", "h", "game", 1.0), _sample("d", "h", "game", 0.5)]
    assert trainable_problem(batch[0]) is None  # checked at completion: the cached path
    assert [s.domain for s in to_train_samples(batch)] == ["math", "math", "game", "game"]
    wire = msgspec.msgpack.encode(m.TrainBatch(version=0, samples=to_train_samples(batch)))
    decoded = msgspec.msgpack.decode(wire, type=m.TrainBatch)
    assert [s.domain for s in decoded.samples] == ["math", "math", "game", "game"]
    # A sender that predates the field: the sample decodes with an empty (unknown) domain.
    old = msgspec.structs.asdict(decoded.samples[0])
    del old["domain"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=m.TrainSample).domain == ""


def _row(train_metrics: dict[str, float]) -> StepMetrics:
    stats = SampleBuffer(alpha=1, batch_size=2, group_size=2).stats()
    batch = [_sample("a", "g", "math", 1.0), _sample("b", "g", "math", 0.0)]
    return step_metrics(step=1, mode="rollart", policy_version=1, batch=batch, before=stats,
                        after=stats, step_time_s=1.0, trainer_idle_s=0.0, train_time_s=1.0,
                        weight_sync_total_s=0.0, weight_sync_exposed_s=0.0,
                        num_generated_tokens=6, train_metrics=train_metrics)


def test_the_trainers_entropy_gets_fields_of_its_own_in_the_row_and_scalars() -> None:
    row = _row({"loss": 0.5, "entropy_mean": 2.5, "entropy_mean/math": 2.0,
                "entropy_mean/game": 3.0})
    assert row.entropy_mean == 2.5
    assert row.entropy_by_domain == {"game": 3.0, "math": 2.0}
    assert row.train_metrics == {"loss": 0.5}
    as_json = msgspec.json.decode(msgspec.json.encode(row))
    assert as_json["entropy_mean"] == 2.5 and as_json["entropy_by_domain"]["math"] == 2.0
    scalars = step_scalars(as_json)
    assert scalars["entropy_mean"] == 2.5
    assert scalars["entropy/math"] == 2.0 and scalars["entropy/game"] == 3.0
    assert not any(k.startswith("train/entropy") for k in scalars)
    # A trainer that reports no entropy (the simulated one): no field value, no scalar.
    bare = msgspec.json.decode(msgspec.json.encode(_row({"sim_train_s": 1.0})))
    assert bare["entropy_mean"] is None and bare["entropy_by_domain"] == {}
    assert "entropy_mean" not in step_scalars(bare)


def test_a_real_train_step_reaches_the_row_per_domain() -> None:
    from rollart.models.tiny import TinyModelSpec, init_tiny_model
    from rollart.trainer.step import TrainStepConfig, train_step

    model = init_tiny_model(TinyModelSpec(seed=1, hidden_size=64, num_layers=1, num_heads=2,
                                          intermediate_size=128))
    batch = [_sample("a", "g", "math", 1.0), _sample("b", "g", "math", 0.0),
             _sample("c", "h", "game", 1.0), _sample("d", "h", "game", 0.5)]
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
                         to_train_samples(batch), TrainStepConfig())
    row = _row(metrics)
    assert row.entropy_mean == pytest.approx(metrics["entropy_mean"])
    assert set(row.entropy_by_domain) == {"game", "math"}
    # Equal token counts per domain (3 generated tokens per sample): the mean of the two.
    assert row.entropy_mean == pytest.approx(sum(row.entropy_by_domain.values()) / 2, rel=1e-6)
