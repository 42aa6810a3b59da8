"""``rpc_overhead``: client CPU and GC-tracked objects per RPC, before vs after (measured).

What one RPC costs the calling process (the controller), through the real call path of its
most frequent RPC, ``EnvClient.step`` (``rollart.envhost.client``; ``InferenceClient.generate``
has the same shape), against one ``RpcServer`` echo in a child process. ``before`` is the client
path at git ``--baseline REF`` (default ``BEFORE.ref``, the commit before the deadline wheel:
a loop timer per call, two helper coroutines per call, ``getsockopt(EVENTS)``):
``transport/zmqloop.py``, ``transport/rpc.py`` and ``envhost/client.py`` of that commit, read
from git by ``benchmarks.gitbaseline``; ``after`` is today's (``rollart.transport.rpc``:
deadline wheel, ``RpcClient.submit`` awaited directly, call ids matched as wire bytes, EVENTS
by ``zmq_poll``). Both speak the same wire format to the same server. Without git or the ref
(a shallow clone) ``before`` is skipped with a note: ``after``'s figures, the ``floor`` and
the ``send`` / ``events`` parts are still measured, the after/before ratios are not. Parts,
each measured side by side in one run, ``before`` and ``after`` alternating in every repeat
(their order swapped every other repeat):

- ``calls``: at 1, 1024 and 20000 calls in flight (that many coroutines each calling in a loop),
  the client's event-loop thread CPU (``time.thread_time``) and whole-process CPU
  (``time.process_time``: ZeroMQ's I/O thread and pyzmq's garbage-collector thread included)
  per answered call, after a warm-up. CPU clocks, not wall time: the dev machine is a VM with
  heavy CPU steal.
- ``gc``: GC-tracked objects alive per in-flight call (``len(gc.get_objects())`` after a full
  collection, with N calls held by the server, minus the same count with none; the caller's
  Task counts), at 1024 and 20000 in flight; beside it the ``floor``: N Tasks each awaiting a
  future of its own (Task, coroutine, future, wake-up callback), the least a future-based call
  can keep.
- ``send``: one blob sent on a DEALER to a ROUTER sink in the child, copied (``copy=True``) vs
  zero-copy (``copy=False``: a ``zmq.Frame`` whose release goes through pyzmq's
  garbage-collector thread), loop-thread and process CPU per MB, from 16 KiB to 1 MiB (a full
  batch envelope; 64 KiB is ``_ZERO_COPY_BYTES``) and 16 MiB (a tensor frame).
- ``events``: one read of a socket's EVENTS: ``getsockopt(zmq.EVENTS)`` (converts the option to
  its enum on each call) vs ``zmq_poll([(sock, POLLIN | POLLOUT)], 0)``, CPU us per read.

Every ratio (after/before, zero-copy/copy, zmq_poll/getsockopt) is computed within each repeat
and reported as the mean with a 95% Student-t interval over the repeats.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvloop
import zmq
from zmq.backend import zmq_poll

from benchmarks.common import emit, parse_args, result
from benchmarks.gitbaseline import Baseline, BaselineUnavailable, extract
from benchmarks.rpc_floor import ci95
from rollart.envhost.client import EnvClient
from rollart.transport import messages as m
from rollart.transport.rpc import RpcServer
from rollart.transport.security import INSECURE

NAME = "rpc_overhead"
VARIANTS = ("before", "after")
#: the ``before`` client path: the commit before b9a15c7 (deadline wheel, ``submit``)
BEFORE = Baseline(ref="bdb946e9d7232e2ef342f217f6097ab316556f7c",
                  modules={"zmqloop": "src/rollart/transport/zmqloop.py",
                           "rpc": "src/rollart/transport/rpc.py",
                           "client": "src/rollart/envhost/client.py"},
                  what="the RPC client path before the deadline wheel")
CONCURRENCY = (1, 1024, 20000)
GC_IN_FLIGHT = (1024, 20000)
SEND_SIZES = (16 << 10, 64 << 10, 128 << 10, 256 << 10, 1 << 20, 16 << 20)
#: A held step's session id: the server answers it only when a ``EnvClose("release")`` comes.
_HOLD = "hold"

# ----------------------------------------------------------------------------------------------
# The child process: an RpcServer echo (with a gate to hold calls) and a plain ROUTER sink
# ----------------------------------------------------------------------------------------------


def _sink(sock: zmq.Socket) -> None:
    """Receive and discard; answer ``b"sync"`` with ``b"ok"`` (every earlier message is in)."""
    while True:
        try:
            parts = sock.recv_multipart(copy=False)
        except zmq.ZMQError:
            return
        if parts[-1].bytes == b"sync":
            sock.send_multipart([parts[0], b"ok"])


async def _serve() -> None:
    gate = asyncio.Event()

    async def step(msg: m.EnvStep, _frames: Any) -> m.EnvStepResult:
        if msg.session_id == _HOLD:
            await gate.wait()
        return m.EnvStepResult(session_id=msg.session_id, observation=msg.action, reward=0.0,
                               terminated=False, truncated=False)

    async def release(_msg: m.EnvClose, _frames: Any) -> m.Ack:
        nonlocal gate
        gate.set()
        gate = asyncio.Event()
        return m.Ack()

    rpc = RpcServer("tcp://127.0.0.1:0", {m.EnvStep: step, m.EnvClose: release},
                    name="echo", auth=INSECURE)
    serving = asyncio.create_task(rpc.serve_forever())
    sink = zmq.Context.instance().socket(zmq.ROUTER)
    sink.setsockopt(zmq.RCVHWM, 0)
    sink.bind("tcp://127.0.0.1:*")
    threading.Thread(target=_sink, args=(sink,), daemon=True).start()
    print(f"ADDRESS {rpc.address} {sink.getsockopt_string(zmq.LAST_ENDPOINT)}", flush=True)
    # Serve until the parent closes our stdin (or dies).
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await rpc.close()
    serving.cancel()


def _spawn() -> tuple[subprocess.Popen, str, str]:
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(root / "src"), str(root), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.rpc_overhead", "serve"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=root)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ADDRESS "):
        proc.kill()
        raise RuntimeError(f"echo server did not start: {line!r}")
    _, rpc_address, sink_address = line.split()
    return proc, rpc_address, sink_address


def _stop(proc: subprocess.Popen) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ----------------------------------------------------------------------------------------------
# Part "calls" and part "gc"
# ----------------------------------------------------------------------------------------------


#: variant -> its ``EnvClient`` class (``before`` added by ``clients`` when the baseline loads)
Clients = dict[str, type]


def clients(ref: str) -> tuple[Clients, dict[str, str]]:
    """``{"before": old EnvClient, "after": EnvClient}`` and what ``meta["baseline"]`` records;
    without the baseline (reason printed) only ``after``."""
    try:
        before = extract(BEFORE, ref)
        cls = before.module("client").EnvClient
    except BaselineUnavailable as e:
        print(f"{NAME}: skipping 'before' ({BEFORE.what}): {e}", file=sys.stderr)
        return {"after": EnvClient}, {"ref": ref, "skipped": str(e)}
    # The imported modules stay loaded; their files are no longer needed.
    before.close()
    return {"before": cls, "after": EnvClient}, {"ref": ref, "commit": before.commit}


def _client(variant: str, address: str, classes: Clients) -> Any:
    cls = EnvClient if variant == "floor" else classes[variant]
    return cls(address, auth=INSECURE, name=variant, heartbeat_interval_s=0)


async def _run_calls(client: Any, concurrency: int, calls: int) -> None:
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while issued < calls:
            issued += 1
            reply = await client.step("s", "a")
            if reply.observation != "a":
                raise RuntimeError(f"bad echo reply {reply!r}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _cpu_per_call(variant: str, address: str, concurrency: int, calls: int,
                        classes: Clients) -> tuple[float, float]:
    """(loop-thread CPU us, process CPU us) per call, after a warm-up of a tenth as many."""
    client = _client(variant, address, classes)
    try:
        await _run_calls(client, concurrency, max(concurrency, calls // 10))
        thread0, proc0 = time.thread_time(), time.process_time()
        await _run_calls(client, concurrency, calls)
        return (1e6 * (time.thread_time() - thread0) / calls,
                1e6 * (time.process_time() - proc0) / calls)
    finally:
        await client.close()


async def _settle(client: Any) -> None:
    """Let every task reach its await and the pump hand every request to ZeroMQ."""
    for _ in range(10_000):
        await asyncio.sleep(0)
        if client._rpc._pump.queued == 0:
            return
    raise RuntimeError("requests still queued in the client after 10000 loop ticks")


async def _park(fut: asyncio.Future) -> None:
    await fut


async def _gc_per_call(variant: str, address: str, in_flight: int, classes: Clients) -> float:
    """GC-tracked objects alive per in-flight ``step`` (the caller's Task included); variant
    ``floor``: per Task awaiting a future of its own, the least any future-based call keeps."""
    loop = asyncio.get_running_loop()
    client = _client(variant, address, classes)
    try:
        await client.step("s", "warm")
        gc.collect()
        base = len(gc.get_objects())
        if variant == "floor":
            futures = [loop.create_future() for _ in range(in_flight)]
            held = [loop.create_task(_park(f)) for f in futures]
            await asyncio.sleep(0)
        else:
            held = [loop.create_task(client.step(_HOLD, "a")) for _ in range(in_flight)]
            await _settle(client)
        gc.collect()
        total = len(gc.get_objects()) - base
        if variant == "floor":
            for f in futures:
                f.set_result(None)
        else:
            await client.close_session("release")
        await asyncio.gather(*held)
        return total / in_flight
    finally:
        await client.close()


# ----------------------------------------------------------------------------------------------
# Part "send" and part "events"
# ----------------------------------------------------------------------------------------------


def _send_cpu(sock: zmq.Socket, blob: bytes, copy: bool, total_bytes: int) -> tuple[float, float]:
    """(loop-thread CPU us, process CPU us) per MB sent, the sink's receipt included."""
    count = max(2, total_bytes // len(blob))
    thread0, proc0 = time.thread_time(), time.process_time()
    for _ in range(count):
        sock.send(blob, copy=copy)
    sock.send(b"sync")
    sock.recv()
    mb = count * len(blob) / 1e6
    return (1e6 * (time.thread_time() - thread0) / mb,
            1e6 * (time.process_time() - proc0) / mb)


def _events_cpu(sock: zmq.Socket, reads: int) -> tuple[float, float]:
    """CPU us per EVENTS read: (getsockopt, zmq_poll)."""
    option, items = int(zmq.EVENTS), [(sock, int(zmq.POLLIN | zmq.POLLOUT))]
    t0 = time.thread_time()
    for _ in range(reads):
        sock.getsockopt(option)
    t1 = time.thread_time()
    for _ in range(reads):
        zmq_poll(items, 0)
    t2 = time.thread_time()
    return 1e6 * (t1 - t0) / reads, 1e6 * (t2 - t1) / reads


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def _calls_for(concurrency: int, quick: bool) -> int:
    base = {1: 2_000, 1024: 20_000, 20000: 60_000}[concurrency]
    return base // 2 if quick else base


def _paired(values: dict[str, list[float]], num: str, den: str) -> tuple[float, list[float]]:
    mean, half = ci95([a / b for a, b in zip(values[num], values[den], strict=True)])
    return mean, [mean - half, mean + half]


async def _measure(rpc_address: str, sink_address: str, repeats: int, quick: bool,
                   classes: Clients) -> dict[str, dict[str, list[float]]]:
    """figure name -> variant -> one value per repeat."""
    data: dict[str, dict[str, list[float]]] = {}

    def add(figure: str, variant: str, value: float) -> None:
        data.setdefault(figure, {}).setdefault(variant, []).append(value)

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sink_address)
    blobs = {size: os.urandom(size) for size in SEND_SIZES}
    send_total = (32 if quick else 128) << 20
    try:
        for rep in range(repeats):
            variants = tuple(v for v in VARIANTS if v in classes)
            order = variants if rep % 2 == 0 else variants[::-1]
            for c in CONCURRENCY:
                for variant in order:
                    thread_us, proc_us = await _cpu_per_call(variant, rpc_address, c,
                                                             _calls_for(c, quick), classes)
                    add(f"loop_thread_cpu_us_per_call at c={c}", variant, thread_us)
                    add(f"process_cpu_us_per_call at c={c}", variant, proc_us)
            for n in GC_IN_FLIGHT:
                for variant in (*order, "floor"):
                    add(f"gc_objects_per_in_flight_call at n={n}", variant,
                        await _gc_per_call(variant, rpc_address, n, classes))
            for size in SEND_SIZES:
                for copy in ((True, False) if rep % 2 == 0 else (False, True)):
                    mode = "copy" if copy else "zero_copy"
                    thread_us, proc_us = _send_cpu(sock, blobs[size], copy, send_total)
                    add(f"send loop_thread_cpu_us_per_mb at {size >> 10} KiB", mode, thread_us)
                    add(f"send process_cpu_us_per_mb at {size >> 10} KiB", mode, proc_us)
            getsockopt_us, poll_us = _events_cpu(sock, 20_000 if quick else 100_000)
            add("events cpu_us_per_read", "getsockopt", getsockopt_us)
            add("events cpu_us_per_read", "zmq_poll", poll_us)
    finally:
        sock.close(linger=0)
    return data


_PAIRS: dict[str, tuple[str, str]] = {"send": ("zero_copy", "copy"),
                                      "events": ("zmq_poll", "getsockopt")}


def run(quick: bool, seed: int, baseline: str = BEFORE.ref) -> dict[str, Any]:
    started = time.perf_counter()
    repeats = 4 if quick else 8
    load_before = os.getloadavg()[0]
    classes, baseline_meta = clients(baseline)
    proc, rpc_address, sink_address = _spawn()
    try:
        data = uvloop.run(_measure(rpc_address, sink_address, repeats, quick, classes))
    finally:
        _stop(proc)
    rows, ratios, intervals = [], {}, {}
    for figure, by_variant in data.items():
        num, den = _PAIRS.get(figure.split()[0], ("after", "before"))
        row: dict[str, Any] = {"figure": figure}
        for side, variant in (("baseline", den), ("candidate", num)):
            if variant not in by_variant:  # the baseline was skipped
                continue
            mean, half = ci95(by_variant[variant])
            row[side] = variant
            row[f"{side}_mean"] = round(mean, 3)
            row[f"{side}_ci95"] = round(half, 3)
        if "floor" in by_variant:
            row["floor_mean"] = round(ci95(by_variant["floor"])[0], 3)
        if den in by_variant:
            key = f"{num}/{den} {figure}"
            ratios[key], intervals[key] = _paired(by_variant, num, den)
            row["ratio"] = round(ratios[key], 4)
        rows.append(row)
    res = result(NAME, simulated=False, rows=rows, ratios=ratios, quick=quick, seed=seed,
                 started=started, ci95=intervals,
                 notes=(f"{repeats} repeats, before/after alternating; one client process, one "
                        f"server process, uvloop both sides, INSECURE sockets; load average "
                        f"{load_before:.2f} before / {os.getloadavg()[0]:.2f} after on "
                        f"{os.cpu_count()} cores"))
    res["meta"]["repeats"] = repeats
    res["meta"]["baseline"] = baseline_meta
    return res


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        uvloop.run(_serve())
        return None
    args = parse_args(NAME, __doc__.splitlines()[0], argv, baseline=BEFORE.ref)
    res = run(args.quick, args.seed, args.baseline)
    emit(res, args.json)
    return res


if __name__ == "__main__":
    main()
