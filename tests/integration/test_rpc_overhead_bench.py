"""``benchmarks.rpc_overhead`` runs on tiny settings: both client paths (the vendored one
before issue 11's cuts and today's) answer every echo across processes, and today's keeps no
more GC-tracked objects per in-flight call than a Task awaiting a future of its own."""

from __future__ import annotations

import uvloop
from benchmarks import rpc_overhead


def test_both_client_paths_echo_and_gc_objects_per_call_are_counted() -> None:
    proc, rpc_address, _sink = rpc_overhead._spawn()
    try:
        async def measure() -> dict[str, tuple[float, float, float]]:
            out = {}
            for variant in ("before", "after"):
                thread_us, proc_us = await rpc_overhead._cpu_per_call(variant, rpc_address, 8,
                                                                      200)
                out[variant] = (thread_us, proc_us,
                                await rpc_overhead._gc_per_call(variant, rpc_address, 256))
            out["floor"] = (0.0, 0.0, await rpc_overhead._gc_per_call("floor", rpc_address, 256))
            return out

        got = uvloop.run(measure())
    finally:
        rpc_overhead._stop(proc)
    for variant in ("before", "after"):
        thread_us, proc_us, _ = got[variant]
        assert 0 < thread_us and 0 < proc_us
    # A held call keeps at least what a Task awaiting a future keeps; today's path no more.
    assert got["floor"][2] >= 2
    assert got["after"][2] <= got["floor"][2] + 0.5 < got["before"][2]
