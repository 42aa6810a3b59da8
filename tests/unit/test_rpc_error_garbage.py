"""An error reply leaves no reference cycle behind on the client (issue 11): with the cycle
collector off, nothing of a failed call is left for it to free.

Before, the future awaited by ``RpcClient.call`` / ``InferenceClient.generate`` /
``EnvClient.step`` held the error, whose traceback held the awaiting frame, which held the
future: each error reply became cyclic garbage (a worker evicting prefixes at 10k
trajectories made ~1 per turn, and 5-15k cyclic objects per generation-0 collection)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import pytest

from rollart.envhost.client import EnvClient
from rollart.inference.client import InferenceClient
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.errors import RemoteError
from rollart.transport.rpc import RpcClient, RpcServer
from rollart.transport.security import env_credentials


async def _refuse_generate(msg: m.Generate, _frames: list) -> m.Msg:
    raise RemoteError("prefix_unknown", f"{msg.request_id}: no prefix held")


async def _refuse_step(msg: m.EnvStep, _frames: list) -> m.Msg:
    raise RemoteError("invalid_action", f"{msg.action!r} is not a move")


async def _refuse_close(msg: m.EnvClose, _frames: list) -> m.Msg:
    raise RemoteError("not_found", f"no session {msg.session_id}")


@pytest.fixture
async def address() -> AsyncIterator[str]:
    server = RpcServer("tcp://127.0.0.1:0", {m.Generate: _refuse_generate,
                                             m.EnvStep: _refuse_step,
                                             m.EnvClose: _refuse_close},
                       name="refuser", auth=env_credentials())
    serving = asyncio.create_task(server.serve_forever())
    yield server.address
    await server.close()
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)


async def _error_is_freed_at_once(call, code: str) -> None:
    """Await ``call()`` (which must fail with ``code``) three times with the collector off;
    then nothing of those calls may be cyclic garbage (``DEBUG_SAVEALL`` keeps what a
    collection would free in ``gc.garbage``)."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):  # not only the first call of a client
            failed = False
            try:
                await call()
            except RemoteError as exc:
                assert exc.code == code
                failed = True
            assert failed, "the call did not fail"
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not [t for t in cyclic if t in ("RemoteError", "EnvError", "Future", "traceback")], (
        f"the {code} errors were left to the cycle collector: {sorted(set(cyclic))}")


async def test_rpc_client_call_error_leaves_no_cycle(address: str) -> None:
    client = RpcClient(address, heartbeat_interval_s=0, auth=env_credentials())
    try:
        await _error_is_freed_at_once(
            lambda: client.call(m.EnvClose(session_id="s"), timeout_s=60), "not_found")
    finally:
        await client.close()


async def test_inference_client_generate_error_leaves_no_cycle(address: str) -> None:
    client = InferenceClient(address, name="w", heartbeat_interval_s=0, auth=env_credentials())
    request = m.Generate(request_id="t/0", new_token_ids=tb.pack_i32([1, 2]),
                         sampling=m.SamplingParams(max_tokens=4), trajectory_id="t",
                         prefix_len=7)
    try:
        await _error_is_freed_at_once(
            lambda: client.generate(request, timeout_s=60), "prefix_unknown")
    finally:
        await client.close()


async def test_env_client_step_error_leaves_no_cycle(address: str) -> None:
    client = EnvClient(address, name="e", heartbeat_interval_s=0, auth=env_credentials())
    try:
        await _error_is_freed_at_once(
            lambda: client.step("s", "jump", timeout_s=60), "invalid_action")
    finally:
        await client.close()
