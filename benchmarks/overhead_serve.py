"""Backend processes of ``benchmarks.controller_overhead``, timestamped (SIMULATED backends).

    python -m benchmarks.overhead_serve worker --dump W.msgpack [domain args]
    python -m benchmarks.overhead_serve env --dump E.msgpack [domain args]
    python -m benchmarks.overhead_serve echo --dump /dev/null

``worker``: the simulated inference engine at ``time_scale=0`` (answers at once with
``--response-tokens`` tokens); ``env``: a simulated env host whose steps really sleep (asyncio)
for a lognormal latency of mean ``--env-mean-s`` and std ``--env-std-s`` seconds, and whose
session opens sleep uniform(0, ``--open-spread-s``) so that arrivals are spread, not a burst.
Both serve the real ZeroMQ RPC (``rollart.sim.serve`` handlers), print ``ADDRESS tcp://...``
first, and record for every call the ``time.monotonic()`` seconds at which its handler started
(the request was received and decoded) and returned (the reply is about to be encoded and
sent). ``CLOCK_MONOTONIC`` is one clock for every process of the host, so the controller-added
latency is computed across processes. ``echo``: the transport floor, a bare uvloop
``asyncio.Protocol`` echo of length-prefixed msgspec frames. On SIGTERM the records are written to ``--dump``
(msgpack) and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
import struct
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from rollart.sim.env import SimEnvHost
from rollart.sim.hardware import H800
from rollart.sim.models import QWEN3_8B
from rollart.sim.serve import env_handlers, worker_handlers
from rollart.sim.worker import SimInferenceWorker
from rollart.sim.workload import Dist, DomainSpec, DomainTable, const
from rollart.transport import messages as m
from rollart.transport.rpc import RpcServer

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


class Echo(msgspec.Struct, array_like=True, gc=False):
    """One frame of the floor echo: call id and an opaque payload."""

    call_id: int
    payload: bytes


_LEN = struct.Struct("!I")
_echo_encoder = msgspec.msgpack.Encoder()
_echo_decoder = msgspec.msgpack.Decoder(Echo)


def _frames(buf: bytearray) -> tuple[list[Echo], bytearray]:
    out, pos = [], 0
    while len(buf) - pos >= 4:
        (size,) = _LEN.unpack_from(buf, pos)
        if len(buf) - pos - 4 < size:
            break
        out.append(_echo_decoder.decode(memoryview(buf)[pos + 4:pos + 4 + size]))
        pos += 4 + size
    return out, buf[pos:]


def _frame(msg: Echo) -> bytes:
    body = _echo_encoder.encode(msg)
    return _LEN.pack(len(body)) + body


class EchoServerProtocol(asyncio.Protocol):
    """The floor: decode each length-prefixed msgspec frame, encode it back; one write per
    batch of frames received (the bare cost of an RPC with msgspec on uvloop)."""

    def connection_made(self, transport: Any) -> None:
        self.transport, self.buf = transport, bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        msgs, self.buf = _frames(self.buf)
        if msgs:
            self.transport.write(b"".join(_frame(msg) for msg in msgs))


class EchoClientProtocol(asyncio.Protocol):
    """Client of :class:`EchoServerProtocol`: ``await call(payload)`` per round trip."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        msgs, self.buf = _frames(self.buf)
        for msg in msgs:
            fut = self.pending.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.payload)

    async def call(self, payload: bytes) -> bytes:
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        self.transport.write(_frame(Echo(self.next_id, payload)))
        return await asyncio.wait_for(fut, 30.0)

    def close(self) -> None:
        self.transport.close()


async def _serve_echo() -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(EchoServerProtocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(f"ADDRESS 127.0.0.1:{port}", flush=True)
    await stop.wait()
    server.close()


def _timed(handler: Any, calls: list, key: Any) -> Any:
    async def wrapped(msg: Any, frames: list) -> Any:
        t_in = time.monotonic()
        res = await handler(msg, frames)
        k, turn = key(msg, res)
        calls.append((k, turn, t_in, time.monotonic()))
        return res

    return wrapped


async def _serve(args: argparse.Namespace) -> Records:
    if args.kind == "echo":
        await _serve_echo()
        return Records(calls=[])
    table = DomainTable([domain_spec(args)])
    calls: list[tuple[str, int, float, float]] = []
    if args.kind == "worker":
        worker = SimInferenceWorker("bench-worker", hardware=H800, model=QWEN3_8B, domains=table,
                                    max_batch=1_000_000, time_scale=0.0, prefix_cache=False)
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
    server = RpcServer("tcp://127.0.0.1:0", handlers, name=f"bench-{args.kind}")
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
    p.add_argument("kind", choices=("worker", "env", "echo"))
    p.add_argument("--dump", required=True)
    p.add_argument("--seed", type=int, default=0)
    add_domain_args(p)
    args = p.parse_args(argv)
    import uvloop

    records = uvloop.run(_serve(args))
    Path(args.dump).write_bytes(msgspec.msgpack.encode(records))


if __name__ == "__main__":
    main()
