"""A handler returning something that is not a wire message fails that call only, with an
``internal`` error instead of a silent timeout, and the server keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from rollart.transport import messages as m
from rollart.transport.errors import RemoteError
from rollart.transport.rpc import RpcClient, RpcServer


async def test_unencodable_reply_is_an_internal_error_for_that_call_only() -> None:
    async def bad(msg: m.EnvClose, _frames):
        if msg.session_id == "bad":
            return object()
        return m.Ack(detail=msg.session_id)

    server = RpcServer("tcp://127.0.0.1:0", {m.EnvClose: bad}, name="enc")
    serving = asyncio.create_task(server.serve_forever())
    client = RpcClient(server.address, heartbeat_interval_s=0)
    try:
        with pytest.raises(RemoteError) as info:
            await client.call(m.EnvClose(session_id="bad"), timeout_s=60)
        assert info.value.code == "internal" and "unencodable" in info.value.message
        reply, _ = await client.call(m.EnvClose(session_id="ok"), timeout_s=60)
        assert reply == m.Ack(detail="ok")
    finally:
        await client.close()
        await server.close()
        serving.cancel()
