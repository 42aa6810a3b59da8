"""Serve a SIMULATED worker or env host over the real ZeroMQ RPC (``rollart.transport.rpc``).

Used by the controller-overhead benchmark: the controller talks to these processes through the
real ``InferenceClient`` / ``EnvClient``, so what it measures is the controller plus the real
transport, with backends that answer in (near) zero time.

    python -m rollart.sim.serve worker --address tcp://127.0.0.1:0 --time-scale 0 --key-file K
    python -m rollart.sim.serve env --address tcp://127.0.0.1:0 --key-file K

``--key-file`` / ``--insecure`` as for every rollart service (``rollart.transport.security``).

The bound address is printed as the first stdout line (``ADDRESS tcp://...``). The simulated
domain is given on the command line (``--domain NAME --prompt-tokens ...``); every process of a
run must get the same domain arguments, since the token ids of a domain are positional.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rollart.sim.env import SimEnvHost
from rollart.sim.hardware import get_hardware
from rollart.sim.models import get_model
from rollart.sim.worker import SimInferenceWorker
from rollart.sim.workload import DomainSpec, DomainTable, const
from rollart.transport import messages as m
from rollart.transport.errors import ConfigError
from rollart.transport.rpc import RpcServer
from rollart.transport.security import Auth, add_auth_args, service_auth


def worker_handlers(worker: SimInferenceWorker) -> dict[type, Any]:
    """RPC handlers that serve ``worker`` (message type -> async handler)."""

    async def generate(msg: m.Generate, _f: list) -> m.GenerateResult:
        return await worker.generate(msg)

    async def abort(msg: m.Abort, _f: list) -> m.Ack:
        await worker.abort(msg.request_id)
        return m.Ack()

    async def pause(msg: m.Pause, _f: list) -> m.Ack:
        await worker.pause(msg.mode)
        return m.Ack()

    async def resume(_msg: m.Resume, _f: list) -> m.Ack:
        await worker.resume()
        return m.Ack()

    async def stats(_msg: m.GetStats, _f: list) -> m.WorkerStats:
        return await worker.stats()

    async def bucket(msg: m.WeightBucket, frames: list) -> m.Ack:
        worker.stage(msg.version, float(sum(len(f) for f in frames)))
        return m.Ack()

    async def apply(msg: m.ApplyWeights, _f: list) -> m.WeightsApplied:
        return await worker.apply_weights(msg.version, reprefill=msg.reprefill)

    return {m.Generate: generate, m.Abort: abort, m.Pause: pause, m.Resume: resume,
            m.GetStats: stats, m.WeightBucket: bucket, m.ApplyWeights: apply}


def env_handlers(host: SimEnvHost) -> dict[type, Any]:
    """RPC handlers that serve ``host`` (message type -> async handler)."""

    async def open_(msg: m.EnvOpen, _f: list) -> m.EnvOpened:
        return await host.open(msg.env_name, msg.seed, msg.options)

    async def step(msg: m.EnvStep, _f: list) -> m.EnvStepResult:
        return await host.step(msg.session_id, msg.action)

    async def close(msg: m.EnvClose, _f: list) -> m.Ack:
        await host.close_session(msg.session_id)
        return m.Ack()

    async def stats(_msg: m.GetEnvStats, _f: list) -> m.EnvHostStats:
        return await host.stats()

    return {m.EnvOpen: open_, m.EnvStep: step, m.EnvClose: close, m.GetEnvStats: stats}


def domain_from_args(args: argparse.Namespace) -> DomainSpec:
    return DomainSpec(args.domain, prompt_tokens=const(args.prompt_tokens),
                      obs_tokens=const(args.obs_tokens),
                      response_tokens=const(args.response_tokens), num_turns=const(args.turns))


def add_domain_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--domain", default="zero")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--obs-tokens", type=int, default=16)
    parser.add_argument("--response-tokens", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)


async def _serve(args: argparse.Namespace, auth: Auth) -> None:
    table = DomainTable([domain_from_args(args)])
    if args.kind == "worker":
        worker = SimInferenceWorker(args.name, hardware=get_hardware(args.hardware),
                                    model=get_model(args.model), domains=table, seed=args.seed,
                                    max_batch=args.max_batch, time_scale=args.time_scale,
                                    prefix_cache=False)
        handlers = worker_handlers(worker)
    else:
        handlers = env_handlers(SimEnvHost(args.name, table, seed=args.seed))
    server = RpcServer(args.address, handlers, name=args.name, auth=auth)
    print(f"ADDRESS {server.address}", flush=True)
    await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rollart.sim.serve")
    parser.add_argument("kind", choices=("worker", "env"))
    parser.add_argument("--address", default="tcp://127.0.0.1:0")
    parser.add_argument("--name", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hardware", default="h800")
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--max-batch", type=int, default=100_000)
    parser.add_argument("--time-scale", type=float, default=0.0)
    add_domain_args(parser)
    add_auth_args(parser)
    args = parser.parse_args(argv)
    args.name = args.name or f"sim-{args.kind}"
    try:
        auth = service_auth(args.key_file, args.insecure, args.address)
    except ConfigError as exc:
        sys.exit(f"rollart.sim.serve: {exc}")
    import uvloop

    try:
        uvloop.run(_serve(args, auth))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
