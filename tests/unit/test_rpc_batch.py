"""The batch envelope of ``rollart.transport.zmqloop``: many small RPC messages per ZeroMQ
message, one per peer per loop tick; truncated batches fail their broken entry only."""

from __future__ import annotations

import asyncio
import struct

import msgspec
import pytest
import uvloop
import zmq
import zmq.asyncio

from rollart.transport import messages as m
from rollart.transport.rpc import RpcClient, RpcServer
from rollart.transport.security import env_credentials
from rollart.transport.zmqloop import BATCH_BODY_BYTES

LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
_dec = msgspec.msgpack.Decoder(m.Reply)


def _entry(call_id: int, body: bytes) -> bytes:
    return struct.pack(">IQ", len(body), call_id) + body


def _replies(frames: list[bytes]) -> tuple[bool, list[tuple[int, m.Msg]]]:
    """(was it a batch, [(call id, reply)]) of one ZeroMQ message received by a DEALER."""
    if frames[0] != b"":
        return False, [(struct.unpack(">Q", frames[0])[0], _dec.decode(frames[1]))]
    blob, out, pos = frames[1], [], 0
    while pos < len(blob):
        length, call_id = struct.unpack_from(">IQ", blob, pos)
        out.append((call_id, _dec.decode(blob[pos + 12:pos + 12 + length])))
        pos += 12 + length
    return True, out


async def _raw_batch() -> None:
    async def ack(msg: m.EnvClose, _frames):
        return m.Ack(detail=msg.session_id)

    server = RpcServer("tcp://127.0.0.1:0", {m.EnvClose: ack}, name="batch", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    env_credentials().secure_client(raw)  # the run's key, as every client
    raw.connect(server.address)
    try:
        enc = msgspec.msgpack.encode
        blob = (_entry(1, enc(m.EnvClose(session_id="a")))
                + _entry(2, enc(m.EnvClose(session_id="b")))
                + _entry(3, b"\xc1")  # undecodable body: fails entry 3 only
                + _entry(4, enc(m.EnvClose(session_id="d")))[:-3])  # truncated last entry
        await raw.send_multipart([b"", blob])
        got: dict[int, list[m.Msg]] = {}
        batches = 0
        while sum(len(v) for v in got.values()) < 4:
            frames = await asyncio.wait_for(raw.recv_multipart(), 60)
            was_batch, replies = _replies(frames)
            batches += was_batch
            for call_id, reply in replies:
                got.setdefault(call_id, []).append(reply)
        assert [r.detail for r in got[1]] == ["a"] and [r.detail for r in got[2]] == ["b"]
        assert got[3][0].code == "bad_request" and "undecodable" in got[3][0].message
        assert got[0][0].code == "bad_request"  # the truncated entry has no call id to answer
        # Replies finished in the same tick went back to this peer as one batch.
        assert batches >= 1
    finally:
        raw.close(linger=0)
        await server.close()
        serving.cancel()


@LOOPS
def test_server_unpacks_a_batch_and_fails_only_its_broken_entries(run) -> None:
    run(_raw_batch())


async def _mixed_sizes() -> None:
    # Small bodies go in batches, bodies over BATCH_BODY_BYTES and tensor frames alone;
    # all of them, sent in one tick, must come back matched.
    async def echo(msg: m.EnvStep, frames):
        reply = m.EnvStepResult(session_id=msg.session_id, observation=msg.action, reward=0.0,
                                terminated=False, truncated=False)
        return reply, [bytes(f) for f in frames]

    server = RpcServer("tcp://127.0.0.1:0", {m.EnvStep: echo}, name="mixed", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    client = RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials())
    try:
        sizes = [0, 10, BATCH_BODY_BYTES + 1, 3 * BATCH_BODY_BYTES, 5, 0, 2 * BATCH_BODY_BYTES]
        calls = [client.call(m.EnvStep(session_id=str(i), action="x" * n),
                             buffers=[b"t" * i] if i % 3 == 0 else (), timeout_s=120)
                 for i, n in enumerate(sizes)]
        replies = await asyncio.gather(*calls)
        for i, ((reply, frames), n) in enumerate(zip(replies, sizes, strict=True)):
            assert reply.session_id == str(i) and reply.observation == "x" * n
            assert [bytes(f) for f in frames] == ([b"t" * i] if i % 3 == 0 else [])
    finally:
        await client.close()
        await server.close()
        serving.cancel()


@LOOPS
def test_small_large_and_framed_messages_in_one_tick_all_match(run) -> None:
    run(_mixed_sizes())


_GOOD = msgspec.msgpack.encode(m.EnvClose(session_id="ok"))


@pytest.mark.parametrize(
    ("frames", "message"),
    [
        ([b"", _entry(5, _GOOD)[:7]], "entry 0 at byte 0 has 7 bytes, less than its 12-byte"),
        ([b"", _entry(5, _GOOD) + struct.pack(">IQ", 99, 6) + b"ab"],
         f"entry 1 at byte {12 + len(_GOOD)} declares a 99-byte body but only 2 bytes follow"),
        ([b"", struct.pack(">IQ", 0xFFFFFFFF, 7) + _GOOD],
         "declares a 4294967295-byte body"),
        ([b"", b""], "empty batch envelope"),
        ([b""], "a batch envelope is [empty frame, blob]: got 1 frames"),
        ([b"", _entry(8, _GOOD), b"extra"], "a batch envelope is [empty frame, blob]: got 3"),
    ],
    ids=["short-header", "length-past-blob", "huge-length", "empty-blob", "no-blob", "extra"],
)
def test_a_malformed_batch_envelope_gets_an_error_naming_the_problem(frames, message) -> None:
    async def main() -> None:
        async def ack(msg: m.EnvClose, _frames):
            return m.Ack(detail=msg.session_id)

        server = RpcServer("tcp://127.0.0.1:0", {m.EnvClose: ack}, name="env", auth=env_credentials())
        serving = asyncio.create_task(server.serve_forever())
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        env_credentials().secure_client(raw)  # the run's key, as every client
        raw.connect(server.address)
        try:
            await raw.send_multipart(frames)
            errors, acks = [], []
            while not errors:
                _, replies = _replies(await asyncio.wait_for(raw.recv_multipart(), 60))
                for call_id, reply in replies:
                    (errors if isinstance(reply, m.ErrorReply) else acks).append((call_id, reply))
            assert [(c, e.code) for c, e in errors] == [(0, "bad_request")]
            assert message in errors[0][1].message
            # Entries before the broken one were served; the server keeps serving.
            async with RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials()) as client:
                reply, _ = await client.call(m.EnvClose(session_id="after"), timeout_s=60)
            assert reply == m.Ack(detail="after")
        finally:
            raw.close(linger=0)
            await server.close()
            serving.cancel()

    asyncio.run(main())
