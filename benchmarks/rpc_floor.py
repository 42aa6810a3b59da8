"""``rpc_floor``: RPC echo throughput of rollart's transport against its physical floor (measured).

Three transports carry the same echo (an ``EnvStep`` request answered by an ``EnvStepResult``,
msgspec msgpack both ways) from one client in this process to one server in another process,
both on uvloop, at concurrency 1, 64 and 1024 (that many coroutines each calling in a loop):

- ``new``: ``rollart.transport.rpc`` (plain ZeroMQ sockets pumped in bulk from the loop),
  unauthenticated (``INSECURE``).
- ``curve``: the same transport with the run's CURVE key (``rollart.transport.security``), a
  run's default. Every message is encrypted and authenticated (NaCl crypto_box: Curve25519 key
  agreement at the handshake, XSalsa20-Poly1305 per message) on both sides, in ZeroMQ's I/O
  threads; ``curve/new`` is what that costs.
- ``old``: the transport before the bulk pump, ``src/rollart/transport/rpc.py`` at git
  ``--baseline REF`` (default ``OLD.ref``: pyzmq's asyncio layer, default high-water marks,
  ``ROUTER_MANDATORY`` off), read from git by ``benchmarks.gitbaseline``. Without git or the
  ref (a shallow clone) it is skipped with a note and ``new/old`` is not reported.
- ``floor``: the physical floor, a bare uvloop ``asyncio.Protocol`` over TCP with
  length-prefixed frames (4-byte length, 8-byte call id, msgpack body), one ``write`` per loop
  tick, a future per call and no task per request: no ZeroMQ, no heartbeats, no timeouts.

Reported per transport and concurrency: calls/s (answered calls only), us per call (= 1e6 /
calls/s: wall time per call with that many in flight, both processes included), the client
process's CPU us per answered call (all its threads: ZeroMQ's I/O thread included), and the calls
whose reply never came within ``CALL_TIMEOUT_S`` (``lost_replies``, warm-ups included; the wait
for them is in the elapsed time, as it would be for a real caller). Ratios ``new/old``,
``new/floor`` and ``curve/new`` of calls/s (and ``curve/new`` of client CPU per call) are
computed within each repeat (the transports run back to back, in a rotating order) and given
as mean with a 95% Student-t interval over the repeats. Both processes share
this machine's cores with whatever else runs (the load average is in ``meta``).

``measure_floor(...)`` runs only the floor, for other benchmarks to print beside their figures.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import uvloop

from benchmarks.common import emit, parse_args, result
from benchmarks.gitbaseline import Baseline, BaselineUnavailable, Checkout, add_to_path, extract
from rollart.transport import messages as m
from rollart.transport.errors import RemoteTimeoutError
from rollart.transport.security import INSECURE, Auth, create_key_file, load_key_file

NAME = "rpc_floor"
KINDS = ("new", "curve", "old", "floor")
#: the ``old`` transport: ``rpc.py`` as it was before the bulk pump (pyzmq's asyncio layer);
#: its parent commit 21fc2ec replaced it
OLD = Baseline(ref="b80fd0d3c1f6bd5a7893037c782709b41243f1eb",
               modules={"rpc": "src/rollart/transport/rpc.py"},
               what="the RPC transport on pyzmq's asyncio layer")
_key_dir: tempfile.TemporaryDirectory | None = None


def _key_path() -> Path:
    """The benchmark's CURVE key file (made once per process, removed at exit)."""
    global _key_dir
    if _key_dir is None:
        _key_dir = tempfile.TemporaryDirectory(prefix="rpc-floor-")
        create_key_file(Path(_key_dir.name) / "keys")
    return Path(_key_dir.name) / "keys" / "run.key_secret"


def _auth(kind: str, key_file: Path | None = None) -> Auth:
    return load_key_file(key_file or _key_path()) if kind == "curve" else INSECURE
CONCURRENCY = (1, 64, 1024)
_FRAME = struct.Struct(">IQ")  # body length + 8 (call id), call id
_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(m.Request)
_reply_decoder = msgspec.msgpack.Decoder(m.Reply)

#: Two-sided 95% Student-t quantiles by degrees of freedom (standard tables, e.g. NIST/SEMATECH
#: e-Handbook of Statistical Methods, 1.3.6.7.2); above 30 the normal 1.96.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
        17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 25: 2.060, 30: 2.042}


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% Student-t interval (half-width nan for one value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan
    df = len(values) - 1
    t = _T95.get(df) or (1.96 if df > 30 else _T95[max(k for k in _T95 if k <= df)])
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def _request(i: int) -> m.EnvStep:
    return m.EnvStep(session_id="bench", action=str(i))


def _echo(msg: m.EnvStep) -> m.EnvStepResult:
    return m.EnvStepResult(session_id=msg.session_id, observation=msg.action, reward=0.0,
                           terminated=False, truncated=False)


# ----------------------------------------------------------------------------------------------
# The floor: length-prefixed msgspec frames over a bare asyncio.Protocol
# ----------------------------------------------------------------------------------------------


class _Framed(asyncio.Protocol):
    """Splits the byte stream into (call id, body) frames; batches writes to one per tick."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= _FRAME.size:
            length, call_id = _FRAME.unpack_from(buf, pos)
            if end - pos - 4 < length:
                break
            self.frame(call_id, bytes(buf[pos + _FRAME.size:pos + 4 + length]))
            pos += 4 + length
        del buf[:pos]

    def frame(self, call_id: int, body: bytes) -> None:
        raise NotImplementedError

    def send(self, call_id: int, body: bytes) -> None:
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(_FRAME.pack(len(body) + 8, call_id))
        self._out.append(body)

    def _flush(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(b"".join(self._out))
        self._out.clear()


class _FloorServer(_Framed):
    def frame(self, call_id: int, body: bytes) -> None:
        self.send(call_id, _encoder.encode(_echo(_request_decoder.decode(body))))


class _FloorClient(_Framed):
    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[int, asyncio.Future] = {}
        self._next = 0

    def frame(self, call_id: int, body: bytes) -> None:
        fut = self.pending.pop(call_id, None)
        if fut is not None and not fut.done():
            fut.set_result(_reply_decoder.decode(body))

    async def call(self, msg: m.Msg) -> Any:
        self._next += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self._next] = fut
        self.send(self._next, _encoder.encode(msg))
        return await fut


# ----------------------------------------------------------------------------------------------
# Server processes
# ----------------------------------------------------------------------------------------------


async def _serve(kind: str, extra: list[str]) -> None:
    """Serve echoes; ``extra``: the key file for ``curve``, the baseline's directory and
    package for ``old``."""
    if kind == "floor":
        server = await asyncio.get_running_loop().create_server(_FloorServer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        print(f"ADDRESS tcp://127.0.0.1:{port}", flush=True)
    else:
        if kind == "old":
            add_to_path(Path(extra[0]))
            mod = importlib.import_module(f"{extra[1]}.rpc")
        else:
            mod = importlib.import_module("rollart.transport.rpc")
        key_file = Path(extra[0]) if kind == "curve" else None

        async def step(msg: m.EnvStep, _frames: Any) -> m.EnvStepResult:
            return _echo(msg)

        auth = {} if kind == "old" else {"auth": _auth(kind, key_file)}
        rpc = mod.RpcServer("tcp://127.0.0.1:0", {m.EnvStep: step}, name=f"echo-{kind}",
                            **auth)
        serving = asyncio.create_task(rpc.serve_forever())
        print(f"ADDRESS {rpc.address}", flush=True)
    # Serve until the parent closes our stdin (or dies).
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    if kind != "floor":
        await rpc.close()
        serving.cancel()


def _spawn(kind: str, old: Checkout | None = None) -> tuple[subprocess.Popen, str]:
    """An echo server process of ``kind`` and its address (``old`` needs the baseline)."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root / "src"), str(root), env.get("PYTHONPATH", "")) if p)
    if kind == "old":
        if old is None:
            raise ValueError("the 'old' transport needs its baseline checkout (OLD)")
        extra = [str(old.directory), old.package]
    else:
        extra = [str(_key_path())] if kind == "curve" else []
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.rpc_floor", "serve", kind, *extra],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=root)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ADDRESS "):
        proc.kill()
        raise RuntimeError(f"{kind} echo server did not start: {line!r}")
    return proc, line.split()[1]


def _stop(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------------------------
# Clients and the measurement
# ----------------------------------------------------------------------------------------------


#: Seconds an RPC echo call may wait for its reply before it counts as lost. The old transport
#: drops replies past ZeroMQ's default high-water mark; such a call then waits this long, which
#: its calls/s includes, as a real caller's would.
CALL_TIMEOUT_S = 10.0


class Lost:
    """Counts calls whose reply never came (``RemoteTimeoutError``)."""

    def __init__(self) -> None:
        self.count = 0


async def _run_calls(call: Callable[[m.Msg], Awaitable[Any]], concurrency: int, calls: int,
                     lost: Lost) -> float:
    """Issue ``calls`` echo calls from ``concurrency`` coroutines; returns elapsed seconds."""
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while issued < calls:
            issued += 1
            try:
                reply = await call(_request(issued))
            except RemoteTimeoutError:
                lost.count += 1
                continue
            if not isinstance(reply, m.EnvStepResult):
                raise RuntimeError(f"bad echo reply {reply!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def _measure(kind: str, address: str, concurrency: int, calls: int,
                   lost: Lost | None = None, cpu_us: list[float] | None = None,
                   old: Checkout | None = None) -> float:
    """calls/s of one transport at one concurrency (after a warm-up of a tenth of ``calls``);
    replies that never came are added to ``lost``; the client process's CPU microseconds
    (``time.process_time``) per answered call are appended to ``cpu_us`` if given. ``old``:
    the baseline checkout, needed for kind ``old``."""
    lost = lost or Lost()
    if kind == "floor":
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        transport, client = await asyncio.get_running_loop().create_connection(
            _FloorClient, host, int(port))
        try:
            return await _timed_calls(client.call, concurrency, calls, lost, cpu_us)
        finally:
            transport.close()
    if kind == "old":
        if old is None:
            raise ValueError("the 'old' transport needs its baseline checkout (OLD)")
        mod = old.module("rpc")
    else:
        mod = importlib.import_module("rollart.transport.rpc")
    auth = {} if kind == "old" else {"auth": _auth(kind)}
    rpc = mod.RpcClient(address, name=kind, heartbeat_interval_s=0, **auth)

    async def call(msg: m.Msg) -> Any:
        return (await rpc.call(msg, timeout_s=CALL_TIMEOUT_S))[0]

    try:
        return await _timed_calls(call, concurrency, calls, lost, cpu_us)
    finally:
        await rpc.close()


async def _timed_calls(call: Callable[[m.Msg], Awaitable[Any]], concurrency: int, calls: int,
                       lost: Lost, cpu_us: list[float] | None) -> float:
    await _run_calls(call, concurrency, max(concurrency, calls // 10), lost)
    before, cpu0 = lost.count, time.process_time()
    elapsed = await _run_calls(call, concurrency, calls, lost)
    answered = calls - (lost.count - before)
    if cpu_us is not None:
        cpu_us.append(1e6 * (time.process_time() - cpu0) / max(1, answered))
    return answered / elapsed


def _calls_for(concurrency: int, quick: bool) -> int:
    # About a second per measurement at the expected rates (concurrency 1 is latency-bound).
    base = 2_000 if concurrency == 1 else 10_000
    return base // 4 if quick else base


def measure_floor(concurrency: tuple[int, ...] = CONCURRENCY, *, repeats: int = 5,
                  quick: bool = False) -> list[dict[str, Any]]:
    """Measure the bare uvloop ``asyncio.Protocol`` echo floor (server in a child process).

    Call from synchronous code (it runs its own uvloop). Returns one row per concurrency:
    ``{"concurrency", "calls_per_s", "calls_per_s_ci95", "us_per_call",
    "client_cpu_us_per_call", "client_cpu_us_per_call_ci95"}`` (means over ``repeats``, ci95
    values are half-widths; ``us_per_call`` = 1e6 / mean calls/s, wall time;
    ``client_cpu_us_per_call``: CPU of the calling process alone, the floor of what one RPC
    costs a client such as the controller).
    """
    proc, address = _spawn("floor")
    try:
        rates, cpu = uvloop.run(_floor_rates(address, concurrency, repeats, quick))
    finally:
        _stop(proc)
    rows = []
    for c in concurrency:
        mean, half = ci95(rates[c])
        cpu_mean, cpu_half = ci95(cpu[c])
        rows.append({"concurrency": c, "calls_per_s": mean, "calls_per_s_ci95": half,
                     "us_per_call": 1e6 / mean, "client_cpu_us_per_call": cpu_mean,
                     "client_cpu_us_per_call_ci95": cpu_half})
    return rows


async def _floor_rates(address: str, concurrency: tuple[int, ...], repeats: int, quick: bool
                       ) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    rates: dict[int, list[float]] = {c: [] for c in concurrency}
    cpu: dict[int, list[float]] = {c: [] for c in concurrency}
    for _ in range(repeats):
        for c in concurrency:
            rates[c].append(await _measure("floor", address, c, _calls_for(c, quick),
                                           cpu_us=cpu[c]))
    return rates, cpu


async def _all_rates(addresses: dict[str, str], repeats: int, quick: bool,
                     old: Checkout | None
                     ) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], Lost],
                                dict[tuple[str, int], list[float]]]:
    kinds = tuple(addresses)
    rates: dict[tuple[str, int], list[float]] = {(k, c): [] for k in kinds for c in CONCURRENCY}
    lost = {key: Lost() for key in rates}
    cpu: dict[tuple[str, int], list[float]] = {key: [] for key in rates}
    for rep in range(repeats):
        order = kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]
        for c in CONCURRENCY:
            for kind in order:
                rates[kind, c].append(await _measure(
                    kind, addresses[kind], c, _calls_for(c, quick), lost[kind, c],
                    cpu_us=cpu[kind, c], old=old))
    return rates, lost, cpu


def old_transport(ref: str) -> tuple[Checkout | None, dict[str, str]]:
    """The ``old`` transport's checkout at ``ref`` and what ``meta["baseline"]`` records; when
    it cannot be had, ``None`` and the reason (printed: the run goes on without it)."""
    try:
        old = extract(OLD, ref)
        old.module("rpc")  # fails here, not in a server process, if it no longer imports
    except BaselineUnavailable as e:
        print(f"{NAME}: skipping the 'old' transport ({OLD.what}): {e}", file=sys.stderr)
        return None, {"ref": ref, "skipped": str(e)}
    return old, {"ref": ref, "commit": old.commit}


def run(quick: bool, seed: int, baseline: str = OLD.ref) -> dict[str, Any]:
    started = time.perf_counter()
    repeats = 5 if quick else 10
    load_before = os.getloadavg()[0]
    old, baseline_meta = old_transport(baseline)
    kinds = KINDS if old is not None else tuple(k for k in KINDS if k != "old")
    procs: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for kind in kinds:
            procs[kind] = _spawn(kind, old)
        rates, lost, cpu = uvloop.run(
            _all_rates({k: a for k, (_, a) in procs.items()}, repeats, quick, old))
    finally:
        for proc, _ in procs.values():
            _stop(proc)
        if old is not None:
            old.close()
    rows, ratios, intervals = [], {}, {}
    for c in CONCURRENCY:
        for kind in kinds:
            mean, half = ci95(rates[kind, c])
            cpu_mean, cpu_half = ci95(cpu[kind, c])
            rows.append({"transport": kind, "concurrency": c, "calls_per_s": mean,
                         "calls_per_s_ci95": half, "us_per_call": 1e6 / mean,
                         "client_cpu_us_per_call": cpu_mean,
                         "client_cpu_us_per_call_ci95": cpu_half,
                         "lost_replies": lost[kind, c].count})
            ratios[f"lost_replies {kind} at c={c}"] = lost[kind, c].count
        for other in ("old", "floor") if old is not None else ("floor",):
            per_rep = [a / b for a, b in zip(rates["new", c], rates[other, c], strict=True)]
            mean, half = ci95(per_rep)
            key = f"new/{other} calls_per_s at c={c}"
            ratios[key], intervals[key] = mean, [mean - half, mean + half]
        per_rep = [a / b for a, b in zip(rates["curve", c], rates["new", c], strict=True)]
        mean, half = ci95(per_rep)
        key = f"curve/new calls_per_s at c={c}"
        ratios[key], intervals[key] = mean, [mean - half, mean + half]
        # CPU of the calling process (its ZeroMQ I/O thread, where CURVE runs, included):
        # less sensitive than wall-clock rates to other load on the machine.
        per_rep = [a / b for a, b in zip(cpu["curve", c], cpu["new", c], strict=True)]
        mean, half = ci95(per_rep)
        key = f"curve/new client_cpu_us_per_call at c={c}"
        ratios[key], intervals[key] = mean, [mean - half, mean + half]
    res = result(NAME, simulated=False, rows=rows, ratios=ratios, quick=quick, seed=seed,
                 started=started,
                 notes=(f"{repeats} repeats, transports interleaved; one client process, one "
                        f"server process per transport, uvloop both sides; load average "
                        f"{load_before:.2f} before / {os.getloadavg()[0]:.2f} after on "
                        f"{os.cpu_count()} cores"))
    res["ci95"] = {k: [round(lo, 4), round(hi, 4)] for k, (lo, hi) in intervals.items()}
    res["meta"]["repeats"] = repeats
    res["meta"]["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    res["meta"]["baseline"] = baseline_meta
    return res


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        uvloop.run(_serve(argv[1], argv[2:]))
        return None
    args = parse_args(NAME, __doc__.splitlines()[0], argv, baseline=OLD.ref)
    res = run(args.quick, args.seed, args.baseline)
    emit(res, args.json)
    return res


if __name__ == "__main__":
    main()
