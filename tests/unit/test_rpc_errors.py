"""A handler returning something that is not a wire message fails that call only, with an
``internal`` error instead of a silent timeout, and a reply whose token data are broken (ragged,
NaN or positive logprobs, negative token ids, which the controller's detokenizer cannot take)
fails that call only, with ``bad_reply``; the server keeps serving."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError
from rollart.transport.rpc import RpcClient, RpcServer
from rollart.transport.security import env_credentials


async def test_unencodable_reply_is_an_internal_error_for_that_call_only() -> None:
    async def bad(msg: m.EnvClose, _frames):
        if msg.session_id == "bad":
            return object()
        return m.Ack(detail=msg.session_id)

    server = RpcServer("tcp://127.0.0.1:0", {m.EnvClose: bad}, name="enc", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    client = RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials())
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


def _result(**change) -> m.GenerateResult:
    good = m.GenerateResult(
        request_id="r", token_ids=tb.pack_i32([5, 6]), logprobs=tb.pack_f32([-0.5, -1.0]),
        versions=tb.pack_i32([3, 3]), finish_reason="stop", num_prompt_tokens=4,
        stats=m.WorkerStats(worker="w", num_running=0, num_waiting=0, version=3))
    # structs.replace skips __post_init__: this is what a broken worker puts on the wire.
    return msgspec.structs.replace(good, **change)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logprobs": tb.pack_f32([-0.5, float("nan")])}, "logprob nan of a generated token"),
        ({"logprobs": tb.pack_f32([0.25, -1.0])}, "logprob 0.25 of a generated token"),
        ({"logprobs": tb.pack_f32([-0.5, float("-inf")])}, "logprob -inf"),
        ({"logprobs": tb.pack_f32([-0.5])}, "8 bytes of token_ids, 4 of logprobs, 8 of versions"),
        ({"versions": b"\x03\x00"}, "8 bytes of token_ids, 8 of logprobs, 2 of versions"),
        ({"token_ids": b"\x05\x00\x00"}, "3 bytes of token_ids, 8 of logprobs, 8 of versions"),
        ({"token_ids": tb.pack_i32([5, -1])}, "negative token id -1"),
        ({"versions": tb.pack_i32([3, -2])}, "negative version -2"),
    ],
    ids=["nan", "positive", "neg-inf", "short-logprobs", "short-versions", "ragged-ids",
         "negative-id", "negative-version"],
)
async def test_a_generate_result_with_bad_token_data_fails_that_call_only(change, message) -> None:
    async def generate(msg: m.Generate, _frames):
        return _result(**change) if msg.request_id == "bad" else _result()

    server = RpcServer("tcp://127.0.0.1:0", {m.Generate: generate}, name="worker", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    client = RpcClient(server.address, heartbeat_interval_s=0, auth=env_credentials())
    params = m.SamplingParams(max_tokens=2)
    try:
        with pytest.raises(RemoteError) as info:
            await client.call(m.Generate(request_id="bad", new_token_ids=tb.pack_i32([1]),
                                         sampling=params), timeout_s=60)
        assert info.value.code == "bad_reply" and message in info.value.message
        reply, _ = await client.call(m.Generate(request_id="ok", new_token_ids=tb.pack_i32([1]),
                                                sampling=params), timeout_s=60)
        assert isinstance(reply, m.GenerateResult) and reply.num_tokens == 2
        with pytest.raises(ValueError, match="must be finite and <= 0"):
            m.GenerateResult(**{**msgspec.structs.asdict(_result()),
                                "logprobs": tb.pack_f32([0.0, 1.5])})
    finally:
        await client.close()
        await server.close()
        serving.cancel()
