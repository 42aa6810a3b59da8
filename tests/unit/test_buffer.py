"""Exact-value unit tests of SampleBuffer: config errors, bounds, admissibility boundaries,
redundancy and selection, failures, protocol errors, snapshot/restore."""

from __future__ import annotations

import random

import msgspec
import pytest

from rollart.controller.buffer.batch import BatchPlan
from rollart.controller.buffer.core import Sample, SampleBuffer, SampleBufferError
from rollart.controller.buffer.groups import Group
from rollart.controller.buffer.snapshot import carried_over
from rollart.controller.snapshot import restore_buffer
from rollart.transport.errors import ConfigError


def sample(tid: str, key: str, versions: list[int], reward: float = 1.0) -> Sample:
    n = len(versions)
    return Sample(
        sample_id=tid,
        group_key=key,
        token_ids=[7] * (n + 1),
        loss_mask=[0] + [1] * n,
        behaviour_logprobs=[0.0] + [-0.1] * n,
        versions=[-1, *versions],
        reward=reward,
    )


def run(buf: SampleBuffer, tid: str, versions: list[int]) -> list[str]:
    """One turn at max(versions), then complete with those token versions."""
    assert buf.begin_turn(tid, max(versions)) == "continue"
    buf.record_tokens(tid, versions)
    return buf.complete(tid, sample(tid, buf.group_of(tid), versions))


def bump(buf: SampleBuffer, key: str) -> None:
    """Train one batch made of a fresh group ``key`` run at the current version."""
    v = buf.version
    for tid in buf.try_start_group(key):
        run(buf, tid, [v])
    assert {s.group_key for s in buf.take_batch()} == {key}
    buf.advance_version()


# ---------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"batch_size": 6, "group_size": 4},
            "SampleBuffer: batch_size 6 is not a multiple of group_size 4 "
            "(take_batch returns whole groups)",
        ),
        ({"alpha": -1}, "SampleBuffer: alpha must be >= 0, got -1"),
        ({"batch_size": 0}, "SampleBuffer: batch_size must be >= 1, got 0"),
        ({"redundancy": -2}, "SampleBuffer: redundancy must be >= 0, got -2"),
        ({"max_attempts": 0}, "SampleBuffer: max_attempts must be >= 1, got 0"),
        ({"alpha": True}, "SampleBuffer: alpha must be an int, got True"),
        ({"group_size": 2.0}, "SampleBuffer: group_size must be an int, got 2.0"),
        (
            {"selection": "best"},
            "SampleBuffer: selection must be one of ('first', 'unbiased'), got 'best'",
        ),
        (
            {"check": "never"},
            "SampleBuffer: check must be one of ('per_turn', 'admission'), got 'never'",
        ),
        (
            {"on_stale": "ignore"},
            "SampleBuffer: on_stale must be one of ('restart', 'drop'), got 'ignore'",
        ),
    ],
)
def test_config_errors(kwargs: dict, message: str) -> None:
    args = {"alpha": 1, "batch_size": 4, "group_size": 2, **kwargs}
    with pytest.raises(ConfigError) as e:
        SampleBuffer(**args)
    assert str(e.value) == message
    assert isinstance(e.value, ValueError)


# ---------------------------------------------------------------------------------- bounds
@pytest.mark.parametrize(
    ("alpha", "batch", "group", "k", "max_groups", "bound"),
    [(0, 4, 2, 0, 2, 4), (1, 4, 2, 1, 4, 12), (2, 6, 3, 2, 6, 30), (1, 8, 8, 0, 2, 16)],
)
def test_in_flight_bound_numbers(alpha, batch, group, k, max_groups, bound) -> None:
    buf = SampleBuffer(alpha=alpha, batch_size=batch, group_size=group, redundancy=k)
    assert buf.max_groups == max_groups
    for i in range(max_groups):
        assert len(buf.try_start_group(f"g{i}")) == group + k
    assert buf.try_start_group("one-too-many") is None
    s = buf.stats()
    assert (s.groups_in_flight, s.running, s.in_flight, s.in_flight_bound) == (
        max_groups,
        bound,
        bound,
        bound,
    )
    assert bound == (alpha + 1) * batch + k * max_groups


def test_admission_resumes_after_consumption_and_duplicate_key() -> None:
    buf = SampleBuffer(alpha=0, batch_size=2, group_size=2)
    a, b = buf.try_start_group("p")
    with pytest.raises(SampleBufferError, match="group 'p' is already in flight"):
        buf.try_start_group("p")
    assert buf.try_start_group("q") is None
    run(buf, a, [0])
    run(buf, b, [0, 0])
    assert buf.ready_samples() == 2
    assert [s.sample_id for s in buf.take_batch()] == [a, b]
    assert buf.stats().groups_in_flight == 0
    assert buf.try_start_group("p") is not None  # a consumed key may come back


# ---------------------------------------------------------------------------------- staleness
def test_alpha0_boundaries() -> None:
    buf = SampleBuffer(alpha=0, batch_size=1, group_size=1)
    (t0,) = buf.try_start_group("a")
    (t1,) = buf.try_start_group("b") or (None,)
    assert t1 is None  # max_groups = 1
    run(buf, t0, [0])
    buf.take_batch()
    buf.advance_version()  # v = 1: only version-1 tokens may train
    (t,) = buf.try_start_group("b")
    assert buf.admissible(1) and not buf.admissible(0)
    assert buf.begin_turn(t, 0) == "wait"  # worker still serves version 0
    assert buf.begin_turn(t, 1) == "continue"
    buf.record_tokens(t, [1, 1])
    buf.complete(t, sample(t, "b", [1, 1]))
    assert buf.take_batch()[0].sample_id == t
    assert buf.stats().last_batch_max_staleness == 0


def test_alpha1_boundaries_turn_restart_and_held_replacement() -> None:
    drops: list[tuple[str, str]] = []
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, on_drop=lambda *a: drops.append(a))
    (held,) = buf.try_start_group("held")
    (running,) = buf.try_start_group("running")
    run(buf, held, [0])
    assert buf.begin_turn(running, 0) == "continue"
    buf.record_tokens(running, [0])
    (other,) = [s.sample_id for s in buf.take_batch()]  # the held one is consumed at v = 0
    assert other == held
    buf.advance_version()  # v = 1: version-0 tokens still admissible (0 >= 1 - 1)
    assert buf.begin_turn(running, 1) == "continue"
    buf.record_tokens(running, [1])
    assert buf.complete(running, sample(running, "running", [0, 1])) == []
    assert buf.take_batch()[0].sample_id == running
    assert buf.stats().last_batch_max_staleness == 1
    buf.advance_version()  # v = 2
    (late,) = buf.try_start_group("late")
    buf.begin_turn(late, 2)
    buf.record_tokens(late, [1])  # a lagging worker's token: version 1 >= 2 - 1
    (stale,) = buf.try_start_group("stale")
    buf.begin_turn(stale, 1)
    buf.record_tokens(stale, [1])
    buf.complete(late, sample(late, "late", [1]))
    buf.take_batch()
    buf.advance_version()  # v = 3: version-1 tokens are now too old
    assert buf.begin_turn(stale, 3) == "restart"
    new = buf.restart_trajectory(stale)
    assert new is not None and buf.group_of(new) == "stale"
    s = buf.stats()
    assert (s.restarted_stale, s.wasted_tokens) == (1, {"stale": 1})
    assert drops == []


def test_held_sample_going_stale_is_replaced_not_lost() -> None:
    drops: list[tuple[str, str]] = []
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=2, on_drop=lambda *a: drops.append(a))
    a, b = buf.try_start_group("g")
    run(buf, a, [0])  # held at v = 0 while its group is incomplete
    bump(buf, "x")  # v = 1: a is still admissible (0 >= 1 - 1)
    assert drops == [] and buf.held_sample_ids() == {a}
    bump(buf, "y")  # v = 2: a is stale
    assert drops == [(a, "stale")]
    (repl,) = buf.drain_restarts()
    assert buf.group_of(repl) == "g" and buf.drain_restarts() == []
    run(buf, repl, [2])
    run(buf, b, [1, 2])
    assert [s.sample_id for s in buf.take_batch()] == [repl, b]  # completion order
    s = buf.stats()
    assert (s.dropped, s.replaced_stale, s.consumed) == ({"stale": 1}, 1, 6)


class _SkipsGroupG(SampleBuffer):
    """A batch policy that never takes group ``g``, so ``g`` goes stale complete."""

    def assemble_batch(self, ready, need):  # type: ignore[no-untyped-def]
        keys = [r.key for r in ready if r.key != "g"]
        return BatchPlan(take=keys[:need] if len(keys) >= need else [])


@pytest.mark.parametrize("readmit", [False, True])
def test_complete_group_going_stale_whole_is_readmitted_not_refilled(readmit: bool) -> None:
    drops: list[tuple[str, str]] = []
    buf = _SkipsGroupG(alpha=1, batch_size=1, group_size=1, readmit_stale_groups=readmit,
                       on_drop=lambda *a: drops.append(a))
    (g,) = buf.try_start_group("g")
    run(buf, g, [0])  # complete at v = 0, passed over by every batch
    bump(buf, "x")  # v = 1: still admissible
    assert drops == [] and buf.stats().groups_in_flight == 1
    bump(buf, "y")  # v = 2: g's only sample is stale
    assert drops == [(g, "stale")]
    s = buf.stats()
    assert s.wasted_tokens == {"stale": 1}
    if readmit:
        # Dropped whole: nothing started outside admission; its place in flight is free.
        assert buf.drain_restarts() == [] and s.groups_dropped == {"stale": 1}
        assert (s.replaced_stale, s.groups_in_flight) == (0, 0) and buf.has_room()
    else:
        (repl,) = buf.drain_restarts()
        assert buf.group_of(repl) == "g" and s.groups_dropped == {}
        assert (s.replaced_stale, s.groups_in_flight) == (1, 1)


def test_readmitting_is_not_in_a_snapshot_and_a_resumed_run_takes_the_scenarios() -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, readmit_stale_groups=True)
    buf.try_start_group("g")
    snap = buf.snapshot()
    assert "readmit_stale_groups" not in snap["config"]  # the checkpoint layout is unchanged
    for readmit in (True, False):
        scenario = SampleBuffer(alpha=1, batch_size=1, group_size=1,
                                readmit_stale_groups=readmit)
        got = restore_buffer({"format": 1, "buffer": snap}, scenario_buffer=scenario,
                             buffer_class=SampleBuffer, seed=0, trainer_version=0,
                             on_forget=lambda key: None, on_drop=None)
        assert got.readmit_stale_groups is readmit


def test_group_with_a_fresh_sample_is_refilled_even_when_readmitting() -> None:
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=2, readmit_stale_groups=True)
    a, b = buf.try_start_group("g")
    run(buf, a, [0])  # held while b runs: the group is not complete
    bump(buf, "x")
    bump(buf, "y")  # v = 2: a is stale, b still wanted and running
    (repl,) = buf.drain_restarts()
    assert buf.group_of(repl) == "g" and buf.stats().groups_dropped == {}


def test_on_stale_drop_finishes_then_replaces() -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, on_stale="drop", max_attempts=1)
    (x,) = buf.try_start_group("x")
    assert buf.begin_turn(x, 0) == "continue"
    buf.record_tokens(x, [0])
    bump(buf, "a")
    assert buf.begin_turn(x, 1) == "continue"  # 0 >= 1 - 1
    bump(buf, "b")
    assert buf.begin_turn(x, 2) == "drop"
    assert buf.begin_turn(x, 2) == "drop"
    assert buf.drain_restarts() == []  # no replacement while x still occupies the slot
    buf.record_tokens(x, [2])
    assert buf.complete(x, sample(x, "x", [0, 2])) == []
    (repl,) = buf.drain_restarts()
    s = buf.stats()
    assert (s.dropped, s.wasted_tokens, s.running) == ({"stale": 1}, {"stale": 2}, 1)
    assert buf.group_of(repl) == "x"


def test_admission_check_only_first_turn_then_dropped_at_completion() -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, check="admission")
    (x,) = buf.try_start_group("x")
    assert buf.begin_turn(x, 0) == "continue"
    buf.record_tokens(x, [0])
    bump(buf, "a")
    bump(buf, "b")
    assert buf.begin_turn(x, 2) == "continue"  # AReaL: no per-turn check
    buf.record_tokens(x, [2])
    buf.complete(x, sample(x, "x", [0, 2]))
    assert buf.take_batch() is None
    assert buf.stats().dropped == {"stale": 1} and len(buf.drain_restarts()) == 1


# ---------------------------------------------------------------------------------- groups
def test_first_selection_cancel_list_and_bias_stats() -> None:
    buf = SampleBuffer(alpha=0, batch_size=2, group_size=2, redundancy=2)
    a, b, c, d = buf.try_start_group("g")
    buf.begin_turn(b, 0)
    buf.record_tokens(b, [0] * 5)  # b is slow and long
    assert run(buf, c, [0]) == []
    assert run(buf, a, [0, 0, 0]) == [b, d]
    assert buf.begin_turn(d, 0) == "cancel"
    buf.cancel(b)
    buf.cancel(d)
    buf.cancel(d)  # harmless repeat
    batch = buf.take_batch()
    assert [s.sample_id for s in batch] == [c, a]
    s = buf.stats()
    assert (s.cancelled, s.wasted_tokens, s.late_calls) == (2, {"redundancy": 5}, 1)
    assert (s.kept_mean_len, s.finished_mean_len, s.cancelled_mean_len) == (2.0, 2.0, 2.5)


def test_late_completion_after_group_full_is_unselected() -> None:
    buf = SampleBuffer(alpha=0, batch_size=1, group_size=1, redundancy=1)
    a, b = buf.try_start_group("g")
    assert run(buf, a, [0]) == [b]
    buf.record_tokens(b, [0, 0, 0])  # b finished its last turn before the cancel arrived
    assert buf.complete(b, sample(b, "g", [0, 0, 0])) == []
    s = buf.stats()
    assert (s.dropped, s.wasted_tokens, s.finished_mean_len, s.kept_mean_len) == (
        {"unselected": 1},
        {"unselected": 3},
        2.0,
        1.0,
    )


def test_unbiased_selection_with_seeded_rng() -> None:
    buf = SampleBuffer(alpha=0, batch_size=2, group_size=2, redundancy=2, selection="unbiased")
    a, b, c, d = buf.try_start_group("g")
    assert run(buf, a, [0]) == []
    assert run(buf, b, [0, 0]) == []  # two finished, but the deadline has not passed
    assert run(buf, c, [0, 0, 0]) == []
    assert buf.ready_samples() == 0
    assert buf.close_group("g", random.Random(1234)) == [d]
    assert sorted(random.Random(1234).sample([a, b, c], 2)) == [a, b]
    assert [s.sample_id for s in buf.take_batch()] == [a, b]
    s = buf.stats()
    # Response lengths 1, 2, 3 finished; the seeded draw kept 1 and 2: the bias is visible.
    assert (s.finished_mean_len, s.kept_mean_len, s.dropped) == (2.0, 1.5, {"unselected": 1})
    assert s.wasted_tokens == {"unselected": 3}
    assert buf.close_group("g", random.Random(1)) == []  # gone


def test_unbiased_after_deadline_keeps_next_finishers_and_autoselects() -> None:
    buf = SampleBuffer(alpha=0, batch_size=2, group_size=2, redundancy=1, selection="unbiased")
    a, b, c = buf.try_start_group("g")
    run(buf, a, [0])
    assert buf.close_group("g") == []  # only one finished: wait for the next
    assert run(buf, c, [0]) == [b]
    assert [s.sample_id for s in buf.take_batch()] == [a, c]
    buf.cancel(b)
    buf.advance_version()
    x, y, z = buf.try_start_group("h")
    run(buf, x, [1])
    run(buf, y, [1])
    assert run(buf, z, [1]) == []  # none left running: auto-select with the buffer's rng
    assert buf.ready_samples() == 2 and buf.stats().dropped == {"unselected": 1}


# ---------------------------------------------------------------------------------- failures
def test_failures_retry_then_retire_group() -> None:
    drops: list[tuple[str, str]] = []
    buf = SampleBuffer(
        alpha=1, batch_size=2, group_size=2, max_attempts=2, on_drop=lambda *a: drops.append(a)
    )
    a, b = buf.try_start_group("g")
    run(buf, a, [0])
    b2 = buf.fail(b, "env_error")
    assert b2 is not None and buf.group_of(b2) == "g"
    buf.begin_turn(b2, 0)
    buf.record_tokens(b2, [0, 0])
    assert buf.fail(b2, "reward_error") is None  # attempt 2 of 2: the group cannot fill
    assert drops == [(a, "retired")]
    s = buf.stats()
    assert (s.failed, s.retries, s.groups_retired, s.groups_in_flight) == (
        {"env_error": 1, "reward_error": 1},
        1,
        1,
        0,
    )
    assert s.wasted_tokens == {"failed": 2, "retired": 1}
    assert buf.fail(b2, "again") is None and buf.stats().late_calls == 1


def test_retired_group_members_get_cancel_and_leave() -> None:
    buf = SampleBuffer(alpha=0, batch_size=2, group_size=2, max_attempts=1)
    a, b = buf.try_start_group("g")
    assert buf.fail(a, "env_error") is None
    assert buf.begin_turn(b, 0) == "cancel"
    assert buf.stats().groups_in_flight == 1  # b still runs
    buf.cancel(b)
    assert buf.stats().groups_in_flight == 0
    assert buf.begin_turn(b, 0) == "cancel"  # forgotten id: neutral


# ---------------------------------------------------------------------------------- protocol
def test_protocol_errors() -> None:
    buf = SampleBuffer(alpha=0, batch_size=1, group_size=1)
    (a,) = buf.try_start_group("g")
    with pytest.raises(SampleBufferError, match="unknown trajectory id 'nope/99'"):
        buf.begin_turn("nope/99", 0)
    with pytest.raises(SampleBufferError, match=r"serving_version 1 outside \[0, trainer"):
        buf.begin_turn(a, 1)
    with pytest.raises(SampleBufferError, match=r"token versions \[1\] outside"):
        buf.record_tokens(a, [0, 1])
    with pytest.raises(SampleBufferError, match="was not told to restart"):
        buf.restart_trajectory(a)
    with pytest.raises(SampleBufferError, match="without a batch taken"):
        buf.advance_version()
    with pytest.raises(SampleBufferError, match="sample is 'x' of group 'g'"):
        buf.complete(a, sample("x", "g", [0]))
    run(buf, a, [0])
    assert buf.take_batch() is not None
    with pytest.raises(SampleBufferError, match="batch for version 0 is outstanding"):
        buf.take_batch()


def test_sample_validation() -> None:
    with pytest.raises(ValueError, match="behaviour_logprobs/versions have 2/1 items"):
        Sample(
            sample_id="s",
            group_key="g",
            token_ids=[1, 2],
            loss_mask=[0, 1],
            behaviour_logprobs=[0.0, -1.0],
            versions=[0],
            reward=0.0,
        )
    with pytest.raises(ValueError, match="generated token 1 has version -1"):
        Sample(
            sample_id="s",
            group_key="g",
            token_ids=[1, 2],
            loss_mask=[0, 1],
            behaviour_logprobs=[0.0, -1.0],
            versions=[-1, -1],
            reward=0.0,
        )
    with pytest.raises(ValueError, match="reward nan is not finite"):
        sample("s", "g", [0], reward=float("nan"))
    s = sample("s", "g", [3, 2, 5])
    assert (s.num_tokens, s.num_generated, s.min_version) == (4, 3, 2)


# ---------------------------------------------------------------------------------- checkpoint
def test_snapshot_restore_round_trip() -> None:
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=2, redundancy=1)
    a, b, c = buf.try_start_group("g")
    d, e, f = buf.try_start_group("h")
    run(buf, a, [0])
    run(buf, d, [0, 0])
    buf.begin_turn(b, 0)
    buf.record_tokens(b, [0])
    buf.fail(f, "env_error")  # f's retry is running
    snap = msgspec.json.decode(msgspec.json.encode(buf.snapshot()))
    new = SampleBuffer.restore(snap)
    assert new.version == 0 and new.held_sample_ids() == {a, d}
    restarted = new.drain_restarts()
    assert [new.group_of(t) for t in restarted] == ["g", "g", "h", "h"]
    assert not set(restarted) & {a, b, c, d, e, f}
    assert new.stats().in_flight == 6
    for t in restarted[:1] + restarted[2:3]:
        run(new, t, [0])
    assert [s.sample_id for s in new.take_batch()] == [a, restarted[0]]
    with pytest.raises(ConfigError, match="unknown snapshot format 7"):
        SampleBuffer.restore({**snap, "format": 7})


def test_token_totals_add_up_across_a_checkpoint_and_resume() -> None:
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=2)
    a, b = buf.try_start_group("g", "math")
    run(buf, a, [0, 0, 0])  # held: 3 generated tokens
    buf.begin_turn(b, 0)
    buf.record_tokens(b, [0, 0])  # running: 2 generated tokens, lost with the restart
    before = buf.stats()
    assert (before.generated_tokens, before.in_flight_tokens) == (5, 5)
    new = SampleBuffer.restore(msgspec.json.decode(msgspec.json.encode(buf.snapshot())))
    # Carried over: the held sample's 3 tokens in flight, the running slot's 2 wasted.
    after = new.stats()
    assert (after.generated_tokens, after.in_flight_tokens) == (5, 3)
    assert after.wasted_tokens == {"resume": 2}
    assert after.domains["math"].wasted_tokens == {"resume": 2}
    # The first step's metrics are deltas from this baseline: they report the resume's waste.
    base = carried_over(after)
    assert base.wasted_tokens == {} and base.domains["math"].wasted_tokens == {}
    (fresh,) = new.drain_restarts()
    run(new, fresh, [0])
    assert {s.sample_id for s in new.take_batch()} == {a, fresh}
    done = new.stats()
    assert done.trained_tokens == 3 + 1  # the restored sample's tokens count as trained
    assert done.generated_tokens == done.trained_tokens + sum(done.wasted_tokens.values()) \
        + done.in_flight_tokens
    assert done.domains["math"].trained_tokens == 4


def test_waste_between_the_last_step_and_the_checkpoint_shows_by_reason_after_resume() -> None:
    # The rollout went on after the last step: 90 tokens wasted as redundancy (guess) and 10
    # generated in a domain (letters) the restored buffer holds no group of. The new process
    # has seen none of it, so the first step's baseline holds them as negatives, and that
    # step's metrics must report them by reason and by domain (they reported the total alone:
    # a reason only the baseline had was skipped, and the totals stopped adding up).
    from rollart.controller.observe.metrics import _delta, domain_deltas

    new = SampleBuffer(alpha=1, batch_size=2, group_size=2)
    new.try_start_group("g", "guess")
    since = {"generated_tokens": 100, "trained_tokens": 0, "wasted_tokens": {"redundancy": 90},
             "domains": {"guess": {"generated_tokens": 90, "wasted_tokens": {"redundancy": 90}},
                         "letters": {"generated_tokens": 10, "wasted_tokens": {}}}}
    base = carried_over(new.stats(), since)
    after = new.stats()
    assert sum(after.wasted_tokens.values()) - sum(base.wasted_tokens.values()) == 90
    assert _delta(after.wasted_tokens, base.wasted_tokens) == {"redundancy": 90}
    by_domain = domain_deltas(after, base)
    assert by_domain["guess"].wasted_tokens == {"redundancy": 90}
    assert by_domain["guess"].generated_tokens == 90
    assert by_domain["letters"].generated_tokens == 10
    assert after.generated_tokens - base.generated_tokens == 100


# ---------------------------------------------------------------------------------- waste
def test_every_generated_token_is_trained_wasted_once_or_in_flight() -> None:
    """Waste by reason and per domain: each token lands in exactly one bucket."""
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=2, redundancy=1, max_attempts=2)
    a, b, c = buf.try_start_group("g0", "math")
    for tid, n in ((a, 3), (b, 4)):
        assert buf.begin_turn(tid, 0) == "continue"
        buf.record_tokens(tid, [0] * n)
    assert buf.begin_turn(c, 0) == "continue"
    buf.record_tokens(c, [0] * 5)
    retry = buf.fail(c, "env_error")  # 5 tokens "failed", a retry in the same slot
    assert retry is not None and buf.begin_turn(retry, 0) == "continue"
    buf.record_tokens(retry, [0] * 6)
    assert buf.complete(a, sample(a, "g0", [0] * 3)) == []
    assert buf.complete(b, sample(b, "g0", [0] * 4)) == [retry]
    buf.cancel(retry)  # the group is complete: 6 tokens of "redundancy"
    d, e, f = buf.try_start_group("g1", "game")
    assert buf.begin_turn(d, 0) == "continue"
    buf.record_tokens(d, [0] * 7)
    assert buf.begin_turn(e, 0) == "continue"
    buf.record_tokens(e, [0] * 2)
    batch = buf.take_batch()
    assert [s.sample_id for s in batch] == [a, b]
    buf.advance_version()
    # version 1: d's tokens (0) still admissible; a bump to 2 makes them stale.
    assert buf.complete(d, sample(d, "g1", [0] * 7)) == []
    buf.cancel(f, "shutdown")  # no tokens: nothing wasted
    s = buf.stats()
    assert s.generated_tokens == 3 + 4 + 5 + 6 + 7 + 2
    assert s.trained_tokens == 7
    assert s.wasted_tokens == {"failed": 5, "redundancy": 6}
    assert s.in_flight_tokens == 7 + 2  # d held, e running
    buf.cancel(e, "shutdown")  # 2 tokens; g1 can no longer fill: d's 7 are "retired"
    s = buf.stats()
    assert s.wasted_tokens == {"failed": 5, "redundancy": 6, "shutdown": 2, "retired": 7}
    assert s.in_flight_tokens == 0
    assert s.generated_tokens == s.trained_tokens + sum(s.wasted_tokens.values())
    math_, game = s.domains["math"], s.domains["game"]
    assert (math_.groups_started, math_.started, math_.finished, math_.trained) == (1, 4, 2, 2)
    assert (math_.trained_tokens, math_.finished_tokens, math_.generated_tokens) == (7, 7, 18)
    assert math_.wasted_tokens == {"failed": 5, "redundancy": 6}
    assert (game.started, game.finished, game.trained, game.generated_tokens) == (3, 1, 0, 9)
    assert game.wasted_tokens == {"shutdown": 2, "retired": 7}


def test_stale_waste_is_counted_for_restarts_and_replaced_samples() -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1)
    (old,) = buf.try_start_group("old", "long")
    assert buf.begin_turn(old, 0) == "continue"
    buf.record_tokens(old, [0, 0])
    bump(buf, "b1")
    bump(buf, "b2")  # version 2: old's tokens (0) are too old
    assert buf.begin_turn(old, 2) == "restart"
    fresh = buf.restart_trajectory(old)
    assert fresh is not None
    s = buf.stats()
    assert s.wasted_tokens == {"stale": 2} and s.domains["long"].wasted_tokens == {"stale": 2}


# ---------------------------------------------------------------------------------- per-group
def test_a_group_with_its_own_alpha_keeps_samples_the_run_bound_would_drop() -> None:
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=1)
    (short,) = buf.try_start_group("s", "short")
    (long_,) = buf.try_start_group("l", "long", alpha=3)
    for tid in (short, long_):
        assert buf.begin_turn(tid, 0) == "continue"
        buf.record_tokens(tid, [0])
    buf.complete(long_, sample(long_, "l", [0]))
    assert buf.take_batch() is None  # one group ready, batch needs two
    buf._outstanding = True  # noqa: SLF001 (advance two versions without training a batch)
    buf.advance_version()
    buf._outstanding = True  # noqa: SLF001
    buf.advance_version()
    # version 2: the alpha-1 member must restart, the alpha-3 sample is still held.
    assert buf.begin_turn(short, 2) == "restart"
    assert buf.held_sample_ids() == {long_}
    assert buf.stats().dropped == {}
    with pytest.raises(SampleBufferError, match="alpha 0 must be an int >= the buffer's 1"):
        buf.try_start_group("x", "short", alpha=0)


def test_snapshot_keeps_each_groups_domain_and_alpha() -> None:
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=1, fresh_start=True, abort_stale=True)
    (tid,) = buf.try_start_group("l", "long", alpha=3)
    assert buf.begin_turn(tid, 0) == "continue"
    buf.record_tokens(tid, [0])
    buf.complete(tid, sample(tid, "l", [0]))
    again = SampleBuffer.restore(msgspec.json.decode(msgspec.json.encode(buf.snapshot())))
    assert (again.fresh_start, again.abort_stale) == (True, True)
    g = again._groups["l"]  # noqa: SLF001
    assert (g.domain, g.alpha) == ("long", 3)


# ---------------------------------------------------------------------------------- fresh start
def test_fresh_start_waits_for_a_version_of_headroom_before_the_first_token() -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, fresh_start=True)
    (a,) = buf.try_start_group("a")
    assert buf.begin_turn(a, 0) == "continue"
    buf.record_tokens(a, [0])
    bump(buf, "b")  # version 1, workers still at 0
    (c,) = buf.try_start_group("c")
    assert buf.begin_turn(c, 0) == "wait"  # its first token (0) could only join the next batch
    assert buf.begin_turn(c, 1) == "continue"
    assert buf.begin_turn(a, 0) == "continue"  # not a first token: the plain rule applies
    plain = SampleBuffer(alpha=1, batch_size=1, group_size=1)
    bump(plain, "b")
    (d,) = plain.try_start_group("d")
    assert plain.begin_turn(d, 0) == "continue"


# ---------------------------------------------------------------------------------- abort stale
@pytest.mark.parametrize("abort_stale", [True, False])
def test_abort_stale_lists_running_trajectories_that_a_bump_made_stale(abort_stale) -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, abort_stale=abort_stale)
    (a,) = buf.try_start_group("a")
    assert buf.begin_turn(a, 0) == "continue"
    buf.record_tokens(a, [0])
    bump(buf, "b1")
    assert buf.drain_aborts() == []  # version 1: tokens of 0 still admissible
    bump(buf, "b2")
    if not abort_stale:
        assert buf.drain_aborts() == []
        return
    assert buf.drain_aborts() == [a]
    assert buf.drain_aborts() == []  # listed once
    assert buf.begin_turn(a, 2) == "restart"
    fresh = buf.restart_trajectory(a)
    assert fresh is not None and buf.stats().wasted_tokens == {"stale": 1}


# ---------------------------------------------------------------------------------- capacity
def test_has_capacity_counts_still_admissible_groups_against_the_batches_a_group_can_join() -> None:
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=1)  # 2 groups per batch, 4 in flight
    # version 0, next batch at 0; serving 0: batches 0 and 1 -> 4 groups
    for key in ("a", "b", "c"):
        (tid,) = buf.try_start_group(key)
        assert buf.begin_turn(tid, 0) == "continue"
        buf.record_tokens(tid, [0])
        buf.complete(tid, sample(tid, key, [0]))
    assert buf.has_capacity(0)  # 3 < 4
    (d,) = buf.try_start_group("d")
    assert not buf.has_capacity(0)  # 4 eligible groups fill both batches (and max_groups)
    assert [s.sample_id for s in buf.take_batch()] == ["a/0", "b/1"]
    # batch outstanding at 0: next batch at 1; serving 0 can only join it -> 2 groups (c, d)
    assert not buf.has_capacity(0)
    assert buf.has_capacity(1)  # serving 1 could join batches 1 and 2 -> 4 > 2
    assert not buf.has_capacity(1, alpha=0) and buf.has_capacity(1, alpha=2)
    buf.advance_version()
    # c's and d's tokens (0) are still admissible at 1; a bump to 2 would make them stale
    assert buf.has_capacity(1) and not buf.has_capacity(0)
    assert buf.begin_turn(d, 1) == "continue"
    buf.record_tokens(d, [1])
    buf.complete(d, sample(d, "d", [1]))
    assert [s.sample_id for s in buf.take_batch()] == ["c/2", "d/3"]
    buf.advance_version()  # version 2: nothing in flight
    assert buf.has_capacity(1) and not buf.has_capacity(0)  # serving 0 < 2 - 1: too old


# ------------------------------------------------------------------- AReaL's policy
def test_areal_keeps_a_sample_that_finished_stale_and_reports_its_staleness() -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, check="admission",
                       staleness_control="areal")
    (x,) = buf.try_start_group("x")
    assert buf.begin_turn(x, 0) == "continue"
    buf.record_tokens(x, [0])
    bump(buf, "a")
    bump(buf, "b")
    bump(buf, "c")  # version 3: x's first token is 3 versions old (> alpha)
    assert buf.begin_turn(x, 0) == "continue"  # no per-turn check, no wait for the worker
    buf.record_tokens(x, [3])
    assert buf.complete(x, sample(x, "x", [0, 3])) == []
    (s,) = buf.take_batch()
    assert s.sample_id == x
    st = buf.stats()
    assert (st.dropped, st.wasted_tokens, st.last_batch_max_staleness) == ({}, {}, 3)
    assert buf.drain_restarts() == []


def test_strict_bound_drops_what_areal_keeps() -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, check="admission")
    (x,) = buf.try_start_group("x")
    assert buf.begin_turn(x, 0) == "continue"
    buf.record_tokens(x, [0])
    for key in "abc":
        bump(buf, key)
    buf.record_tokens(x, [3])
    buf.complete(x, sample(x, "x", [0, 3]))
    assert buf.take_batch() is None and buf.stats().dropped == {"stale": 1}


def test_areal_capacity_formula_counts_admitted_groups_until_the_version_advances() -> None:
    # (eta + v + 1) * B / G = (1 + 0 + 1) * 2 = 4 groups at version 0.
    buf = SampleBuffer(alpha=1, batch_size=4, group_size=2, staleness_control="areal")
    keys = [f"g{i}" for i in range(4)]
    for k in keys:
        assert buf.try_start_group(k) is not None
    assert not buf.has_room() and buf.try_start_group("g4") is None
    for k in keys[:2]:
        for tid in [t for t in buf.running_ids() if buf.group_of(t) == k]:
            run(buf, tid, [0])
    assert len(buf.take_batch()) == 4
    # Consumed, but v is still 0 until the update is applied: AReaL admits nothing new
    # (the strict buffer would, as its bound counts groups in flight).
    assert buf.groups_in_flight == 2 and not buf.has_room()
    buf.advance_version()
    assert buf.has_room()
    assert buf.try_start_group("g4") is not None and buf.try_start_group("g5") is not None
    assert buf.try_start_group("g6") is None


def test_areal_retired_group_frees_its_capacity_and_restore_keeps_the_count() -> None:
    buf = SampleBuffer(alpha=0, batch_size=2, group_size=2, max_attempts=1,
                       staleness_control="areal")
    a, b = buf.try_start_group("g")
    assert buf.try_start_group("h") is None
    buf.fail(a, "env_error")  # the group can no longer fill: retired, "rejected" in AReaL
    assert buf.stats().groups_retired == 1
    # Out of AReaL's count, but in flight (max_groups 1) until its live member is cancelled.
    assert buf.try_start_group("h") is None
    assert buf.begin_turn(b, 0) == "cancel"
    buf.cancel(b)
    assert buf.try_start_group("h") is not None
    snap = msgspec.json.decode(msgspec.json.encode(buf.snapshot()))
    back = SampleBuffer.restore(snap)
    assert back.staleness_control == "areal"
    assert back.try_start_group("k") is None


def test_areal_admission_keeps_the_in_flight_bound_while_a_retired_group_has_live_members(
) -> None:
    # AReaL refunds a retired group's capacity at once, but its straggler keeps it in flight:
    # admitting on the refund alone put 3 groups in flight with max_groups 2.
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=2, redundancy=1, max_attempts=1,
                       check="admission", staleness_control="areal")
    assert buf.max_groups == 2
    for key in ("g0", "g1"):
        first, second, third = buf.try_start_group(key)
        run(buf, first, [0])
        assert run(buf, second, [0]) == [third]  # selection "first": surplus cancelled
        buf.cancel(third)
    assert {s.group_key for s in buf.take_batch()} == {"g0"}
    buf.advance_version()  # version 1; g1 complete and held
    snap = msgspec.json.decode(msgspec.json.encode(buf.snapshot()))
    buf = SampleBuffer.restore(snap)  # admitted 1 * 1 + 1 of a capacity (1 + 1 + 1) * 1
    a, b, c = buf.try_start_group("g2")
    buf.cancel(a)
    assert buf.begin_turn(b, 1) == "continue"
    buf.record_tokens(b, [1])
    buf.cancel(b)  # g2 can no longer fill: retired, c still running
    assert buf.stats().groups_retired == 1 and buf.is_live(c)
    assert buf.groups_in_flight == 2 and not buf.has_room()
    assert buf.try_start_group("g3") is None
    st = buf.stats()
    assert st.groups_in_flight <= st.max_groups
    assert st.in_flight <= st.in_flight_bound <= 2 * 2 + 1 * buf.max_groups
    assert buf.begin_turn(c, 1) == "cancel"
    buf.cancel(c)  # g2 leaves: room again, within AReaL's capacity
    assert buf.groups_in_flight == 1 and buf.try_start_group("g3") is not None
    assert buf.try_start_group("g4") is None


def test_staleness_control_is_validated() -> None:
    with pytest.raises(ConfigError, match="staleness_control"):
        SampleBuffer(alpha=1, batch_size=1, group_size=1,
                     staleness_control="loose")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- cost
def test_take_batch_checks_only_candidate_groups_while_nothing_is_stale(monkeypatch) -> None:
    buf = SampleBuffer(alpha=100, batch_size=4, group_size=2)
    second = []
    for i in range(40):  # 40 groups with one member kept each: none complete
        tid, other = buf.try_start_group(f"g{i}")
        run(buf, tid, [0])
        second.append(other)
    assert buf.take_batch() is None  # the first sweep visits every sample once
    run(buf, second[0], [0])  # g0 complete: 1 of the 2 groups a batch needs
    checked = {"ok": 0, "complete": 0}

    def counting(name: str, fn):
        def wrapped(*args):
            checked[name] += 1
            return fn(*args)
        return wrapped

    buf._ok = counting("ok", buf._ok)
    monkeypatch.setattr(Group, "is_complete", counting("complete", Group.is_complete))
    # What a completion's take_batch and a stats() call cost does not grow with the 40 groups
    # and 41 held samples in flight: no staleness re-check (nothing can be stale); take_batch
    # looks at no group while fewer complete groups than a batch needs are listed (default
    # policy), ready_samples at the complete one only.
    assert buf.take_batch() is None
    assert checked == {"ok": 0, "complete": 0}
    assert buf.ready_samples() == 2
    assert checked == {"ok": 0, "complete": 1}
    run(buf, second[1], [0])
    assert [s.group_key for s in buf.take_batch()] == ["g0", "g0", "g1", "g1"]


def test_tokens_of_an_old_version_recorded_after_a_sweep_are_still_swept() -> None:
    buf = SampleBuffer(alpha=1, batch_size=1, group_size=1, abort_stale=True)
    (a,) = buf.try_start_group("a")
    assert buf.begin_turn(a, 0) == "continue"  # no tokens yet
    for key in ("b1", "b2"):
        (tid,) = buf.try_start_group(key)
        run(buf, tid, [buf.version])
        assert [s.sample_id for s in buf.take_batch()] == [tid]
        buf.advance_version()
    assert buf.version == 2 and buf.drain_aborts() == []
    buf.record_tokens(a, [0])  # a worker still serving version 0: stale at 2 with alpha 1
    (c,) = buf.try_start_group("c")
    assert buf.take_batch() is None  # a completion's take_batch sweeps
    assert buf.drain_aborts() == [a]


def test_drop_group_retires_it_counts_the_reason_and_returns_live_members() -> None:
    buf = SampleBuffer(alpha=1, batch_size=2, group_size=2, redundancy=1)
    a, b, c = buf.try_start_group("g0")
    run(buf, a, [0])  # one member held
    assert buf.fail(b, "env_error") is not None  # its retry is live
    retry = buf.running_ids()[-1]
    assert buf.open_groups() == [("g0", "default", 1, [retry, c])]  # slot order
    assert buf.drop_group("g0", "failure_budget") == [retry, c]
    for tid in (c, retry):
        buf.cancel(tid)
    st = buf.stats()
    assert st.groups_dropped == {"failure_budget": 1}
    assert st.groups_retired == 1 and st.dropped == {"retired": 1}
    assert st.groups_in_flight == 0 and buf.open_groups() == []
    assert buf.drop_group("g0", "failure_budget") == []  # gone: a no-op
    assert st.generated_tokens == st.trained_tokens + sum(st.wasted_tokens.values()) \
        + st.in_flight_tokens
    buf.try_start_group("g1")
    with pytest.raises(SampleBufferError, match="needs a reason"):
        buf.drop_group("g1", "")


def test_stats_gauges_count_running_and_held_members_once() -> None:
    buf = SampleBuffer(alpha=0, batch_size=8, group_size=4)
    done, slow, idle, other = buf.try_start_group("a")
    run(buf, done, [0, 0, 0])
    for tid, versions in ((slow, [0, 0]), (other, [0])):
        assert buf.begin_turn(tid, 0) == "continue"
        buf.record_tokens(tid, versions)
    st = buf.stats()
    assert (st.running, st.held, st.in_flight) == (3, 1, 4)
    # Every member's tokens counted once, as the per-member definition gives them.
    groups = buf._groups.values()
    want = sum(t.num_tokens for g in groups for t in (*g.live(), *g.kept, *g.finished))
    assert st.in_flight_tokens == want and want >= 3 + 2 + 1
    assert buf.group_of(idle) == "a"
