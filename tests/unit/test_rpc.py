"""RPC over real ZeroMQ sockets in one process: matching, errors, bad input, liveness."""

from __future__ import annotations

import asyncio
import os
import struct

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from rollart.transport import messages as m
from rollart.transport.errors import PeerDeadError, RemoteError, RemoteTimeoutError
from rollart.transport.rpc import RpcClient, RpcServer
from rollart.transport.security import env_credentials
from rollart.weights.buckets import crc32_hex, decode_bucket, iter_buckets


async def _start(handlers, **kw):
    server = RpcServer("tcp://127.0.0.1:0", handlers, name="test", **kw, auth=env_credentials())
    task = asyncio.create_task(server.serve_forever())
    return server, task


async def test_concurrent_calls_are_matched_by_call_id():
    async def step(msg: m.EnvStep, _frames):
        # Later requests finish first, so replies arrive out of order.
        await asyncio.sleep(0.05 * (5 - int(msg.action)))
        return m.EnvStepResult(
            session_id=msg.session_id, observation=msg.action, reward=0.0,
            terminated=False, truncated=False,
        )

    server, task = await _start({m.EnvStep: step})
    client = RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials())
    try:
        replies = await asyncio.gather(
            *(client.call(m.EnvStep(session_id="s", action=str(i))) for i in range(5))
        )
        assert [r.observation for r, _ in replies] == [str(i) for i in range(5)]
        pong, _ = await client.call(m.Ping())
        assert isinstance(pong, m.Pong) and pong.pid == os.getpid()
    finally:
        await client.close()
        await server.close()
        task.cancel()


async def test_handler_error_is_per_item_and_server_keeps_serving():
    async def boom(msg: m.EnvClose, _frames):
        if msg.session_id == "bad":
            raise ValueError("kaput")
        return m.Ack()

    server, task = await _start({m.EnvClose: boom})
    client = RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials())
    try:
        with pytest.raises(RemoteError) as info:
            await client.call(m.EnvClose(session_id="bad"))
        assert info.value.code == "internal" and "kaput" in info.value.message
        with pytest.raises(RemoteError) as info:
            await client.call(m.Generate(
                request_id="r", new_token_ids=b"\x01\x00\x00\x00",
                sampling=m.SamplingParams(max_tokens=1)))
        assert info.value.code == "unknown_kind"
        reply, _ = await client.call(m.EnvClose(session_id="ok"))
        assert isinstance(reply, m.Ack)
    finally:
        await client.close()
        await server.close()
        task.cancel()


async def test_malformed_unknown_and_oversized_messages_get_error_replies():
    async def ack(_msg, _frames):
        return m.Ack()

    server, task = await _start({m.EnvClose: ack}, max_message_bytes=1024)
    ctx = zmq.asyncio.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    env_credentials().secure_client(raw)  # the run's key, as every client
    raw.connect(server.address)
    dec = msgspec.msgpack.Decoder(m.Reply)

    async def send(frames):
        await raw.send_multipart(frames)
        call_id, body, *_ = await asyncio.wait_for(raw.recv_multipart(), 5)
        return struct.unpack(">Q", call_id)[0], dec.decode(body)

    try:
        cid = struct.pack(">Q", 7)
        _, r = await send([cid, b"\xc1garbage"])
        assert r.code == "bad_request" and "undecodable" in r.message
        _, r = await send([cid, msgspec.msgpack.encode({"kind": "Nope"})])
        assert r.code == "unknown_kind"
        _, r = await send([cid, msgspec.msgpack.encode({"kind": "EnvClose", "bogus": 1})])
        assert r.code == "bad_request" and "bogus" in r.message
        _, r = await send([cid, msgspec.msgpack.encode({"kind": "EnvClose"})])
        assert r.code == "bad_request" and "session_id" in r.message
        _, r = await send([cid, msgspec.msgpack.encode(m.EnvClose(session_id="x")), b"x" * 2000])
        assert r.code == "too_large" and "1024" in r.message
        got_id, r = await send([b"short", b"x"])
        assert got_id == 0 and r.code == "bad_request"
        got_id, r = await send([cid, msgspec.msgpack.encode(m.EnvClose(session_id="x"))])
        assert got_id == 7 and isinstance(r, m.Ack)
    finally:
        raw.close(linger=0)
        await server.close()
        task.cancel()


async def test_timeout_and_dead_peer_are_distinct():
    async def hang(_msg, _frames):
        await asyncio.sleep(3600)

    server, task = await _start({m.EnvStep: hang})
    client = RpcClient(server.address, heartbeat_interval_s=0.05, liveness_timeout_s=0.3, auth=env_credentials())
    try:
        with pytest.raises(RemoteTimeoutError):
            await client.call(m.EnvStep(session_id="s", action="a"), timeout_s=0.1)
        assert not client.dead  # heartbeats still answered
        pending = asyncio.create_task(client.call(m.EnvStep(session_id="s", action="a"),
                                                  timeout_s=60))
        await asyncio.sleep(0.1)
        await server.close()
        task.cancel()
        with pytest.raises(PeerDeadError):
            await asyncio.wait_for(pending, 5)
        assert client.dead
        with pytest.raises(PeerDeadError):
            await client.call(m.Ping())
    finally:
        await client.close()


async def test_tensor_buckets_round_trip_and_checksum():
    tensors = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
               ("b", torch.ones(4, dtype=torch.bfloat16)),
               ("c", torch.zeros(100, dtype=torch.float16))]
    buckets = list(iter_buckets(tensors, bucket_bytes=40))
    assert [[mm.name for mm in metas] for metas, _ in buckets] == [["a", "b"], ["c"]]
    out = []
    for metas, frames in buckets:
        out += decode_bucket(metas, [bytes(f) for f in frames], crc32_hex(frames))
    for (n1, t1), (n2, t2) in zip(tensors, out, strict=True):
        assert n1 == n2 and t1.dtype == t2.dtype and torch.equal(t1, t2)
    metas, frames = buckets[0]
    corrupted = [bytes(frames[0]), b"\x00" * frames[1].nbytes]
    with pytest.raises(RemoteError) as info:
        decode_bucket(metas, corrupted, crc32_hex(frames))
    assert info.value.code == "checksum_mismatch"
