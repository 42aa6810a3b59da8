"""``benchmarks.rpc_overhead`` runs on tiny settings: both client paths (the one before the
deadline wheel, read from git at ``BEFORE.ref``, and today's) answer every echo across
processes, and today's keeps no more GC-tracked objects per in-flight call than a Task awaiting
a future of its own. Without git or the ref (a shallow clone) only ``before`` is skipped."""

from __future__ import annotations

import pytest
import uvloop
from benchmarks import rpc_overhead


def test_both_client_paths_echo_and_gc_objects_per_call_are_counted(
        capsys: pytest.CaptureFixture[str]) -> None:
    classes, meta = rpc_overhead.clients(rpc_overhead.BEFORE.ref)
    if "before" not in classes:
        assert "skipping 'before'" in capsys.readouterr().err and meta["skipped"]
    else:
        assert meta == {"ref": rpc_overhead.BEFORE.ref, "commit": rpc_overhead.BEFORE.ref}
        assert classes["before"] is not classes["after"]
    proc, rpc_address, _sink = rpc_overhead._spawn()
    try:
        async def measure() -> dict[str, tuple[float, float, float]]:
            out = {}
            for variant in classes:
                thread_us, proc_us = await rpc_overhead._cpu_per_call(
                    variant, rpc_address, 8, 200, classes)
                out[variant] = (thread_us, proc_us, await rpc_overhead._gc_per_call(
                    variant, rpc_address, 256, classes))
            out["floor"] = (0.0, 0.0, await rpc_overhead._gc_per_call(
                "floor", rpc_address, 256, classes))
            return out

        got = uvloop.run(measure())
    finally:
        rpc_overhead._stop(proc)
    for variant in classes:
        thread_us, proc_us, _ = got[variant]
        assert 0 < thread_us and 0 < proc_us
    # A held call keeps at least what a Task awaiting a future keeps; today's path no more.
    assert got["floor"][2] >= 2
    assert got["after"][2] <= got["floor"][2] + 0.5
    if "before" in got:  # the old path kept a loop timer and two coroutines more per call
        assert got["after"][2] + 0.5 < got["before"][2]


def test_a_missing_baseline_ref_leaves_only_today_s_path(
        capsys: pytest.CaptureFixture[str]) -> None:
    classes, meta = rpc_overhead.clients("no-such-ref-anywhere")
    assert list(classes) == ["after"]
    err = capsys.readouterr().err
    assert "skipping 'before'" in err and "'no-such-ref-anywhere'" in err
    assert meta["ref"] == "no-such-ref-anywhere" and meta["skipped"]
