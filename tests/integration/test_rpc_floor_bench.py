"""``benchmarks.rpc_floor`` runs end to end on tiny settings: every transport answers every echo
call with the right reply across processes, and ``measure_floor`` returns its rows."""

from __future__ import annotations

import math
import os

import uvloop
from benchmarks import rpc_floor


def test_every_transport_echoes_across_processes() -> None:
    procs = {kind: rpc_floor._spawn(kind) for kind in rpc_floor.KINDS}
    try:
        async def measure() -> dict[str, float]:
            # _run_calls raises on a wrong reply; every call must come back.
            return {kind: await rpc_floor._measure(kind, address, 8, 400)
                    for kind, (_, address) in procs.items()}

        rates = uvloop.run(measure())
    finally:
        for proc, _ in procs.values():
            rpc_floor._stop(proc)
    assert set(rates) == {"new", "curve", "old", "floor"} and all(r > 0 for r in rates.values())


def test_measure_floor_rows() -> None:
    rows = rpc_floor.measure_floor((1, 4), repeats=2, quick=True)
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert r["calls_per_s"] > 0 and math.isfinite(r["calls_per_s_ci95"])
        assert math.isclose(r["us_per_call"], 1e6 / r["calls_per_s"])
        # The calling process's CPU per call: positive, and at most its wall time per call
        # plus the other cores' share (one process cannot use more than every core).
        assert 0 < r["client_cpu_us_per_call"] <= (os.cpu_count() or 1) * r["us_per_call"]
        assert math.isfinite(r["client_cpu_us_per_call_ci95"])


def test_ci95_matches_student_t() -> None:
    mean, half = rpc_floor.ci95([1.0, 2.0, 3.0, 4.0, 5.0])
    # stdev 1.5811, n 5, t(4) 2.776 -> 2.776 * 1.5811 / sqrt(5) = 1.9629
    assert mean == 3.0 and math.isclose(half, 1.9629, rel_tol=1e-3)
