"""InferenceClient against a Fake worker served by a real RpcServer (no vLLM)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollart.inference.client import InferenceClient
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import PeerDeadError, RemoteError, RemoteTimeoutError
from rollart.transport.rpc import RpcServer
from rollart.transport.security import env_credentials
from rollart.weights.buckets import decode_bucket, plan_buckets


class FakeWorker:
    """Generate blocks until its request is aborted; records every Abort and WeightBucket."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.buckets: list[tuple[m.WeightBucket, list]] = []
        self.started: dict[str, asyncio.Event] = {}
        self._abort_events: dict[str, asyncio.Event] = {}

    def stats(self, version: int = 3) -> m.WorkerStats:
        return m.WorkerStats(
            worker="fake", num_running=len(self._abort_events), num_waiting=0, version=version
        )

    async def generate(self, msg: m.Generate, _frames):
        ev = self._abort_events.setdefault(msg.request_id, asyncio.Event())
        self.started.setdefault(msg.request_id, asyncio.Event()).set()
        if msg.sampling.max_tokens > 1:
            await ev.wait()
        self._abort_events.pop(msg.request_id, None)
        return m.GenerateResult(
            request_id=msg.request_id,
            token_ids=tb.pack_i32([1]),
            logprobs=tb.pack_f32([-0.5]),
            versions=tb.pack_i32([3]),
            finish_reason="abort" if ev.is_set() else "length",
            num_prompt_tokens=msg.num_new_tokens,
            stats=self.stats(),
        )

    async def abort(self, msg: m.Abort, _frames):
        self.aborted.append(msg.request_id)
        if ev := self._abort_events.get(msg.request_id):
            ev.set()
        return m.Ack()

    async def weight_bucket(self, msg: m.WeightBucket, frames):
        self.buckets.append((msg, [bytes(f) for f in frames]))
        return m.Ack()

    async def apply(self, msg: m.ApplyWeights, _frames):
        return m.WeightsApplied(
            version=msg.version, apply_time_s=0.01, stats=self.stats(version=msg.version)
        )

    async def get_stats(self, _msg, _frames):
        return self.stats()

    async def pause(self, _msg, _frames):
        return m.WorkerStats(worker="wrong", num_running=0, num_waiting=0, version=0)


@pytest.fixture
async def served():
    fake = FakeWorker()
    server = RpcServer(
        "tcp://127.0.0.1:0",
        {
            m.Generate: fake.generate,
            m.Abort: fake.abort,
            m.WeightBucket: fake.weight_bucket,
            m.ApplyWeights: fake.apply,
            m.GetStats: fake.get_stats,
            m.Pause: fake.pause,
        },
        name="fake",
        auth=env_credentials(),
    )
    task = asyncio.create_task(server.serve_forever())
    client = InferenceClient(server.address, name="fake", heartbeat_interval_s=0, auth=env_credentials())
    yield fake, server, client
    await client.close()
    await server.close()
    task.cancel()


def gen(rid: str, max_tokens: int = 100) -> m.Generate:
    return m.Generate(
        request_id=rid, new_token_ids=tb.pack_i32([1, 2]),
        sampling=m.SamplingParams(max_tokens=max_tokens),
    )


async def wait_until(cond, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        if cond():
            return
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        await asyncio.sleep(0.01)


async def test_cancelled_generate_sends_abort(served):
    fake, _, client = served
    task = asyncio.create_task(client.generate(gen("r1")))
    await wait_until(lambda: "r1" in fake.started)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The cancelled call left the pending table at once (what may wait there is the Abort).
    assert not any(f.cancelled() for f in client._rpc._pending.values())
    await wait_until(lambda: fake.aborted == ["r1"])
    # The worker still answers the aborted generate: a reply to a forgotten call, ignored.
    await wait_until(lambda: not client._rpc._pending and "r1" not in fake._abort_events)
    assert client._rpc.num_late_replies == 0 and not client.dead


async def test_generate_timeout_sends_abort(served):
    fake, _, client = served
    with pytest.raises(RemoteTimeoutError):
        await client.generate(gen("slow"), timeout_s=0.2)
    await wait_until(lambda: fake.aborted == ["slow"])


async def test_finished_generate_sends_no_abort_and_updates_stats(served):
    fake, _, client = served
    assert client.last_stats is None
    r = await client.generate(gen("quick", max_tokens=1))
    assert r.finish_reason == "length" and client.last_stats == r.stats
    await asyncio.sleep(0.05)
    assert fake.aborted == []
    assert (await client.stats()).version == 3


async def test_explicit_abort_ends_pending_generate(served):
    fake, _, client = served
    task = asyncio.create_task(client.generate(gen("r2")))
    await wait_until(lambda: "r2" in fake.started)
    await client.abort("r2")
    assert (await task).finish_reason == "abort"


async def test_unexpected_reply_type_is_an_error(served):
    _, _, client = served
    with pytest.raises(RemoteError, match="expected Ack"):
        await client.pause("keep")


async def test_unhandled_kind_surfaces_remote_error(served):
    _, _, client = served
    with pytest.raises(RemoteError) as info:
        await client.resume()
    assert info.value.code == "unknown_kind"


async def test_push_weights_buckets_with_valid_checksums(served):
    fake, _, client = served
    named = [(f"w{i}", torch.full((10, 10), float(i), dtype=torch.float32)) for i in range(5)]
    named.append(("big", torch.arange(500, dtype=torch.bfloat16)))  # 1000 bytes: alone
    await client.push_weights(7, named, bucket_bytes=900)  # 400 bytes each: 2 per bucket
    assert [b.bucket_index for b, _ in fake.buckets] == [0, 1, 2, 3]
    assert {b.num_buckets for b, _ in fake.buckets} == {4}
    assert {b.version for b, _ in fake.buckets} == {7}
    received = [
        t for b, frames in fake.buckets for t in decode_bucket(b.tensors, frames, b.checksum)
    ]
    assert [n for n, _ in received] == [n for n, _ in named]
    for (_, got), (_, want) in zip(received, named, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    applied = await client.apply_weights(7)
    assert applied.version == 7 and client.last_stats.version == 7


def test_plan_buckets_limits_and_errors():
    t = torch.zeros(25, dtype=torch.float32)  # 100 bytes
    assert [len(b) for b in plan_buckets([("a", t), ("b", t), ("c", t)], 200)] == [2, 1]
    assert [len(b) for b in plan_buckets([("a", torch.zeros(100))], 10)] == [1]  # oversize alone
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([("a", t)], 0)


async def test_dead_worker_raises_peer_dead_and_skips_abort(served):
    fake, server, _ = served
    client = InferenceClient(
        server.address, name="fake", heartbeat_interval_s=0.05, liveness_timeout_s=0.3,
        auth=env_credentials(),
    )
    try:
        task = asyncio.create_task(client.generate(gen("r3")))
        await wait_until(lambda: "r3" in fake.started)
        await server.close()  # the worker goes silent
        with pytest.raises(PeerDeadError):
            await task
        assert client.dead
        with pytest.raises(PeerDeadError):
            await client.stats()
    finally:
        await client.close()


async def test_resume_clears_the_paused_flag_of_the_last_stats() -> None:
    # Pause and Resume answer with an Ack (no stats): the last stats seen, from the weight
    # apply in between, say paused; read so after the resume, online affinity would judge the
    # pool neither saturated nor roomy until its next generate reply.
    paused_stats = m.WorkerStats(worker="w", num_running=3, num_waiting=5, version=1, paused=True)

    async def apply(msg, _frames):
        return m.WeightsApplied(version=msg.version, apply_time_s=0.0, stats=paused_stats)

    async def ack(_msg, _frames):
        return m.Ack()

    server = RpcServer("tcp://127.0.0.1:0", {m.ApplyWeights: apply, m.Pause: ack,
                                             m.Resume: ack},
                       name="w", auth=env_credentials())
    task = asyncio.create_task(server.serve_forever())
    client = InferenceClient(server.address, name="w", heartbeat_interval_s=0,
                             auth=env_credentials())
    try:
        await client.pause()
        assert client.last_stats is None  # nothing seen yet: nothing to mark
        await client.apply_weights(1)
        assert client.last_stats == paused_stats
        await client.resume()
        assert client.last_stats is not None and not client.last_stats.paused
        assert (client.last_stats.num_running, client.last_stats.num_waiting) == (3, 5)
        await client.pause()
        assert client.last_stats.paused
    finally:
        await client.close()
        await server.close()
        task.cancel()
