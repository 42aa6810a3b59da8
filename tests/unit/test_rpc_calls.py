"""What one in-flight RPC keeps alive and how it ends: no loop timer per call, no more
GC-tracked objects than a Task awaiting a future, the same timeout error, a reply without a
body failing its call only, and a cancelled call forgotten when its late reply comes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import struct
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
import zmq

from rollart.envhost.client import EnvClient
from rollart.transport import deadlines
from rollart.transport import messages as m
from rollart.transport.errors import EnvError, RemoteError, RemoteTimeoutError
from rollart.transport.rpc import RpcClient
from rollart.transport.security import env_credentials


class SilentPeer:
    """A ROUTER that takes requests and answers only when told (no Python object per request:
    what is counted in this process is the client's alone)."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        env_credentials().secure_server(self.sock)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def requests(self, n: int) -> list[list[bytes]]:
        """The first ``n`` requests, as ``[identity, call id, body]`` (batches unpacked)."""
        out: list[list[bytes]] = []
        while len(out) < n:
            for _ in range(600):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK)
                    break
                except zmq.Again:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"only {len(out)} of {n} requests arrived in 30 s")
            if frames[1] != b"":
                out.append(frames[:3])
                continue
            blob, pos = frames[2], 0
            while pos < len(blob):
                (length,) = struct.unpack_from(">I", blob, pos)
                out.append([frames[0], blob[pos + 4:pos + 12], blob[pos + 12:pos + 12 + length]])
                pos += 12 + length
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


async def _park(fut: asyncio.Future) -> None:
    await fut


async def test_in_flight_calls_arm_no_timer_each_and_keep_no_more_than_a_future_await():
    peer = SilentPeer()
    client = EnvClient(peer.address, auth=env_credentials(), heartbeat_interval_s=0)
    loop = asyncio.get_running_loop()
    n = 500
    try:
        gc.collect()
        base = len(gc.get_objects())
        futures = [loop.create_future() for _ in range(n)]
        parked = [loop.create_task(_park(f)) for f in futures]
        await asyncio.sleep(0)
        gc.collect()
        floor = len(gc.get_objects()) - base
        for f in futures:
            f.set_result(None)
        await asyncio.gather(*parked)
        del futures, parked, f
        gc.collect()
        base = len(gc.get_objects())
        timers0 = sum(type(o) is asyncio.TimerHandle for o in gc.get_objects())
        held = [loop.create_task(client.step("s", str(i))) for i in range(n)]
        await peer.requests(n)  # every request has left the client
        gc.collect()
        objects = gc.get_objects()
        in_flight = len(objects) - base
        timers = sum(type(o) is asyncio.TimerHandle for o in objects) - timers0
        del objects
        # One timer for the whole client (the deadline wheel), not one per call.
        assert timers <= 1
        # What a call keeps: its Task, coroutine, future and wake-up; nothing per call more.
        assert in_flight <= floor + n // 10, (in_flight, floor)
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
    finally:
        await client.close()
        peer.close()


async def test_a_timeout_raises_remote_timeout_error_with_the_same_message():
    peer = SilentPeer()
    client = RpcClient(peer.address, name="w0", auth=env_credentials(), heartbeat_interval_s=0)
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(RemoteTimeoutError) as err:
            await client.call(m.EnvStep(session_id="s", action="a"), timeout_s=0.2)
        assert loop.time() - t0 >= 0.2
        assert str(err.value) == "[timeout] w0: no reply to EnvStep within 0.2 s"
        assert err.value.code == "timeout"
        assert not client._pending  # the expired call is forgotten
    finally:
        await client.close()
        peer.close()


async def test_a_reply_without_a_body_fails_that_call_only_and_late_replies_are_dropped():
    peer = SilentPeer()
    client = RpcClient(peer.address, name="w0", auth=env_credentials(), heartbeat_interval_s=0)
    enc = msgspec.msgpack.encode
    try:
        bad = asyncio.ensure_future(client.submit(m.EnvClose(session_id="a"), timeout_s=60))
        good = asyncio.ensure_future(client.submit(m.EnvClose(session_id="b"), timeout_s=60))
        cancelled = client.submit(m.EnvClose(session_id="c"), timeout_s=60)
        (ident, id_a, _), (_, id_b, _), (_, id_c, _) = await peer.requests(3)
        cancelled.cancel()
        peer.sock.send_multipart([ident, id_a])  # no body
        peer.sock.send_multipart([ident, id_c, enc(m.Ack(detail="late"))])
        peer.sock.send_multipart([ident, id_b, enc(m.Ack(detail="b"))])
        with pytest.raises(RemoteError) as err:
            await asyncio.wait_for(bad, 30)
        assert err.value.code == "bad_reply" and "without a body" in err.value.message
        reply, frames = await asyncio.wait_for(good, 30)
        assert reply == m.Ack(detail="b") and frames == []
        assert not client._pending and not client.dead
    finally:
        await client.close()
        peer.close()


async def _replied_after(client: RpcClient, peer: SilentPeer, ident: bytes) -> None:
    """A call answered after the replies already sent: once it returns, the client has read
    them all (one peer's replies arrive in order)."""
    ping = client.submit(m.Ping(), timeout_s=60)
    (_, id_ping, _), = await peer.requests(1)
    peer.sock.send_multipart([ident, id_ping, msgspec.msgpack.encode(m.Ack(detail="after"))])
    await asyncio.wait_for(ping, 30)


async def test_timed_out_calls_are_counted_and_a_late_reply_is_told_from_a_lost_one():
    peer = SilentPeer()
    client = RpcClient(peer.address, name="w0", auth=env_credentials(), heartbeat_interval_s=0)
    enc = msgspec.msgpack.encode
    try:
        slow = client.submit(m.EnvClose(session_id="slow"), timeout_s=0.2)
        lost = client.submit(m.EnvClose(session_id="lost"), timeout_s=0.2)
        cancelled = client.submit(m.EnvClose(session_id="c"), timeout_s=60)
        (ident, id_slow, _), (_, _id_lost, _), (_, id_c, _) = await peer.requests(3)
        for fut in (slow, lost):
            with pytest.raises(RemoteTimeoutError):
                await fut
        cancelled.cancel()
        assert (client.num_timeouts, client.num_late_replies) == (2, 0)
        # the slow call's reply comes after its timeout; a cancelled call's reply is no
        # timed-out call's; the lost call's reply never comes
        peer.sock.send_multipart([ident, id_c, enc(m.Ack(detail="cancelled"))])
        peer.sock.send_multipart([ident, id_slow, enc(m.Ack(detail="late"))])
        peer.sock.send_multipart([ident, id_slow, enc(m.Ack(detail="twice"))])  # not again
        await _replied_after(client, peer, ident)
        assert (client.num_timeouts, client.num_late_replies) == (2, 1)
        assert client.num_timeouts - client.num_late_replies == 1  # the lost reply
    finally:
        await client.close()
        peer.close()


async def _a_reply_waiting_through_a_stall() -> None:
    peer = SilentPeer()
    client = RpcClient(peer.address, name="w0", auth=env_credentials(), heartbeat_interval_s=0)
    loop = asyncio.get_running_loop()
    try:
        call = client.submit(m.EnvClose(session_id="s"), timeout_s=0.2)
        t_sent = loop.time()
        (ident, call_id, _), = await peer.requests(1)
        peer.sock.send_multipart([ident, call_id, msgspec.msgpack.encode(m.Ack(detail="ok"))])
        # The loop stalls (a long callback, a collection) until the reply is in the client's
        # socket and the call's deadline has passed. (Polling the socket here also takes its
        # edge-triggered wake-up, as a stall's missed one would.)
        assert zmq.zmq_poll([(client._sock, zmq.POLLIN)], 30_000), "no reply in 30 s"
        stall = max(0.0, t_sent + 0.2 + 2 * deadlines.EXPIRY_GRANULARITY_S - loop.time())
        time.sleep(stall)  # noqa: ASYNC251 -- the stall is the point: the loop must not run
        reply, _ = await asyncio.wait_for(call, 30)
        assert reply == m.Ack(detail="ok")
        assert (client.num_timeouts, client.num_late_replies) == (0, 0)
    finally:
        await client.close()
        peer.close()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_reply_that_arrived_is_read_before_its_deadline_fires(loop_kind):
    """Issue 11: after a stall, a due deadline must not beat a reply already received (uvloop
    runs due timers before it polls for I/O; a 50k-trajectory start-up failed 512 calls so)."""
    import uvloop

    (uvloop.run if loop_kind == "uvloop" else asyncio.run)(_a_reply_waiting_through_a_stall())


async def test_late_reply_memory_is_bounded_oldest_first(monkeypatch):
    from rollart.transport import rpc

    monkeypatch.setattr(rpc, "LATE_REPLY_MEMORY", 2)
    peer = SilentPeer()
    client = RpcClient(peer.address, name="w0", auth=env_credentials(), heartbeat_interval_s=0)
    enc = msgspec.msgpack.encode
    try:
        futs = [client.submit(m.EnvClose(session_id=str(i)), timeout_s=0.2) for i in range(3)]
        reqs = await peer.requests(3)
        for fut in futs:
            with pytest.raises(RemoteTimeoutError):
                await fut
        assert len(client._expired) == 2  # the first id was forgotten
        ident = reqs[0][0]
        for _, call_id, _ in reqs:
            peer.sock.send_multipart([ident, call_id, enc(m.Ack(detail="late"))])
        await _replied_after(client, peer, ident)
        assert (client.num_timeouts, client.num_late_replies) == (3, 2)
    finally:
        await client.close()
        peer.close()


async def test_env_client_raises_env_error_from_the_rpc_client_directly():
    peer = SilentPeer()
    client = EnvClient(peer.address, name="h0", auth=env_credentials(), heartbeat_interval_s=0)
    try:
        step = asyncio.ensure_future(client.step("s", "a", timeout_s=60))
        ((ident, call_id, _),) = await peer.requests(1)
        peer.sock.send_multipart([ident, call_id, msgspec.msgpack.encode(
            m.ErrorReply(code="not_found", message="no session s"))])
        with pytest.raises(EnvError) as err:
            await asyncio.wait_for(step, 30)
        assert err.value.code == "not_found" and err.value.message == "h0: no session s"
    finally:
        await client.close()
        peer.close()


async def _step_within(env: EnvClient, i: int) -> None:
    async with asyncio.timeout(0.2):  # the peer never answers in time
        await env.step("s", str(i), timeout_s=600)


@pytest.mark.parametrize("via", ["call", "step", "step_in_asyncio_timeout"])
async def test_cancelled_calls_leave_the_pending_table_at_once_and_their_replies_are_ignored(via):
    peer = SilentPeer()
    env = EnvClient(peer.address, auth=env_credentials(), heartbeat_interval_s=0)
    client = env._rpc
    loop = asyncio.get_running_loop()
    n = 1000
    try:
        if via == "call":
            tasks = [loop.create_task(client.call(m.EnvClose(session_id=str(i)), timeout_s=600))
                     for i in range(n)]
        elif via == "step":
            tasks = [loop.create_task(env.step("s", str(i), timeout_s=600)) for i in range(n)]
        else:
            tasks = [loop.create_task(_step_within(env, i)) for i in range(n)]
        requests = await peer.requests(n)
        if via != "step_in_asyncio_timeout":
            assert len(client._pending) == n
            for task in tasks:
                task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        expected = TimeoutError if via == "step_in_asyncio_timeout" else asyncio.CancelledError
        assert all(type(r) is expected for r in results)
        assert len(client._pending) == 0  # no reply arrived, no deadline passed
        # Their replies come after all: ignored, neither late (no call timed out) nor an error.
        enc = msgspec.msgpack.encode
        for ident, call_id, _ in requests:
            peer.sock.send_multipart([ident, call_id, enc(m.Ack(detail="after cancel"))])
        await _replied_after(client, peer, requests[0][0])
        assert (client.num_timeouts, client.num_late_replies) == (0, 0)
        assert not client._pending and not client.dead
    finally:
        await env.close()
        peer.close()


@contextlib.asynccontextmanager
async def _silent_client() -> AsyncIterator[tuple[SilentPeer, RpcClient]]:
    peer = SilentPeer()
    client = RpcClient(peer.address, name="w0", auth=env_credentials(), heartbeat_interval_s=0)
    try:
        yield peer, client
    finally:
        await client.close()
        peer.close()


async def test_forget_cancels_a_call_and_drops_it_from_the_pending_table():
    async with _silent_client() as (_, client):
        call_id, fut = client.submit_call(m.EnvClose(session_id="a"), timeout_s=60)
        other_id, other = client.submit_call(m.EnvClose(session_id="b"), timeout_s=60)
        client.forget(call_id)
        assert fut.cancelled() and list(client._pending) == [other_id]
        client.forget(call_id)  # again, and an id never issued: no-ops
        client.forget(b"\xff" * 8)
        assert not other.done() and list(client._pending) == [other_id]


async def test_the_deadline_wheel_drops_answered_calls(monkeypatch):
    """The client's wheel reads its pending table: ids of answered calls are compacted away
    when the next bucket opens (a distinct timeout per call opens one per call here)."""
    monkeypatch.setattr(deadlines, "COMPACT_MIN_IDS", 16)
    enc = msgspec.msgpack.encode
    async with _silent_client() as (peer, client):
        futs = [client.submit(m.EnvClose(session_id=str(i)), timeout_s=600 + i / 1000)
                for i in range(100)]
        for ident, call_id, _ in await peer.requests(100):
            peer.sock.send_multipart([ident, call_id, enc(m.Ack())])
        await asyncio.wait_for(asyncio.gather(*futs), 30)
        assert len(client._deadlines) == 100  # dead ids, held until a bucket opens
        client.submit(m.EnvClose(session_id="late"), timeout_s=1.0)
        assert len(client._deadlines) == 1 and client._deadlines.num_compactions == 1
