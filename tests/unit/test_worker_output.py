"""Fault injection on worker output (issue 13): every reply is checked at the proxy, a bad one
fails its trajectory with a counted reason (never a reward), a worker that keeps sending them is
quarantined (its trajectories go to the pool's other workers; an emptied pool stops the run with
one clear error), and a failed weight apply takes that worker out of its pool."""

from __future__ import annotations

import array
import logging

import msgspec
import pytest

from helpers.fakes import (
    TOK,
    FakeEnvHost,
    FakeReward,
    FakeTrainer,
    FakeWorker,
    make_scenario,
)
from rollart.controller.buffer.core import SampleBuffer
from rollart.controller.controller import Controller
from rollart.controller.routing.proxy import LLMProxy, PoolExhaustedError
from rollart.controller.routing.routers import EnvRouter, RewardRouter
from rollart.controller.routing.workercheck import (
    InvalidWorkerOutput,
    ViolationWindow,
    check_generate_result,
)
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError


def result(ids=(5, 6, 2), lps=None, versions=None, finish="stop") -> m.GenerateResult:
    n = len(ids)
    r = m.GenerateResult(
        request_id="r", token_ids=tb.pack_i32([5] * n),
        logprobs=tb.pack_f32([-0.5] * n), versions=tb.pack_i32([1] * n), finish_reason="stop",
        num_prompt_tokens=3, stats=m.WorkerStats(worker="w", num_running=0, num_waiting=0,
                                                 version=1))
    # Assigned after construction, as an in-process backend (no wire decode) could hand them.
    r.token_ids = tb.pack_i32(list(ids))
    if lps is not None:
        r.logprobs = tb.pack_f32(list(lps))
    if versions is not None:
        r.versions = tb.pack_i32(list(versions))
    r.finish_reason = finish
    return r


def check(r: m.GenerateResult, **kw) -> str | None:
    args = {"max_tokens": 8, "min_version": 1, "max_version": 2, "vocab_size": 100, **kw}
    return check_generate_result(r, **args)


@pytest.mark.parametrize(
    ("make", "kw", "message"),
    [
        (lambda: result(ids=()), {}, "'stop' with no token"),
        (lambda: result(ids=(), finish="length"), {}, "'length' with no token"),
        (lambda: result(ids=(1,) * 9, finish="length"), {}, "9 tokens for max_tokens 8"),
        (lambda: result(ids=(5, 100)), {}, "token id 100 outside the vocabulary"),
        (lambda: result(ids=(5, -1)), {}, "token id -1 outside"),
        (lambda: result(lps=(-0.1, float("nan"), -0.2)), {}, "logprob nan"),
        (lambda: result(lps=(-0.1, 0.5, -0.2)), {}, "logprob 0.5"),
        (lambda: result(lps=(-0.1, float("-inf"), -0.2)), {}, "logprob -inf"),
        (lambda: result(versions=(1, 3, 3)), {}, "token version 3 outside [1, 2]"),
        (lambda: result(versions=(0, 1, 1)), {}, "token version 0 outside [1, 2]"),
        (lambda: result(versions=(2, 1, 2)), {}, "versions go backwards"),
        (lambda: result(finish="eos"), {}, "unknown finish_reason 'eos'"),
        (lambda: result(lps=(-0.1, -0.2)), {}, "12 bytes of token_ids, 8 of logprobs"),
    ],
)
def test_each_contract_violation_is_named(make, kw, message) -> None:
    problem = check(make(), **kw)
    assert problem is not None and message in problem


def test_valid_replies_pass() -> None:
    assert check(result()) is None
    assert check(result(ids=(), finish="abort")) is None  # an aborted turn may be empty
    assert check(result(versions=(1, 2, 2))) is None  # an update mid-turn: versions rise
    assert check(result(ids=(5, 500)), vocab_size=None) is None  # no vocabulary known


def test_violation_window_counts_only_the_last_replies() -> None:
    win = ViolationWindow(max_violations=2, window=3)
    assert not win.record("w", ok=False)
    assert not win.record("w", ok=True)
    assert not win.record("w", ok=True)
    assert not win.record("w", ok=False)  # the first violation left the window
    assert win.count("w") == 1 and win.total["w"] == 2
    assert win.record("w", ok=False)  # two among the last three
    assert not win.record("other", ok=True)
    with pytest.raises(ValueError):
        ViolationWindow(max_violations=4, window=3)


def zero_tokens(worker: FakeWorker) -> FakeWorker:
    """Make ``worker`` answer "stop" with no token (passes the wire decode, breaks the
    contract)."""
    inner = worker.generate

    async def generate(request, *, timeout_s=None):
        r = await inner(request, timeout_s=timeout_s)
        r.token_ids = r.logprobs = r.versions = b""
        return r

    worker.generate = generate  # type: ignore[method-assign]
    return worker


def prompt() -> array.array:
    return array.array("i", [1, 2, 3])


async def test_bad_replies_fail_the_turn_then_quarantine_the_worker(caplog) -> None:
    bad, good = zero_tokens(FakeWorker("bad")), FakeWorker("good")
    proxy = LLMProxy({"p": ("cpu", [bad, good])}, {"d": "p"},
                     violations=ViolationWindow(max_violations=2, window=10))
    params = m.SamplingParams(max_tokens=8)
    with pytest.raises(InvalidWorkerOutput, match="'stop' with no token") as info:
        await proxy.generate("t1", "d", "r1", prompt(), params)  # least loaded: bad (first)
    assert info.value.code == "bad_reply" and info.value.worker == "bad"
    assert proxy.quarantined == [] and proxy.num_invalid_replies == 1
    with caplog.at_level(logging.WARNING, logger="rollart.controller.routing.proxy"):
        with pytest.raises(InvalidWorkerOutput):
            await proxy.generate("t1", "d", "r2", prompt(), params)  # sticky: bad again
    assert proxy.quarantined == ["bad"]
    assert [r.message for r in caplog.records] == [
        "pool p: worker bad removed (quarantined: 2 invalid replies among its last 10 "
        "(run.worker_checks); last: request 'r2': finish_reason 'stop' with no token)"]
    # Its trajectory, and every later one, now goes to the pool's other worker.
    ok = await proxy.generate("t1", "d", "r3", prompt(), params)
    assert ok.num_tokens > 0 and proxy.served_by("t1") == "good"
    assert proxy.workers() == [good]


async def test_quarantining_a_pools_last_worker_stops_the_run_with_one_error() -> None:
    proxy = LLMProxy({"p": ("cpu", [zero_tokens(FakeWorker("only"))])}, {"d": "p"},
                     violations=ViolationWindow(max_violations=1, window=1))
    with pytest.raises(PoolExhaustedError, match="its last worker 'only' was quarantined"):
        await proxy.generate("t", "d", "r", prompt(), m.SamplingParams(max_tokens=8))


async def test_an_undecodable_reply_counts_as_a_violation() -> None:
    worker = FakeWorker("w", lambda req: RemoteError("bad_reply", "undecodable reply: NaN"))
    proxy = LLMProxy({"p": ("cpu", [worker, FakeWorker("v")])}, {"d": "p"},
                     violations=ViolationWindow(max_violations=1, window=5))
    with pytest.raises(InvalidWorkerOutput, match="undecodable"):
        await proxy.generate("t", "d", "r", prompt(), m.SamplingParams(max_tokens=8))
    assert proxy.quarantined == ["w"]


async def test_token_versions_are_bounded_by_what_was_applied() -> None:
    w = FakeWorker("w")
    proxy = LLMProxy({"p": ("cpu", [w])}, {"d": "p"})
    w.version = 1  # labels tokens with a version nobody applied
    with pytest.raises(InvalidWorkerOutput, match="token version 1 outside \\[0, 0\\]"):
        await proxy.generate("t", "d", "r", prompt(), m.SamplingParams(max_tokens=8))
    await proxy.apply_weights(1)
    assert (await proxy.generate("t", "d", "r2", prompt(),
                                 m.SamplingParams(max_tokens=8))).num_tokens > 0


async def test_remove_worker_is_one_primitive_for_any_reason() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")
    proxy = LLMProxy({"p": ("cpu", [a, b])}, {"d": "p"})
    await proxy.generate("t", "d", "r", prompt(), m.SamplingParams(max_tokens=8))
    assert proxy.served_by("t") == "a"
    pool = proxy.remove_worker("a", "test")
    assert pool.workers == [b] and pool.removed == ["a"] and proxy.served_by("t") is None
    assert proxy.remove_worker("a", "again") is pool  # idempotent
    with pytest.raises(Exception, match="no worker named 'zz'"):
        proxy.remove_worker("zz", "unknown")


async def test_a_worker_whose_weight_apply_fails_leaves_its_pool() -> None:
    a, b = FakeWorker("a"), FakeWorker("b")

    async def failing_apply(version, *, reprefill=False):
        raise RemoteError("engine_error", "resetting the prefix cache returned False")

    a.apply_weights = failing_apply  # type: ignore[method-assign]
    proxy = LLMProxy({"p": ("cpu", [a, b])}, {"d": "p"})
    await proxy.apply_weights(1)
    assert proxy.workers() == [b] and proxy.quarantined == ["a"] and b.version == 1
    lone = LLMProxy({"p": ("cpu", [a])}, {"d": "p"})
    with pytest.raises(PoolExhaustedError, match="no worker left after apply_weights"):
        await lone.apply_weights(1)


# ----------------------------------------------------------------------- a whole run


def make_controller(workers_p2, *, trainer=None, **run):
    """The fakes' two-domain scenario; ``workers_p2`` serve domain ``math`` (scored by the
    ``FakeReward``), one ``FakeWorker`` serves ``game``."""
    scenario = make_scenario(**run)
    proxy = LLMProxy({"p1": ("cpu", [FakeWorker("g0")]), "p2": ("cpu", workers_p2)},
                     {"game": "p1", "math": "p2"}, vocab_size=TOK_VOCAB)
    reward = FakeReward()
    trainer = trainer or FakeTrainer()
    ctl = Controller(scenario, proxy=proxy, envs=EnvRouter([FakeEnvHost(turns=2)]),
                     rewards=RewardRouter(service=reward), trainer=trainer, tokenizer=TOK)
    return ctl, trainer, reward


#: the fake tokenizer's ids: 16 specials/offset + one per character code
TOK_VOCAB = 16 + 0x110000


def assert_accounting(buffer: SampleBuffer, trainer: FakeTrainer) -> None:
    st = buffer.stats()
    assert st.generated_tokens == st.trained_tokens + sum(st.wasted_tokens.values()) \
        + st.in_flight_tokens
    ids = [s.sample_id for batch in trainer.batches for s in batch]
    assert len(ids) == len(set(ids))  # nothing trained twice


async def three_steps(workers_p2):
    """Three steps of :func:`make_controller`'s run (seed 3, batches of 4, groups of 2)."""
    ctl, trainer, reward = make_controller(workers_p2, seed=3, batch_size=4, group_size=2)
    try:
        steps = [await ctl.step() for _ in range(3)]
    finally:
        await ctl.close()
    return ctl, trainer, reward, steps


async def test_a_run_with_a_garbage_worker_continues_and_counts_it() -> None:
    bad = zero_tokens(FakeWorker("m-bad"))
    ctl, trainer, reward, steps = await three_steps([bad, FakeWorker("m-ok")])
    failed = sum(s.num_failed_by_reason.get("invalid_worker_output", 0) for s in steps)
    assert failed == sum(s.num_invalid_replies for s in steps) == 3  # default: 3 in 100
    assert [w for s in steps for w in s.quarantined_workers] == ["m-bad"]
    assert ctl.proxy.quarantined == ["m-bad"]
    # Never scored: every reward call belongs to a math sample that completed.
    assert len(reward.calls) == ctl.buffer.stats().domains["math"].finished
    assert all("m-bad" not in s.turn_workers for b in trainer.batches for s in b)
    assert all(s.turn_workers for b in trainer.batches for s in b)
    assert_accounting(ctl.buffer, trainer)


def failing(worker: FakeWorker, code: str) -> FakeWorker:
    """Make ``worker`` fail every request with ``RemoteError(code)``, at once."""

    async def generate(request, *, timeout_s=None):
        raise RemoteError(code, f"request {request.request_id!r} failed (injected)")

    worker.generate = generate  # type: ignore[method-assign]
    return worker


async def test_a_worker_whose_engine_fails_every_request_is_quarantined() -> None:
    # Failing at once, it is always the least loaded: without the count it would take every
    # trajectory of its pool and the run would stop at max_failures_in_a_row.
    bad = failing(FakeWorker("m-fail"), "engine_error")
    ctl, trainer, reward, steps = await three_steps([bad, FakeWorker("m-ok")])
    assert ctl.proxy.quarantined == ["m-fail"] and ctl.proxy.num_engine_errors == 3
    assert sum(s.num_failed_by_reason.get("generation_error", 0) for s in steps) == 3
    assert all("m-fail" not in s.turn_workers for b in trainer.batches for s in b)
    assert_accounting(ctl.buffer, trainer)


async def test_requests_refused_as_bad_input_do_not_quarantine_a_worker() -> None:
    a = failing(FakeWorker("a"), "bad_request")
    proxy = LLMProxy({"p": ("cpu", [a, FakeWorker("b")])}, {"d": "p"},
                     violations=ViolationWindow(3, 100))
    for i in range(5):
        with pytest.raises(RemoteError, match="injected"):
            await proxy.generate(f"t{i}", "d", f"r{i}", prompt(), m.SamplingParams(max_tokens=8))
    assert proxy.quarantined == [] and proxy.num_engine_errors == 0
    e = failing(FakeWorker("e"), "engine_error")
    proxy = LLMProxy({"p": ("cpu", [e, FakeWorker("b")])}, {"d": "p"},
                     violations=ViolationWindow(3, 100))
    for i in range(3):
        with pytest.raises(RemoteError, match="injected"):
            await proxy.generate(f"t{i}", "d", f"r{i}", prompt(), m.SamplingParams(max_tokens=8))
    assert proxy.quarantined == ["e"]
    r = await proxy.generate("t9", "d", "r9", prompt(), m.SamplingParams(max_tokens=8))
    assert r.stats.worker == "b" or proxy.served_by("t9") == "b"


async def test_a_sample_the_trainer_would_refuse_fails_its_trajectory(monkeypatch) -> None:
    import rollart.controller.rollout.tasks as trajtasks

    real = trajtasks.run_trajectory
    corrupted: list[str] = []

    async def corrupting(ctx, tid, key, domain, seed):
        sample = await real(ctx, tid, key, domain, seed)
        if not corrupted:  # the first finisher: one positive behaviour logprob
            sample.behaviour_logprobs[0] = 0.25  # the first generated token's
            corrupted.append(tid)
        return sample

    monkeypatch.setattr(trajtasks, "run_trajectory", corrupting)
    ctl, trainer, _ = make_controller([FakeWorker("m0")], batch_size=4, group_size=2)
    try:
        metrics = await ctl.step()
    finally:
        await ctl.close()
    assert metrics.num_failed_by_reason == {"invalid_sample": 1} and metrics.num_retries == 1
    assert metrics.num_samples == 4 and corrupted[0] not in {s.sample_id for s in trainer.batches[0]}
    assert_accounting(ctl.buffer, trainer)


async def test_the_last_check_drops_one_sample_never_the_batch(monkeypatch) -> None:
    ctl, trainer, _ = make_controller([FakeWorker("m0")], batch_size=4, group_size=2)
    real = ctl.buffer.take_batch
    dropped: list[str] = []

    def take_batch():
        batch = real()
        if batch is not None and not dropped:  # e.g. restored from an old checkpoint
            # A restored sample is a new object that skipped the completion check.
            lps = array.array("f", batch[1].behaviour_logprobs)
            lps[-1] = float("nan")  # the last generated token's
            batch[1] = msgspec.structs.replace(batch[1], behaviour_logprobs=lps)
            dropped.append(batch[1].sample_id)
        return batch

    monkeypatch.setattr(ctl.buffer, "take_batch", take_batch)
    try:
        first = await ctl.step()
        second = await ctl.step()
    finally:
        await ctl.close()
    assert first.num_samples == 3 and len(trainer.batches[0]) == 3
    assert dropped[0] not in {s.sample_id for s in trainer.batches[0]}
    assert first.wasted_tokens_by_reason.get("invalid_sample", 0) > 0
    assert ctl.buffer.stats().dropped == {"invalid_sample": 1}
    assert second.num_samples == 4 and second.policy_version == 2  # the run goes on
    assert_accounting(ctl.buffer, trainer)


def test_sample_agreement_field_round_trips_on_the_wire() -> None:
    r = m.TrainResult(step=0, version=1, metrics={}, train_time_s=0.1,
                      agreement=[m.SampleAgreement(0.5, 3.0, 0.25)])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=m.TrainResult)
    assert back.agreement == [m.SampleAgreement(logprob_mismatch=0.5, iw_max=3.0,
                                                iw_capped_fraction=0.25)]


def test_summary_totals_failures_by_reason_and_quarantines() -> None:
    from rollart.launcher.progress import failure_summary

    rows = [{"num_failed_by_reason": {"invalid_worker_output": 2}, "num_invalid_replies": 2,
             "quarantined_workers": []},
            {"num_failed_by_reason": {"invalid_worker_output": 1, "env_error": 1},
             "num_invalid_replies": 1, "quarantined_workers": ["w1"]}]
    assert failure_summary(rows) == {
        "failed_by_reason": {"env_error": 1, "invalid_worker_output": 3},
        "num_invalid_replies": 3, "quarantined_workers": ["w1"]}


class FakeDroppingTrainer(FakeTrainer):
    """Refuses (drops) the second sample of its first batch, as the trainer's own last check
    does (``TrainResult.dropped``), and trains on the rest."""

    async def train(self, samples):
        drop = samples[1].sample_id if not self.batches else None
        base = await super().train([s for s in samples if s.sample_id != drop])
        base.dropped = {drop: "12 tokens > max_tokens_per_microbatch 8"} if drop else {}
        return base


async def test_a_sample_the_trainer_drops_is_counted_and_the_batch_trains() -> None:
    trainer = FakeDroppingTrainer()
    ctl, _, _ = make_controller([FakeWorker("m0")], trainer=trainer, batch_size=4, group_size=2)
    try:
        first = await ctl.step()
        second = await ctl.step()
    finally:
        await ctl.close()
    assert first.num_samples == 3 == len(trainer.batches[0]) and len(ctl.last_batch) == 4
    assert first.wasted_tokens_by_reason.get("invalid_sample", 0) > 0
    assert ctl.buffer.stats().dropped == {"invalid_sample": 1}
    assert second.num_samples == 4 and second.policy_version == 2
    assert_accounting(ctl.buffer, trainer)


def test_split_batch_drops_only_the_sample_over_the_budget() -> None:
    from rollart.trainer.step import TrainStepConfig, split_batch

    def ts(sid: str, n: int) -> m.TrainSample:
        return m.TrainSample.from_lists(token_ids=[5] * n, loss_mask=[0] + [1] * (n - 1),
                                        behaviour_logprobs=[0.0] + [-1.0] * (n - 1),
                                        advantage=1.0, sample_id=sid)

    usable, dropped = split_batch([ts("a", 4), ts("b", 12), ts("c", 8)],
                                  TrainStepConfig(max_tokens_per_microbatch=8))
    assert [s.sample_id for s in usable] == ["a", "c"]
    assert dropped == {"b": "12 tokens > max_tokens_per_microbatch 8"}


def test_split_batch_drops_only_the_sample_with_a_token_outside_the_vocabulary() -> None:
    from rollart.trainer.step import TrainStepConfig, split_batch

    def ts(sid: str, top: int) -> m.TrainSample:
        return m.TrainSample.from_lists(token_ids=[5, 6, top], loss_mask=[0, 1, 1],
                                        behaviour_logprobs=[0.0, -1.0, -1.0],
                                        advantage=1.0, sample_id=sid)

    batch = [ts("a", 99), ts("b", 100), ts("c", 7)]
    usable, dropped = split_batch(batch, TrainStepConfig(), vocab_size=100)
    assert [s.sample_id for s in usable] == ["a", "c"]
    assert dropped == {"b": "token id 100 outside the vocabulary [0, 100)"}
    assert len(split_batch(batch, TrainStepConfig())[0]) == 3  # unchecked without a vocab size


@pytest.mark.parametrize(
    ("ids", "lps", "versions"),
    [
        ((5, -3, -1), None, None),
        ((5, 100, 6), None, None),
        (None, (-0.1, float("nan"), 0.5), None),
        (None, (-0.1, 0.5, float("nan")), None),
        (None, (-0.1, float("-inf"), -0.2), None),
        (None, (-0.1, float("inf"), -0.2), None),
        (None, None, (1, 3, 0)),
        (None, None, (0, 1, 1)),
        (None, None, (1, 2, 1)),
        (None, None, (1, 2, 2)),
        (None, None, None),
    ],
)
def test_short_and_long_turns_get_the_same_verdict(ids, lps, versions) -> None:
    # Turns of at most tokenbytes.SMALL_BYTES per field are checked in plain Python, longer
    # ones with numpy: padding a turn past that (with valid items after its problem, so the
    # first problem stays the same) must not change the verdict or its wording.
    pad = tb.SMALL_BYTES // 4
    ids, lps, versions = ids or (5, 6, 7), lps or (-0.5,) * 3, versions or (1, 1, 1)
    short = check(result(ids=ids, lps=lps, versions=versions), max_tokens=1000)
    long = check(result(ids=(*ids, *(7,) * pad), lps=(*lps, *(-0.5,) * pad),
                        versions=(*versions, *(versions[-1],) * pad)), max_tokens=1000)
    assert short == long


@pytest.mark.parametrize("n", [3, 300])
@pytest.mark.parametrize(
    ("field", "values", "message"),
    [
        ("token_ids", (5, -2, -1), "negative token id -2"),
        ("versions", (1, -4, 0), "negative version -4"),
        ("logprobs", (-0.5, 0.25, float("nan")), "logprob 0.25 of a generated token"),
        ("logprobs", (-0.5, float("nan"), 0.25), "logprob nan of a generated token"),
        ("logprobs", (-0.5, float("-inf")), "logprob -inf of a generated token"),
    ],
)
def test_a_decoded_reply_names_its_first_bad_item(n, field, values, message) -> None:
    # Short replies are validated in plain Python, long ones (n = 300) with numpy: one wording.
    good = {"token_ids": (5,) * n, "versions": (1,) * n, "logprobs": (-0.5,) * n}
    r = result(ids=good["token_ids"], lps=good["logprobs"], versions=good["versions"])
    pack = tb.pack_f32 if field == "logprobs" else tb.pack_i32
    setattr(r, field, pack((*values, *good[field][len(values):])))
    body = msgspec.msgpack.encode(r)
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.msgpack.decode(body, type=m.GenerateResult)
