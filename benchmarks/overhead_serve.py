"""Backend processes of ``benchmarks.controller_overhead``, timestamped (SIMULATED backends).

    python -m benchmarks.overhead_serve worker --dump W.msgpack [domain args]
    python -m benchmarks.overhead_serve env --dump E.msgpack [domain args]

``worker``: the simulated inference engine at ``time_scale=0`` (answers at once with
``--response-tokens`` tokens; it holds up to ``--max-prefix-tokens`` trajectory prefix tokens
for delta prompts, least recently used evicted first); ``env``: a simulated env host whose steps really sleep (asyncio)
for a lognormal latency of mean ``--env-mean-s`` and std ``--env-std-s`` seconds, and whose
session opens sleep uniform(0, ``--open-spread-s``) so that arrivals are spread, not a burst.
Both serve the real ZeroMQ RPC (``rollart.sim.serve`` handlers), print ``ADDRESS tcp://...``
first, and record for every call the ``time.monotonic()`` seconds at which its handler started
(the request was received and decoded) and returned (the reply is about to be encoded and
sent). ``CLOCK_MONOTONIC`` is one clock for every process of the host, so the controller-added
latency is computed across processes. On SIGTERM the records are written to ``--dump``
(msgpack) and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from rollart.inference.prefixes import DEFAULT_MAX_PREFIX_TOKENS
from rollart.sim.env import SimEnvHost
from rollart.sim.hardware import H800
from rollart.sim.models import QWEN3_8B
from rollart.sim.serve import env_handlers, worker_handlers
from rollart.sim.worker import SimInferenceWorker
from rollart.sim.workload import Dist, DomainSpec, DomainTable, const
from rollart.transport import messages as m
from rollart.transport.rpc import RpcServer
from rollart.transport.security import Auth, add_auth_args, service_auth

DOMAIN = "zero"


def domain_spec(args: argparse.Namespace) -> DomainSpec:
    """The one simulated domain every process of a run shares (token ids are positional)."""
    spread = args.open_spread_s
    return DomainSpec(
        DOMAIN, prompt_tokens=const(args.context_tokens), obs_tokens=const(args.obs_tokens),
        response_tokens=const(args.response_tokens), num_turns=const(args.turns),
        # Clipped below the controller's env timeout, so an env timeout can only mean a lost
        # or starved reply, never a long draw.
        step_latency_s=Dist("lognormal", args.env_mean_s, args.env_std_s, 0.0,
                            args.env_max_s),
        reset_latency_s=Dist("uniform", spread / 2, spread / 2 / math.sqrt(3.0)),
    )


def add_domain_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--context-tokens", type=int, default=32768, help="first prompt, tokens")
    p.add_argument("--obs-tokens", type=int, default=4)
    p.add_argument("--response-tokens", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--env-mean-s", type=float, default=10.0)
    p.add_argument("--env-std-s", type=float, default=10.0)
    p.add_argument("--env-max-s", type=float, default=60.0)
    p.add_argument("--open-spread-s", type=float, default=20.0)


def domain_argv(args: argparse.Namespace) -> list[str]:
    """The command-line form of ``args``' domain arguments (to start the backends)."""
    out: list[str] = []
    for name in ("context_tokens", "obs_tokens", "response_tokens", "turns", "env_mean_s",
                 "env_std_s", "env_max_s", "open_spread_s"):
        out += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return out


class Records(msgspec.Struct, gc=False):
    """What a backend dumps: per call ``[key, turn, t_in, t_out]`` (monotonic seconds).

    Worker: key = request id (``<traj>/t<turn>``), turn = -1. Env: key = session id, turn =
    the step's index in its session (-1 for the open)."""

    calls: list[tuple[str, int, float, float]]


def _timed(handler: Any, calls: list, key: Any) -> Any:
    async def wrapped(msg: Any, frames: list) -> Any:
        t_in = time.monotonic()
        res = await handler(msg, frames)
        k, turn = key(msg, res)
        calls.append((k, turn, t_in, time.monotonic()))
        return res

    return wrapped


async def _serve(args: argparse.Namespace, auth: Auth) -> Records:
    table = DomainTable([domain_spec(args)])
    calls: list[tuple[str, int, float, float]] = []
    if args.kind == "worker":
        worker = SimInferenceWorker("bench-worker", hardware=H800, model=QWEN3_8B, domains=table,
                                    max_batch=1_000_000, time_scale=0.0, prefix_cache=False,
                                    max_prefix_tokens=args.max_prefix_tokens)
        handlers = worker_handlers(worker)
        handlers[m.Generate] = _timed(handlers[m.Generate], calls,
                                      lambda msg, _res: (msg.request_id, -1))
    else:
        handlers = env_handlers(SimEnvHost("bench-env", table, seed=args.seed))
        turns: Counter[str] = Counter()

        def step_key(msg: m.EnvStep, _res: Any) -> tuple[str, int]:
            turns[msg.session_id] += 1
            return msg.session_id, turns[msg.session_id] - 1

        handlers[m.EnvOpen] = _timed(handlers[m.EnvOpen], calls,
                                     lambda _msg, res: (res.session_id, -1))
        handlers[m.EnvStep] = _timed(handlers[m.EnvStep], calls, step_key)
    server = RpcServer("tcp://127.0.0.1:0", handlers, name=f"bench-{args.kind}", auth=auth)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    serving = asyncio.create_task(server.serve_forever())
    print(f"ADDRESS {server.address}", flush=True)
    await stop.wait()
    serving.cancel()
    await asyncio.gather(serving, return_exceptions=True)
    await server.close()
    return Records(calls=calls)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overhead_serve")
    p.add_argument("kind", choices=("worker", "env"))
    p.add_argument("--dump", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-prefix-tokens", type=int, default=DEFAULT_MAX_PREFIX_TOKENS,
                   help="worker: bound on the trajectory prefix tokens it holds for delta "
                        "prompts (a trajectory whose prefix was evicted resends it whole)")
    add_domain_args(p)
    add_auth_args(p)
    args = p.parse_args(argv)
    auth = service_auth(args.key_file, args.insecure, "tcp://127.0.0.1:0")
    import uvloop

    records = uvloop.run(_serve(args, auth))
    Path(args.dump).write_bytes(msgspec.msgpack.encode(records))


if __name__ == "__main__":
    main()
