"""WeightPublisher: background pushes, reports, bringing a lagging worker to the latest version."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollart.transport.errors import PeerDeadError
from rollart.weights.push import WeightPublisher, snapshot_parameters


class FakeSink:
    def __init__(self, name: str, delay_s: float = 0.0, fail: bool = False,
                 dies: bool = False) -> None:
        self.name = name
        self.delay_s = delay_s
        self.fail = fail
        self.dies = dies  # the push fails because the peer was declared dead
        self.dead = False
        self.calls = 0
        self.received: list[tuple[int, list[str]]] = []
        self.closed = False

    async def push_weights(self, version, named_tensors, *, bucket_bytes):
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.dies:
            self.dead = True
            raise PeerDeadError(f"{self.name} silent for 12.0 s")
        if self.fail:
            raise ConnectionError("worker unreachable")
        self.received.append((version, [n for n, _ in named_tensors]))

    async def close(self):
        self.closed = True


def test_snapshot_sends_tied_weights_once_and_is_a_copy():
    emb = torch.nn.Embedding(4, 2)
    model = torch.nn.Module()
    model.embed = emb
    model.head = torch.nn.Linear(2, 4, bias=False)
    model.head.weight = emb.weight  # tied
    snap = snapshot_parameters(model)
    assert [n for n, _ in snap] == ["embed.weight"]
    with torch.no_grad():
        emb.weight.add_(1.0)
    assert not torch.equal(snap[0][1], emb.weight)


async def test_publish_runs_in_background_and_reports_failures():
    sinks = {"a": FakeSink("a", delay_s=0.05), "b": FakeSink("b", fail=True)}
    pub = WeightPublisher(lambda addr: sinks[addr], bucket_bytes=1024)
    await pub.set_workers(["a", "b"])
    tensors = [("w", torch.zeros(3, 4))]
    pub.publish(1, tensors)
    assert sinks["a"].received == []  # not blocked on the push
    report = await pub.wait(1, timeout_s=5)
    assert report.version == 1 and report.num_bytes == 48
    assert sinks["a"].received == [(1, ["w"])]
    assert set(report.failed) == {"b"} and "unreachable" in report.failed["b"]
    with pytest.raises(ValueError, match="not newer"):
        pub.publish(1, tensors)
    await pub.close()
    assert sinks["a"].closed


async def test_ensure_staged_pushes_only_to_workers_the_steps_push_missed():
    sinks = {"a": FakeSink("a"), "late": FakeSink("late")}
    pub = WeightPublisher(lambda addr: sinks[addr], bucket_bytes=1024)
    await pub.set_workers(["a"])
    pub.publish(1, [("w", torch.zeros(1))])
    report = await pub.ensure_staged(1, ["a", "late"])
    assert report.version == 1 and report.workers == ["a", "late"] and report.failed == {}
    # "a" got version 1 once (from the step's push), "late" once (brought to it now).
    assert sinks["a"].received == [(1, ["w"])] and sinks["late"].received == [(1, ["w"])]
    # "late" is in the push set now: the next step's push reaches it and nothing is re-sent.
    pub.publish(2, [("w", torch.ones(1))])
    report = await pub.ensure_staged(2, ["a", "late"])
    assert [v for v, _ in sinks["late"].received] == [1, 2] and sinks["late"].calls == 2
    await pub.close()


async def test_ensure_staged_refuses_a_superseded_version_for_a_missing_worker():
    # A resumed trainer published version 2 before any worker was registered: its report
    # lists no worker, so every worker asked for is brought to it; a superseded version cannot.
    sinks = {"a": FakeSink("a")}
    pub = WeightPublisher(lambda addr: sinks[addr], bucket_bytes=1024)
    pub.publish(2, [("w", torch.zeros(1))])
    report = await pub.ensure_staged(2, ["a"])
    assert report.workers == ["a"] and sinks["a"].received == [(2, ["w"])]
    pub.publish(3, [("w", torch.ones(1))])  # pushed to "a" (registered now)
    await pub.wait(3)
    sinks["b"] = FakeSink("b")
    await pub.set_workers(["a"])
    with pytest.raises(LookupError, match="superseded by 3"):
        await pub.ensure_staged(2, ["b"])
    with pytest.raises(KeyError):
        await pub.ensure_staged(7, ["a"])
    await pub.close()


async def test_push_latest_brings_a_new_worker_to_the_newest_version():
    sinks = {"a": FakeSink("a"), "late": FakeSink("late")}
    pub = WeightPublisher(lambda addr: sinks[addr], bucket_bytes=1024)
    await pub.set_workers(["a"])
    pub.publish(1, [("w", torch.zeros(1))])
    pub.publish(2, [("w", torch.ones(1))])
    await pub.wait(2)
    report = await pub.push_latest(["late"])
    assert report.version == 2 and sinks["late"].received == [(2, ["w"])]
    await pub.close()


async def test_a_dead_worker_is_marked_and_skipped_by_later_pushes(caplog):
    sinks = {"a": FakeSink("a"), "dead": FakeSink("dead", dies=True)}
    pub = WeightPublisher(lambda addr: sinks[addr], bucket_bytes=1024)
    await pub.set_workers(["a", "dead"])
    pub.publish(1, [("w", torch.zeros(1))])
    first = await pub.wait(1, timeout_s=5)
    assert "silent for 12.0 s" in first.failed["dead"]
    assert "unreachable since version 1" in pub.unreachable["dead"]
    assert any("later versions skip it" in r.getMessage() for r in caplog.records)
    pub.publish(2, [("w", torch.ones(1))])
    second = await pub.wait(2, timeout_s=5)
    assert sinks["dead"].calls == 1  # not tried again: no wait on the dead peer
    assert "skipped" in second.failed["dead"] and sinks["a"].received[-1][0] == 2
    await pub.set_workers(["a"])  # removed, then registered again: a fresh client is tried
    sinks["dead"] = FakeSink("dead")
    await pub.set_workers(["a", "dead"])
    assert "dead" not in pub.unreachable
    report = await pub.push_latest(["dead"])
    assert report.failed == {} and sinks["dead"].received == [(2, ["w"])]
    await pub.close()


async def test_a_push_over_its_timeout_marks_the_worker_unreachable():
    sinks = {"slow": FakeSink("slow", delay_s=30.0)}
    pub = WeightPublisher(lambda addr: sinks[addr], bucket_bytes=1024, push_timeout_s=0.05)
    await pub.set_workers(["slow"])
    pub.publish(1, [("w", torch.zeros(1))])
    report = await pub.wait(1, timeout_s=10)
    assert "TimeoutError" in report.failed["slow"]
    assert "push_timeout_s=0.05" in pub.unreachable["slow"]
    await pub.close()
