"""``benchmarks.rpc_floor`` runs end to end on tiny settings: every transport answers every echo
call with the right reply across processes (the ``old`` one read from git at ``OLD.ref``, or
skipped when git or the ref is missing, as in a shallow clone), and ``measure_floor`` returns
its rows."""

from __future__ import annotations

import math
import os

import pytest
import uvloop
from benchmarks import rpc_floor


def test_every_transport_echoes_across_processes(capsys: pytest.CaptureFixture[str]) -> None:
    old, meta = rpc_floor.old_transport(rpc_floor.OLD.ref)
    kinds = rpc_floor.KINDS if old is not None else tuple(
        k for k in rpc_floor.KINDS if k != "old")
    if old is None:  # no git history here: the run goes on without it and says why
        assert "skipping the 'old' transport" in capsys.readouterr().err
        assert meta["ref"] == rpc_floor.OLD.ref and meta["skipped"]
    else:
        assert meta == {"ref": rpc_floor.OLD.ref, "commit": rpc_floor.OLD.ref}
    procs = {}
    try:
        for kind in kinds:
            procs[kind] = rpc_floor._spawn(kind, old)

        async def measure() -> dict[str, float]:
            # _run_calls raises on a wrong reply; every call must come back.
            return {kind: await rpc_floor._measure(kind, address, 8, 400, old=old)
                    for kind, (_, address) in procs.items()}

        rates = uvloop.run(measure())
    finally:
        for proc, _ in procs.values():
            rpc_floor._stop(proc)
        if old is not None:
            old.close()
    assert set(rates) == set(kinds) and all(r > 0 for r in rates.values())


def test_a_missing_baseline_ref_skips_the_old_transport_with_its_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    old, meta = rpc_floor.old_transport("no-such-ref-anywhere")
    assert old is None
    err = capsys.readouterr().err
    assert "skipping the 'old' transport" in err and "'no-such-ref-anywhere'" in err
    assert meta["ref"] == "no-such-ref-anywhere" and "no-such-ref-anywhere" in meta["skipped"]


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
