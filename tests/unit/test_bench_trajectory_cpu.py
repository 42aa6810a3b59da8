"""``benchmarks.trajectory_cpu``: one child measurement runs the real controller path against
its stand-ins, and a trajectory parked in its env step holds a bounded number of GC-tracked
objects (an object count, deterministic: no timing)."""

from __future__ import annotations

import math

import uvloop
from benchmarks import trajectory_cpu as bench

#: GC-tracked objects per running trajectory parked in an env step: 33.75 before the cuts (a
#: copied context per done callback, per-turn arrays and the message list kept across the env
#: step), 26 after; about 29 since every trajectory has a wall-clock limit by default (its
#: ``asyncio.Timeout`` and timer handles, 3 objects) and every group a deadline timer; a little
#: headroom for the interpreter's own bookkeeping
MAX_OBJECTS_PER_TRAJ = 31


def test_one_child_measurement() -> None:
    out = bench._child(32, 2, 0)  # the window after the warm-up step
    assert out["turns"] > 0 and out["completed"] > 0
    # only trajectories that straddle the window's ends (at most the 32 in flight) may have
    # turns on one side of it and their completion on the other
    assert abs(out["turns"] - bench.TURNS * out["completed"]) <= bench.TURNS * 32
    for key in ("loop_cpu_us_per_turn", "loop_cpu_us_per_traj", "completion_us"):
        assert math.isfinite(out[key]) and out[key] > 0
    assert 0 < out["gc_objects_per_traj"] <= MAX_OBJECTS_PER_TRAJ


def test_parked_trajectories_hold_few_gc_objects() -> None:
    async def slope() -> float:
        a, pa = await bench._parked_objects(32, 0)
        b, pb = await bench._parked_objects(64, 0)
        assert (pa, pb) == (32, 64)  # every admitted trajectory reached its env step
        return (b - a) / (pb - pa)

    assert uvloop.run(slope()) <= MAX_OBJECTS_PER_TRAJ


#: a parked trajectory's memory per prompt token: 4 bytes of token id + 1 of loss mask (its
#: logprobs and versions are kept for generated tokens only), plus the arrays' headroom
#: (1/16) and what does not scale with the prompt (a few KiB over 16k tokens); it was 13+
#: with full-length logprob and version arrays
MAX_BYTES_PER_PROMPT_TOKEN = 6.0


def test_parked_trajectories_hold_five_bytes_per_prompt_token() -> None:
    async def slope() -> float:
        await bench._parked_bytes(16, 0)  # one-time allocations (caches, lazy imports)
        a, pa = await bench._parked_bytes(16, 0)
        b, pb = await bench._parked_bytes(32, 0)
        assert (pa, pb) == (16, 32)
        return (b - a) / (pb - pa) / bench.CONTEXT

    per_token = uvloop.run(slope())
    assert 5.0 <= per_token <= MAX_BYTES_PER_PROMPT_TOKEN, per_token


def test_a_baseline_that_is_no_commit_is_a_usage_error(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit) as exit_:
        bench.main(["--quick", "--baseline", "no-such-ref-xyz"])
    assert exit_.value.code == 2
    assert "--baseline 'no-such-ref-xyz' is not a commit" in capsys.readouterr().err
