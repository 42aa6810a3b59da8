"""RPC under load: no reply is ever lost, on the default asyncio loop and on uvloop.

Handlers park on an ``asyncio.Event`` until every request has arrived, so all of them are
outstanding at the same moment; then every reply must reach its own call. Deadlines are
minutes (a loaded 2-core machine), and nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import logging
import struct

import msgspec
import pytest
import uvloop
import zmq
import zmq.asyncio

from rollart.transport import messages as m
from rollart.transport import rpc
from rollart.transport.rpc import RpcClient, RpcServer
from rollart.transport.security import env_credentials

LOOPS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
DEADLINE_S = 240.0


#: Bytes of padding per reply: 20k replies then hold ~40 MiB, more than the loopback socket
#: buffers and ZeroMQ's default pipes can absorb while the client is not reading, as with a busy
#: controller. Without the padding the kernel buffers alone hide a dropping transport.
PAD = 2048


class Gate:
    """Parks every handler until ``total`` requests have arrived."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.arrived = 0
        self.all_in = asyncio.Event()

    async def step(self, msg: m.EnvStep, _frames) -> m.EnvStepResult:
        self.arrived += 1
        if self.arrived == self.total:
            self.all_in.set()
        await self.all_in.wait()
        return m.EnvStepResult(session_id=msg.session_id, observation=msg.action + "." * PAD,
                               reward=0.0, terminated=False, truncated=False)


async def _calls(client: RpcClient, tag: str, n: int) -> None:
    replies = await asyncio.gather(*(
        client.call(m.EnvStep(session_id=tag, action=str(i)), timeout_s=DEADLINE_S)
        for i in range(n)))
    got = [(r.session_id, r.observation) for r, _ in replies]
    assert got == [(tag, str(i) + "." * PAD) for i in range(n)]


async def _one_client(n: int) -> None:
    gate = Gate(n)
    server = RpcServer("tcp://127.0.0.1:0", {m.EnvStep: gate.step}, name="load", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    client = RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials())
    try:
        await _calls(client, "c0", n)
        assert gate.arrived == n
    finally:
        await client.close()
        await server.close()
        serving.cancel()


async def _many_clients(num_clients: int, per_client: int) -> None:
    gate = Gate(num_clients * per_client)
    server = RpcServer("tcp://127.0.0.1:0", {m.EnvStep: gate.step}, name="load", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    clients = [RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials()) for _ in range(num_clients)]
    try:
        await asyncio.gather(*(_calls(c, f"c{i}", per_client) for i, c in enumerate(clients)))
        assert gate.arrived == num_clients * per_client
    finally:
        for c in clients:
            await c.close()
        await server.close()
        serving.cancel()


@LOOPS
def test_20k_outstanding_calls_on_one_client_all_answered(run) -> None:
    run(_one_client(20_000))


@LOOPS
def test_20k_outstanding_requests_on_one_server_from_4_clients_all_answered(run) -> None:
    run(_many_clients(4, 5_000))


async def _full_pipes(n: int, reply_bytes: int) -> None:
    # Replies carry a large extra frame, so the ZeroMQ pipes (high-water mark patched to 2
    # messages) and the kernel's socket buffers fill long before all n are out: the server's
    # sends hit EAGAIN and the client's sends too; neither may lose a message.
    blob = b"r" * reply_bytes
    gate = Gate(n)

    async def step(msg: m.EnvStep, frames):
        return await gate.step(msg, frames), [blob]

    server = RpcServer("tcp://127.0.0.1:0", {m.EnvStep: step}, name="full", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    client = RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials())
    try:
        replies = await asyncio.gather(*(
            client.call(m.EnvStep(session_id="s", action=str(i)), timeout_s=DEADLINE_S)
            for i in range(n)))
        assert [r.observation for r, _ in replies] == [str(i) + "." * PAD for i in range(n)]
        assert all(len(frames) == 1 and bytes(frames[0]) == blob for _, frames in replies)
    finally:
        await client.close()
        await server.close()
        serving.cancel()


@LOOPS
def test_full_pipes_eagain_loses_no_reply_and_no_request(run, monkeypatch) -> None:
    # 2, not 1: a CURVE server with RCVHWM 1 never delivers a message (libzmq 4.3.5).
    monkeypatch.setattr(rpc, "_HWM", 2)
    run(_full_pipes(2_000, 64 * 1024))


async def _gone_peer() -> None:
    release = asyncio.Event()
    arrived = asyncio.Event()

    async def park(_msg, _frames):
        arrived.set()
        await release.wait()
        return m.Ack()

    async def ack(_msg, _frames):
        return m.Ack()

    server = RpcServer("tcp://127.0.0.1:0", {m.EnvClose: park, m.EnvStep: ack}, name="gone", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    # The server's socket monitor says when its I/O thread has seen the peer go, so the reply
    # is sent only once ZeroMQ can tell it has nowhere to go.
    monitor = server._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    env_credentials().secure_client(raw)  # the run's key, as every client
    raw.connect(server.address)
    try:
        await raw.send_multipart([struct.pack(">Q", 1),
                                  msgspec.msgpack.encode(m.EnvClose(session_id="x"))])
        await asyncio.wait_for(arrived.wait(), DEADLINE_S)
        raw.close(linger=0)
        await asyncio.wait_for(asyncio.to_thread(monitor.recv_multipart), DEADLINE_S)
        # Stop monitoring before the monitor socket closes: a later event sent to a closed
        # monitor blocks ZeroMQ's I/O thread, and with it every socket of the process.
        server._sock.disable_monitor()
        monitor.close(linger=0)
        release.set()
        async with RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials()) as client:
            # This reply goes out after the refused one (one socket, one send order).
            reply, _ = await client.call(m.EnvStep(session_id="s", action="a"),
                                         timeout_s=DEADLINE_S)
            assert isinstance(reply, m.Ack)
        assert server.replies_to_gone_peers == 1
    finally:
        if not monitor.closed:
            server._sock.disable_monitor()
            monitor.close(linger=0)
        raw.close(linger=0)
        await server.close()
        serving.cancel()


@LOOPS
def test_reply_to_gone_peer_is_counted_and_logged_and_server_keeps_serving(run, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="rollart.transport.rpc"):
        run(_gone_peer())
    assert any("gone peer" in r.getMessage() for r in caplog.records)
