"""Simulated backends served over the real ZeroMQ RPC answer the real clients (the
controller-overhead benchmark relies on it)."""

from __future__ import annotations

import asyncio
import contextlib

import torch

from rollart.envhost.client import EnvClient
from rollart.inference.client import InferenceClient
from rollart.sim.env import SimEnvHost
from rollart.sim.hardware import H800
from rollart.sim.models import QWEN3_8B
from rollart.sim.serve import env_handlers, worker_handlers
from rollart.sim.worker import SimInferenceWorker
from rollart.sim.workload import DomainSpec, DomainTable, SimTokenizer, const, observation
from rollart.transport import messages as m
from rollart.transport import tokenbytes as tb
from rollart.transport.rpc import RpcServer
from rollart.transport.security import env_credentials

TABLE = DomainTable([DomainSpec("zero", response_tokens=const(16), num_turns=const(2))])


async def test_sim_worker_and_env_over_zmq() -> None:
    worker = SimInferenceWorker("w", hardware=H800, model=QWEN3_8B, domains=TABLE,
                                time_scale=0.0)
    wsrv = RpcServer("tcp://127.0.0.1:0", worker_handlers(worker), name="w", auth=env_credentials())
    esrv = RpcServer("tcp://127.0.0.1:0", env_handlers(SimEnvHost("e", TABLE)), name="e", auth=env_credentials())
    tasks = [asyncio.create_task(wsrv.serve_forever()), asyncio.create_task(esrv.serve_forever())]
    client = InferenceClient(wsrv.address, name="w", auth=env_credentials())
    env = EnvClient(esrv.address, name="e", auth=env_credentials())
    try:
        ids = SimTokenizer(TABLE).encode(observation("zero", 32, tag="a"))
        res = await client.generate(m.Generate(request_id="a/t0", new_token_ids=tb.pack_i32(ids),
                                               sampling=m.SamplingParams(max_tokens=64)))
        assert res.num_tokens == 16 and res.finish_reason == "stop"
        await client.push_weights(1, [("w", torch.zeros(8))], bucket_bytes=1 << 20)
        applied = await client.apply_weights(1)
        assert applied.version == 1 and client.last_stats is not None
        opened = await env.open("sim:zero", 3)
        first = await env.step(opened.session_id, "x")
        second = await env.step(opened.session_id, "y")
        assert (first.terminated, second.terminated) == (False, True)
    finally:
        await client.close()
        await env.close()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        await wsrv.close()
        await esrv.close()
