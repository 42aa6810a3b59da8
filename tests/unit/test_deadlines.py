"""``rollart.transport.deadlines``: a call expires no earlier than its timeout and at most one
granularity later, with one armed timer however many calls are filed (fake clock, no sleeps)."""

from __future__ import annotations

import random
import struct

import pytest

from rollart.transport import deadlines
from rollart.transport.deadlines import DeadlineWheel


class FakeTimer:
    def __init__(self, loop: FakeLoop, when: float, callback) -> None:
        self.loop, self.when, self.callback, self.cancelled = loop, when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """A clock advanced by hand; ``early_s`` runs timers that much before their time, as a real
    loop may within its clock resolution."""

    def __init__(self, early_s: float = 0.0) -> None:
        self.now = 1000.0
        self.early_s = early_s
        self.timers: list[FakeTimer] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback) -> FakeTimer:
        timer = FakeTimer(self, when, callback)
        self.timers.append(timer)
        return timer

    def armed(self) -> list[FakeTimer]:
        return [t for t in self.timers if not t.cancelled]

    def advance(self, dt: float) -> None:
        self.now += dt
        due = [t for t in self.armed() if t.when - self.early_s <= self.now]
        for timer in due:
            timer.cancelled = True  # a fired handle is spent
            timer.callback()


def _id(n: int) -> bytes:
    return struct.pack(">Q", n)


@pytest.mark.parametrize("early_s", [0.0, 0.004])
def test_calls_expire_no_earlier_than_their_timeout_and_at_most_a_granularity_later(early_s):
    loop = FakeLoop(early_s)
    expired: dict[bytes, tuple[float, str, float]] = {}
    live: set[bytes] = set()

    def on_expired(cid: bytes, kind: str, t: float) -> None:
        live.remove(cid)  # only a call still waiting is handed over, and only once
        expired[cid] = (loop.now, kind, t)

    wheel = DeadlineWheel(loop, on_expired, live, granularity_s=0.1)
    rng = random.Random(0)
    filed: dict[bytes, tuple[float, float]] = {}
    step = 0.003  # the largest clock step of this test
    for n in range(1, 2001):
        timeout = rng.choice([0.05, 0.3, 1.0, 2.5]) + rng.random() * 0.01
        live.add(_id(n))
        wheel.add(_id(n), "EnvStep", timeout)
        filed[_id(n)] = (loop.now, timeout)
        loop.advance(rng.random() * step)
        assert len(loop.armed()) <= 1
    while len(expired) < len(filed):
        loop.advance(step)
        assert len(loop.armed()) <= 1
    for cid, (issued, timeout) in filed.items():
        at, kind, given = expired[cid]
        assert kind == "EnvStep" and given == timeout
        late = at - issued - timeout
        # The fake clock moves in steps of `step`: the bound holds up to one step.
        assert 0 <= late <= wheel.granularity_s + step + 1e-9, (issued, timeout, at)
    assert len(wheel) == 0 and not loop.armed()


def test_an_earlier_deadline_rearms_the_one_timer_and_close_disarms_it():
    loop = FakeLoop()
    expired: list[bytes] = []
    live = {_id(1), _id(2)}
    wheel = DeadlineWheel(loop, lambda cid, kind, t: expired.append(cid), live,
                          granularity_s=0.1)
    wheel.add(_id(1), "Generate", 600.0)
    first = loop.armed()
    assert len(first) == 1 and first[0].when >= loop.now + 600.0
    wheel.add(_id(2), "Ping", 10.0)
    (timer,) = loop.armed()
    assert loop.now + 10.0 <= timer.when <= loop.now + 10.1
    loop.advance(10.2)
    assert expired == [_id(2)] and len(loop.armed()) == 1  # re-armed for the 600 s call
    wheel.close()
    assert not loop.armed() and len(wheel) == 0
    loop.advance(1000.0)
    assert expired == [_id(2)]


def test_granularity_must_be_positive():
    with pytest.raises(ValueError, match="granularity_s"):
        DeadlineWheel(FakeLoop(), lambda *a: None, set(), granularity_s=0.0)


def test_an_infinite_timeout_never_expires_and_nan_is_refused():
    loop = FakeLoop()
    expired: list[bytes] = []
    live = {_id(1), _id(2)}
    wheel = DeadlineWheel(loop, lambda cid, kind, t: expired.append(cid), live,
                          granularity_s=0.1)
    wheel.add(_id(1), "Generate", float("inf"))
    assert len(wheel) == 0 and not loop.armed()
    with pytest.raises(ValueError, match="NaN"):
        wheel.add(_id(2), "Generate", float("nan"))
    loop.advance(1e9)
    assert expired == []


def test_completed_calls_stop_costing_memory_and_waiting_ones_still_expire_on_time(monkeypatch):
    """1000 calls/s with 600 s timeouts, most answered 0.1 s after they are filed: the wheel
    holds O(live) ids, not 600 s worth; a call never answered still expires on time."""
    monkeypatch.setattr(deadlines, "COMPACT_MIN_IDS", 64)
    loop = FakeLoop()
    live: dict[bytes, float] = {}  # id -> loop time it was filed
    expired: dict[bytes, float] = {}

    def on_expired(cid: bytes, kind: str, t: float) -> None:
        expired[cid] = loop.now - live.pop(cid) - t  # how late
    wheel = DeadlineWheel(loop, on_expired, live, granularity_s=0.1)
    answered: list[bytes] = []
    n, rate, latency, kinds = 10_000, 1000.0, 0.1, ("Generate", "EnvStep")
    max_live = peak = 0
    for i in range(1, n + 1):
        live[_id(i)] = loop.now
        wheel.add(_id(i), kinds[i % 2], 600.0)
        if i % 97:  # every 97th call never gets its reply
            answered.append(_id(i))
        while answered and live[answered[0]] <= loop.now - latency:
            del live[answered.pop(0)]
        loop.advance(1 / rate)
        max_live, peak = max(max_live, len(live)), max(peak, len(wheel))
    # Not 10k: dead ids beyond COMPACT_RATIO per live one go at the next bucket, and a
    # bucket opens every granularity (per kind): rate x granularity ids filed in between.
    assert peak <= (deadlines.COMPACT_RATIO + 1) * max_live + 64 + rate * 0.1 + 1, (peak, max_live)
    # Each compaction drops at least COMPACT_RATIO x (live) dead ids: amortised, not per call.
    assert 1 <= wheel.num_compactions <= n / (deadlines.COMPACT_RATIO * (latency * rate))
    for cid in answered:  # the last replies come
        del live[cid]
    never_answered = {_id(i) for i in range(97, n + 1, 97)}
    loop.advance(600.0 - n / rate)  # just before the first deadline
    assert not expired
    while loop.armed():
        loop.advance(0.01)
    assert expired.keys() == never_answered  # and no answered call was handed over
    assert all(0 <= late <= 0.1 + 0.01 + 1e-9 for late in expired.values())
    assert len(wheel) == 0 and not loop.armed()


def test_a_wheel_of_waiting_calls_never_compacts():
    loop = FakeLoop()
    live = {_id(i) for i in range(1, 20_001)}
    wheel = DeadlineWheel(loop, lambda *a: None, live, granularity_s=0.1)
    for i in range(1, 20_001):
        wheel.add(_id(i), "EnvStep", 120.0)
        loop.advance(0.001)
    assert len(wheel) == 20_000 and wheel.num_compactions == 0


def test_the_held_count_is_exact_through_bucket_openings_firings_and_compactions(monkeypatch):
    """``len`` is counted per bucket, not per call: it matches the ids the buckets hold after
    every step of a mix of lanes (kind, timeout), short timeouts firing while their lane is
    still open, answered and unanswered calls, and compactions."""
    monkeypatch.setattr(deadlines, "COMPACT_MIN_IDS", 32)
    loop = FakeLoop()
    live: set[bytes] = set()
    expired: list[bytes] = []

    def on_expired(cid: bytes, kind: str, t: float) -> None:
        live.remove(cid)
        expired.append(cid)
    wheel = DeadlineWheel(loop, on_expired, live, granularity_s=0.1)
    rng = random.Random(1)
    lanes = [("EnvStep", 0.05), ("EnvStep", 2.0), ("Generate", 0.7), ("Ping", 10.0)]
    for i in range(1, 5001):
        kind, timeout = rng.choice(lanes)
        live.add(_id(i))
        wheel.add(_id(i), kind, timeout)
        if live and rng.random() < 0.95:
            live.discard(rng.choice(sorted(live)[-50:]))  # a recent call is answered
        loop.advance(rng.random() * 0.004)
        assert len(wheel) == sum(len(ids) for ids in wheel._buckets.values()) // 8
    assert wheel.num_compactions > 0
    while loop.armed():
        loop.advance(0.05)
        assert len(wheel) == sum(len(ids) for ids in wheel._buckets.values()) // 8
    assert not live and len(wheel) == 0


def test_before_expiry_runs_once_per_firing_with_something_due_before_any_expiry():
    loop = FakeLoop()
    order: list[str] = []
    live = {_id(1), _id(2)}

    def drain() -> None:  # a reply read here completes its call: it must not expire
        order.append("drain")
        live.discard(_id(1))

    wheel = DeadlineWheel(loop, lambda cid, kind, t: order.append(f"expired {cid[-1]}"), live,
                          granularity_s=0.1, before_expiry=drain)
    wheel.add(_id(1), "Generate", 1.0)
    wheel.add(_id(2), "Generate", 1.0)
    loop.advance(1.2)
    assert order == ["drain", "expired 2"]
    loop.advance(10.0)  # nothing due: no drain
    assert order == ["drain", "expired 2"]


def test_a_failing_or_reentrant_before_expiry_leaves_the_wheel_working(monkeypatch, caplog):
    monkeypatch.setattr(deadlines, "COMPACT_MIN_IDS", 0)
    loop = FakeLoop()
    expired: list[bytes] = []
    live: set[bytes] = set()
    calls = 0

    def before() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("drain failed")
        # Files a call (a new lane: opens a bucket, which may compact the wheel).
        live.add(_id(99))
        wheel.add(_id(99), "Other", 0.3)

    wheel = DeadlineWheel(loop, lambda cid, kind, t: expired.append(cid), live,
                          granularity_s=0.1, before_expiry=before)
    live.add(_id(1))
    wheel.add(_id(1), "Ping", 0.1)
    loop.advance(0.2)  # the drain raises: the call expires anyway
    assert expired == [_id(1)] and "before_expiry failed" in caplog.text
    ids = [_id(n) for n in range(10, 50)]
    live.update(ids)
    for cid in ids:
        wheel.add(cid, "Generate", 0.1)
    live.add(_id(2))
    wheel.add(_id(2), "Ping", 0.1)
    live.difference_update(ids)  # completed: a compaction would drop them
    loop.advance(0.2)
    loop.advance(0.5)
    assert expired == [_id(1), _id(2), _id(99)]
