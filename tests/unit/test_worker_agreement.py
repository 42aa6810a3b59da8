"""Engine/trainer agreement enforced per serving worker (issue 13): the trainer's per-sample
recompute, attributed to the workers that served each sample's turns, against
``run.worker_checks`` thresholds with the off / warn / quarantine / stop policies; and a failed
prefix-cache reset failing the weight apply of that worker."""

from __future__ import annotations

import logging

import msgspec
import pytest
import torch
from test_train_step import SPEC, make_samples
from test_worker_output import assert_accounting, make_controller

from helpers.fakes import FakeTrainer, FakeWorker
from rollart.controller.buffer.sample import Sample
from rollart.controller.ports import TrainResult
from rollart.controller.training.agreement import WorkerDisagreementError, by_worker, offenders
from rollart.inference.engine import SchedulerCounts
from rollart.inference.worker import InferenceWorker
from rollart.models.tiny import init_tiny_model
from rollart.trainer.step import TrainStepConfig, train_step
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError


class FakeAgreementTrainer(FakeTrainer):
    """Reports, per sample, the mismatch ``drift`` for samples any of whose turns ``drifting``
    served (its weights differ from its version label), 0.001 for the others."""

    def __init__(self, drifting: str, drift: float = 0.9) -> None:
        super().__init__()
        self.drifting, self.drift = drifting, drift

    async def train(self, samples) -> TrainResult:
        base = await super().train(samples)
        rows = [m.SampleAgreement(self.drift, 2.0, 0.3) if self.drifting in s.turn_workers
                else m.SampleAgreement(0.001, 1.01, 0.0) for s in samples]
        return TrainResult(version=base.version, metrics=base.metrics, agreement=rows)


def sample(sid: str, workers: list[str], n_gen: int) -> Sample:
    return Sample(sample_id=sid, group_key="g", token_ids=[5] * (2 + n_gen),
                  loss_mask=[0, 0] + [1] * n_gen, behaviour_logprobs=[0.0] * 2 + [-1.0] * n_gen,
                  versions=[-1] * 2 + [0] * n_gen, reward=0.0, turn_workers=workers)


def test_agreement_is_token_weighted_per_serving_worker() -> None:
    batch = [sample("a", ["w1"], 1), sample("b", ["w1", "w2"], 3), sample("c", [], 2)]
    rows = [m.SampleAgreement(0.4, 1.5, 0.0), m.SampleAgreement(0.0, 1.0, 0.5),
            m.SampleAgreement(0.1, 1.2, 0.0)]
    got = by_worker(batch, rows)
    assert got["w1"].num_tokens == 4 and got["w1"].num_samples == 2
    assert got["w1"].logprob_mismatch == pytest.approx(0.1)  # (0.4 * 1 + 0 * 3) / 4
    assert got["w1"].iw_capped_fraction == pytest.approx(0.375) and got["w1"].iw_max == 1.5
    assert got["w2"].logprob_mismatch == 0.0 and got["?"].num_tokens == 2
    assert by_worker(batch, []) == {}
    with pytest.raises(ValueError, match="2 samples, the batch has 3"):
        by_worker(batch, rows[:2])


@pytest.mark.parametrize(
    ("policy", "expect"),
    [("off", set()), ("warn", {"w1", "w2"}), ("stop", {"w1", "w2"})],
)
def test_offenders_name_the_values_and_thresholds(policy, expect) -> None:
    from rollart.config import WorkerChecksConfig

    cfg = WorkerChecksConfig(agreement_policy=policy, max_logprob_mismatch=0.2,
                             max_iw_capped_fraction=0.1)
    got = offenders(by_worker([sample("a", ["w1"], 2), sample("b", ["w2"], 2),
                               sample("c", ["w3"], 2)],
                              [m.SampleAgreement(0.3, 1.5, 0.0),
                               m.SampleAgreement(0.01, 9.0, 0.5),
                               m.SampleAgreement(0.19, 4.0, 0.1)]), cfg)
    assert set(got) == expect
    if expect:
        assert "logprob mismatch 0.3 nats/token > 0.2" in got["w1"]
        assert "50.00% of tokens over the importance-weight cap > 10.00%" in got["w2"]


async def test_warn_names_the_worker_in_metrics_and_log(caplog) -> None:
    trainer = FakeAgreementTrainer("m-drift")
    ctl, _, _ = make_controller([FakeWorker("m-drift"), FakeWorker("m-ok")], trainer=trainer,
                                batch_size=8, group_size=2, seed=5)
    try:
        with caplog.at_level(logging.WARNING, logger="rollart.controller.training.step"):
            metrics = [await ctl.step() for _ in range(2)]
    finally:
        await ctl.close()
    served = {w for b in trainer.batches for s in b for w in s.turn_workers}
    assert "m-drift" in served  # the drifting worker served some of the batches' samples
    flagged = [s for s in metrics if s.disagreeing_workers]
    assert flagged and all(s.disagreeing_workers == ["m-drift"] for s in flagged)
    assert all(s.logprob_mismatch_by_worker["m-drift"] == pytest.approx(0.9) for s in flagged)
    assert any("worker m-drift disagrees with the trainer: logprob mismatch 0.9" in r.message
               for r in caplog.records)
    assert ctl.proxy.quarantined == []  # warn only


class FakeMovedPolicyTrainer(FakeTrainer):
    """Every sample's tokens all differ by 0.9 nats (the policy moved since they were
    generated) while those of the trainer's version agree (0.001)."""

    async def train(self, samples) -> TrainResult:
        base = await super().train(samples)
        rows = [m.SampleAgreement(0.9, 2.0, 0.3, s.num_generated, 0.001, 1.01, 0.0)
                for s in samples]
        return TrainResult(version=base.version, metrics=base.metrics, agreement=rows)


@pytest.mark.parametrize(("min_current", "flagged"), [(1, False), (10**9, True)])
async def test_a_policy_that_moved_is_not_a_worker_that_disagrees(min_current, flagged) -> None:
    ctl, _, _ = make_controller([FakeWorker("m-ok")], trainer=FakeMovedPolicyTrainer(),
                                batch_size=8, group_size=2, seed=5,
                                worker_checks={"agreement_policy": "stop",
                                               "min_current_tokens": min_current})
    try:
        if flagged:  # too few current tokens: judged on all of them, the policy's change too
            with pytest.raises(WorkerDisagreementError, match="'m-ok'"):
                await ctl.step()
            return
        metrics = await ctl.step()
    finally:
        await ctl.close()
    assert metrics.disagreeing_workers == []
    assert metrics.agreement_basis_by_worker == {"m-ok": "current"}
    assert metrics.logprob_mismatch_by_worker == {"m-ok": pytest.approx(0.001)}
    assert metrics.agreement_tokens_by_worker["m-ok"] > 0


async def test_quarantine_takes_the_worker_out_and_the_run_goes_on() -> None:
    trainer = FakeAgreementTrainer("m-drift")
    ctl, _, _ = make_controller([FakeWorker("m-drift"), FakeWorker("m-ok")], trainer=trainer,
                                batch_size=8, group_size=2, seed=5,
                                worker_checks={"agreement_policy": "quarantine"})
    try:
        metrics = [await ctl.step() for _ in range(4)]
    finally:
        await ctl.close()
    assert ctl.proxy.quarantined == ["m-drift"]
    k = next(i for i, s in enumerate(metrics) if s.quarantined_workers)
    assert metrics[k].quarantined_workers == ["m-drift"] == metrics[k].disagreeing_workers
    # Samples generated after the quarantine never come from it.
    assert "m-drift" not in {w for s in trainer.batches[-1] for w in s.turn_workers}
    assert metrics[-1].policy_version == 4
    assert_accounting(ctl.buffer, trainer)


async def test_stop_ends_the_run_with_an_error_naming_the_worker() -> None:
    trainer = FakeAgreementTrainer("m-drift")
    ctl, _, _ = make_controller([FakeWorker("m-drift")], trainer=trainer, batch_size=8,
                                group_size=2, seed=5, worker_checks={"agreement_policy": "stop"})
    try:
        with pytest.raises(WorkerDisagreementError, match="'m-drift'.*policy = 'stop'"):
            await ctl.step()
    finally:
        await ctl.close()


def test_train_step_reports_each_samples_agreement() -> None:
    torch.manual_seed(0)
    model = init_tiny_model(SPEC)
    exact, shifted, far = make_samples(model, n=3)
    shifted = make_samples(model, n=3, noise=1.0)[1]  # behaviour = trainer - 1 nat
    far = make_samples(model, n=3, noise=2.0)[2]  # w = e^2 > iw_cap 5 on every token
    rows: list[tuple] = []
    cfg = TrainStepConfig(iw_cap=5.0, max_tokens_per_microbatch=24)  # several micro-batches
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [exact, shifted, far], cfg,
               agreement=rows)
    (m0, w0, c0, *cur0), (m1, w1, c1, *cur1), (m2, w2, c2, *cur2) = rows
    assert m0 < 1e-5 and w0 == pytest.approx(1.0, abs=1e-4) and c0 == 0.0
    assert m1 == pytest.approx(1.0, abs=1e-4) and w1 == pytest.approx(2.71828, rel=1e-3)
    assert c1 == 0.0
    assert m2 == pytest.approx(2.0, abs=1e-4) and c2 == 1.0
    # No behaviour versions (and no weights version): no token is known to be current.
    assert cur0 == cur1 == cur2 == [0, 0.0, 0.0, 0.0]


def with_versions(s: m.TrainSample, versions: list[int], shift_old: float = 0.0
                  ) -> m.TrainSample:
    """``s`` with per-generated-token ``versions``; the logprobs of the tokens of a version
    other than the newest lowered by ``shift_old`` nats (as a policy that moved since)."""
    lps = tb.view_f32(s.behaviour_logprobs)
    gen = lps[tb.view_u8(s.loss_mask).view(bool)].tolist()
    newest = max(versions)
    gen = [x - shift_old if v != newest else x for x, v in zip(gen, versions, strict=True)]
    return m.TrainSample.from_lists(
        token_ids=tb.view_i32(s.token_ids).tolist(), loss_mask=tb.view_u8(s.loss_mask).tolist(),
        behaviour_logprobs=gen, advantage=s.advantage, sample_id=s.sample_id,
        behaviour_versions=versions)


def test_the_tokens_of_the_trainers_version_are_reported_apart() -> None:
    """The recompute is under version 3; tokens of version 2 differ by the policy's change
    (here 1.5 nats, past any threshold), which is not the engine disagreeing."""
    torch.manual_seed(0)
    model = init_tiny_model(SPEC)
    mixed, old_only, unknown, same = make_samples(model, n=4)
    k = mixed.num_loss_tokens
    mixed = with_versions(mixed, [2] * (k // 2) + [3] * (k - k // 2), shift_old=1.5)
    old_only = with_versions(old_only, [2] * old_only.num_loss_tokens)
    same = with_versions(same, [3] * same.num_loss_tokens)
    rows: list[tuple] = []
    cfg = TrainStepConfig(iw_cap=2.0, max_tokens_per_microbatch=24)
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.0),
               [mixed, old_only, unknown, same], cfg, agreement=rows, weights_version=3)
    got = [m.SampleAgreement(*r) for r in rows]
    # All tokens: the policy's change shows in the mixed sample.
    assert got[0].logprob_mismatch == pytest.approx(1.5 * (k // 2) / k, abs=1e-4)
    assert got[0].iw_capped_fraction == pytest.approx((k // 2) / k)
    # Its version-3 tokens alone agree.
    assert got[0].current_tokens == k - k // 2
    assert got[0].current_logprob_mismatch < 1e-5
    assert got[0].current_iw_capped_fraction == 0.0
    assert got[0].current_iw_max == pytest.approx(1.0, abs=1e-4)
    assert (got[1].current_tokens, got[1].current_logprob_mismatch, got[1].current_iw_max) == (
        0, 0.0, 0.0)  # nothing of version 3
    assert got[2].current_tokens == 0 and got[2].logprob_mismatch < 1e-5  # no versions
    assert got[3].current_tokens == same.num_loss_tokens == got[3].current_tokens
    assert got[3].current_logprob_mismatch < 1e-5


def agreement(all_: tuple[float, float, float], current: tuple[int, float, float, float]
              = (0, 0.0, 0.0, 0.0)) -> m.SampleAgreement:
    return m.SampleAgreement(*all_, *current)


def test_a_worker_is_judged_on_its_current_tokens_when_it_has_enough_of_them() -> None:
    from rollart.config import WorkerChecksConfig

    # w1: 5 current tokens (of 8) that agree, while all its tokens carry the policy's change;
    # w2: 1 current token (noise) and all tokens that agree; w3: a trainer that reports no
    # versions (three-field agreement).
    batch = [sample("a", ["w1"], 4), sample("b", ["w1"], 4), sample("c", ["w2"], 3),
             sample("d", ["w3"], 2)]
    rows = [agreement((0.9, 3.0, 0.5), (3, 0.001, 1.01, 0.0)),
            agreement((0.7, 2.5, 0.25), (2, 0.003, 1.02, 0.0)),
            agreement((0.01, 1.1, 0.0), (1, 2.0, 7.4, 1.0)),
            m.SampleAgreement(0.7, 3.0, 0.5)]
    got = by_worker(batch, rows, min_current_tokens=4)
    assert got["w1"].basis == "current" and got["w1"].num_tokens == 5
    assert got["w1"].num_samples == 2
    assert got["w1"].logprob_mismatch == pytest.approx((3 * 0.001 + 2 * 0.003) / 5)
    assert got["w1"].iw_max == 1.02
    assert got["w2"].basis == "all" and got["w2"].num_tokens == 3
    assert got["w2"].logprob_mismatch == pytest.approx(0.01)
    assert got["w3"].basis == "all" and got["w3"].num_tokens == 2
    cfg = WorkerChecksConfig(agreement_policy="stop", max_logprob_mismatch=0.5)
    assert set(offenders(got, cfg)) == {"w3"}
    # Judged on all tokens (as before the versions were reported), w1 would be flagged.
    allbasis = by_worker(batch, rows, min_current_tokens=6)
    assert allbasis["w1"].basis == "all" and allbasis["w1"].num_tokens == 8
    assert "over 2 samples / 8 tokens of the batch" in offenders(allbasis, cfg)["w1"]
    assert "tokens generated under the trainer's version" not in offenders(allbasis, cfg)["w1"]


def test_behaviour_versions_are_checked_one_per_generated_token() -> None:
    def build(versions):
        return m.TrainSample.from_lists(token_ids=[1, 2, 3, 4], loss_mask=[0, 1, 0, 1],
                                        behaviour_logprobs=[-0.5, -0.5], advantage=1.0,
                                        sample_id="s", behaviour_versions=versions)

    assert tb.view_i32(build([4, 5]).behaviour_versions).tolist() == [4, 5]
    assert build(None).behaviour_versions == b""
    with pytest.raises(ValueError, match=r"'s': behaviour_versions has 3 items: expected one "
                       r"per generated token \(2\)"):
        build([4, 5, 5])
    with pytest.raises(ValueError, match="'s': negative behaviour version -1"):
        build([4, -1])
    s = build([4, 5])
    assert s.generated_at(5).tolist() == [False, False, False, True]
    assert build(None).generated_at(5) is None
    # Through the wire and back.
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=m.TrainSample)
    assert back.behaviour_versions == s.behaviour_versions


def test_the_controllers_train_samples_carry_each_generated_tokens_version() -> None:
    from rollart.controller.training.remote import to_train_samples, trainable_problem

    fresh, checked = sample("a", ["w1"], 3), sample("b", ["w1"], 2)
    assert trainable_problem(checked) is None  # the path of a sample checked at completion
    out = to_train_samples([fresh, checked])
    for s, t in zip([fresh, checked], out, strict=True):
        assert tb.view_i32(t.behaviour_versions).tolist() == list(s.versions)


class FakeStager:
    def discard_up_to(self, version: int) -> None:
        pass


class FakeEngine:
    """The four engine calls ``InferenceWorker.apply_weights`` makes; ``reset`` is what
    ``reset_prefix_cache`` returns (or raises)."""

    def __init__(self, reset) -> None:
        self.reset = reset
        self.calls: list[str] = []

    async def pause_generation(self, **kw) -> None:
        self.calls.append("pause")

    async def reset_prefix_cache(self, reset_running_requests=False):
        self.calls.append(f"reset({reset_running_requests})")
        if isinstance(self.reset, BaseException):
            raise self.reset
        return self.reset

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"label {version}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")


def make_worker(reset, in_flight: int = 0) -> InferenceWorker:
    worker = InferenceWorker(FakeEngine(reset), name="w0", version=0, stager=FakeStager(),
                             counts=SchedulerCounts())
    worker._active = {f"r{i}": object() for i in range(in_flight)}
    worker.received_version = 1  # as after a collective update: no staged files to load
    return worker


@pytest.mark.parametrize(
    ("reset", "in_flight", "reprefill"),
    [(False, 0, False), (False, 2, True), (RuntimeError("engine busy"), 2, False)],
    ids=["false-nothing-in-flight", "false-with-reprefill", "raises"],
)
async def test_a_failed_prefix_cache_reset_fails_the_apply(reset, in_flight, reprefill) -> None:
    worker = make_worker(reset, in_flight)
    with pytest.raises(RemoteError, match="resetting the prefix cache after loading weight "
                       "version 1") as info:
        await worker.apply_weights(m.ApplyWeights(version=1, reprefill=reprefill), ())
    assert info.value.code == "engine_error"
    assert worker.fatal.is_set() and worker.version == 0  # it exits; never labels version 1
    assert "label 1" not in worker.engine.calls
    assert worker.engine.calls.count(f"reset({reprefill})") == (1 if in_flight and not reprefill
                                                                 else 2)


async def test_a_reset_kept_by_in_flight_requests_in_keep_mode_is_fine() -> None:
    # vLLM returns False while running requests hold blocks; cache_salt keeps new requests off.
    worker = make_worker(False, in_flight=2)
    applied = await worker.apply_weights(m.ApplyWeights(version=1), ())
    assert applied.version == 1 and not worker.fatal.is_set()
    ok = make_worker(True)
    assert (await ok.apply_weights(m.ApplyWeights(version=1), ())).version == 1
    assert ok.engine.calls == ["pause", "reset(False)", "label 1", "resume"]
