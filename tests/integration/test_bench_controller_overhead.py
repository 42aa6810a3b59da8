"""``benchmarks.controller_overhead`` measures a real controller over real backend processes:
a small size yields every figure of issue 11, and the JSON ratios name them per N."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
from pathlib import Path

import pytest
from benchmarks import controller_overhead as co
from benchmarks import overhead_serve as srv
from benchmarks.common import main_for

from rollart.config.schema import RunConfig


def test_one_small_size_reports_every_figure() -> None:
    row = co._one_size(co.Size(64, 1024, 2, 25.0, 5.0), seed=0, gc_policy="tuned")
    assert row["turns"] > 0 and row["cpu_us_per_turn"] > 0
    assert row["lost_replies"] == 0 and row["failed"] == {}
    # the SIMULATED worker holds every trajectory's prefix: no turn is sent twice
    assert row["prefix_resends"] == 0 == row["prefix_resends_per_turn"]
    assert row["timeouts"] >= row["late_replies"] >= 0
    # Both kinds of backend reply -> next request gap were matched across the processes.
    assert row["added_latency_samples"] > 0
    assert 0 <= row["added_latency_p50_ms"] <= row["added_latency_p99_ms"]
    lo, hi = row["added_latency_p99_ci95"]
    assert lo <= row["added_latency_p99_ms"] <= hi
    assert row["loop_lag_p99_ms"] >= 0 and row["rss_bytes_per_traj"] > 0
    assert 0 < row["loop_thread_cpu_us_per_turn"] <= row["cpu_us_per_turn"]
    assert row["loop_sleeps_per_turn"] > 0  # 64 trajectories at 10 s per step: a mostly idle loop
    assert row["env_mean_s"] == co.ENV_MEAN_S
    # the run's default send window, and 64 trajectories never fill it
    assert row["max_generate_in_flight"] == RunConfig().max_generate_in_flight
    assert row["window_waits"] == 0
    assert row["weight_wait_turns"] >= 0 and 0 <= row["weight_wait_share"] <= 1
    # what else used the machine: both backends worked, and the machine shares add up
    assert row["worker_cpu_share_of_core"] > 0 and row["env_cpu_share_of_core"] > 0
    shares = [row[k] for k in ("machine_busy_share", "machine_idle_share",
                               "machine_steal_share")]
    assert all(0 <= x <= 1 for x in shares) and 0.99 <= sum(shares) <= 1.0
    ratios, ci95 = co.ratios_of([row], {"floor_cpu_us_per_rpc": 10.0,
                                        "floor_cpu_us_per_rpc_ci95": 1.5})
    for key in ("lost_replies at 64", "cpu_us_per_turn at 64", "added_latency_p99_ms at 64",
                "loop_lag_p99_ms at 64", "turns_per_s at 64", "loop_sleeps_per_turn at 64",
                "prefix_resends at 64", "window_waits at 64"):
        assert not math.isnan(ratios[key])
    # intervals live in ci95 as [low, high] beside their ratio, never as ratios of their own
    assert not any("ci95" in key for key in ratios)
    assert ci95["cpu_us_per_turn at 64"] == row["cpu_us_per_turn_ci95"]
    assert ci95["added_latency_p99_ms at 64"] == [lo, hi]
    assert ci95["floor_cpu_us_per_rpc"] == [8.5, 11.5]


def test_a_worker_that_evicts_prefixes_shows_in_prefix_resends() -> None:
    # Until 2026-12-02 the SIMULATED worker kept its default 16 Mi prefix tokens, so at 10k
    # trajectories ~every later turn was refused and resent whole, and each resend counted as
    # a turn. Here it holds 2000 tokens (under two 1024-token trajectories' sequences): the
    # resends show.
    row = co._one_size(co.Size(32, 1024, 3, 25.0, 3.0), seed=0, gc_policy="tuned",
                       max_prefix_tokens=2000)
    assert row["prefix_resends"] > 0 and row["prefix_resends_per_turn"] > 0.2
    assert row["lost_replies"] == 0 and row["failed"] == {}


def test_the_worker_holds_every_in_flight_trajectory_at_every_size() -> None:
    from rollart.inference.prefixes import DEFAULT_MAX_PREFIX_ENTRIES, DEFAULT_MAX_PREFIX_TOKENS

    for size in (*co.QUICK, *co.FULL):
        batch, alpha = co._batch_alpha(size.n)
        in_flight = (alpha + 1) * batch
        assert in_flight >= size.n
        assert co.prefix_bound(size) >= in_flight * (size.context_tokens + co.EXTRA_TOKENS)
        # the store's default (what the worker had before) could not: it evicted
        assert co.prefix_bound(size) > DEFAULT_MAX_PREFIX_TOKENS
        assert in_flight <= DEFAULT_MAX_PREFIX_ENTRIES


def test_each_size_of_a_run_has_its_own_n_and_the_last_saturates() -> None:
    # the JSON ratios are named "at N": N must tell the sizes of one run apart
    for sizes in (co.QUICK, co.FULL):
        assert len({s.n for s in sizes}) == len(sizes)
        # every run ends with a size meant to saturate, after the 10 s-latency ones
        assert sizes[-1].env_mean_s < co.ENV_MEAN_S
        assert all(s.env_mean_s == co.ENV_MEAN_S for s in sizes[:-1])


def test_machine_shares_split_proc_stat_jiffies() -> None:
    # user nice system idle iowait irq softirq steal
    before = [100, 0, 50, 1000, 10, 0, 5, 200]
    after = [160, 0, 70, 1080, 10, 0, 15, 400]  # +60 +0 +20 +80 +0 +0 +10 +200 = 370
    shares = co._machine_shares(before, after)
    assert shares["machine_busy_share"] == pytest.approx(90 / 370)
    assert shares["machine_idle_share"] == pytest.approx(80 / 370)
    assert shares["machine_steal_share"] == pytest.approx(200 / 370)
    assert co._machine_shares(None, after) == {}


def test_a_turn_that_waited_for_weights_counts_only_the_controllers_part() -> None:
    # Session s1 of trajectory t1: open [0, 1], generate t0 [1.001, 1.002], step 0
    # [1.004, 10], a wait for weights [10.003, 14.999], generate t1 at 15.0.
    worker = srv.Records(calls=[("t1/t0", -1, 1.001, 1.002), ("t1/t1", -1, 15.0, 15.1)])
    env = srv.Records(calls=[("s1", -1, 0.0, 1.0), ("s1", 0, 1.004, 10.0)])
    after_env, after_gen, waits = co._gaps(worker, env, {"s1": "t1"}, (0.0, 100.0),
                                           {"t1": [(10.003, 14.999)]})
    assert waits == pytest.approx([4996.0])
    # env reply -> generate: 1 ms after the open; 5000 ms after step 0, of which 4996 waited
    assert sorted(after_env) == pytest.approx([1.0, 4.0])
    assert after_gen == pytest.approx([2.0])  # generate t0's reply -> step 0


# The ``--quick`` sizes at their documented N (README: 1000 and 10000 trajectories) but with short
# contexts and a short window: the same code path (the size loop, the memory estimate carried
# from one size to the next, fresh backends per size, the floor, the JSON) at ~1/3 of the
# quick run's time and without its ~7 GiB at 10000 x 16k. What the figures measure is the
# benchmark's concern; the test checks that every one of them is produced.
TEST_SIZES = (co.Size(1000, 2048, 3, 20.0, 5.0), co.Size(10_000, 1024, 3, 25.0, 5.0),
              co.Size(2000, 1024, 3, 10.0, 5.0, env_mean_s=0.2))


def test_quick_sizes_are_the_documented_ones() -> None:
    assert [(s.n, s.context_tokens, s.turns, s.env_mean_s) for s in co.QUICK] == [
        (1000, 32768, 3, 10.0), (10_000, 16384, 3, 10.0), (2000, 16384, 3, 0.2)]
    assert [(s.n, s.turns, s.env_mean_s) for s in TEST_SIZES] == [
        (s.n, s.turns, s.env_mean_s) for s in co.QUICK]


@pytest.mark.slow
def test_quick_json_has_the_figures_at_10000(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(co, "QUICK", TEST_SIZES)
    out = tmp_path / "controller_overhead.json"
    main_for("controller_overhead", "", co.run, ["--quick", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "controller_overhead" and data["simulated"] is False
    assert [r["n"] for r in data["rows"]] == [1000, 10_000, 2000]
    assert not any("skipped" in r for r in data["rows"])
    for n in (1000, 10_000, 2000):
        assert {f"lost_replies at {n}", f"cpu_us_per_turn at {n}",
                f"added_latency_p99_ms at {n}", f"loop_sleeps_per_turn at {n}",
                f"turns_per_s at {n}", f"env_mean_s at {n}"} <= set(data["ratios"])
    assert data["ratios"]["lost_replies at 2000"] == 0
    assert [data["ratios"][f"env_mean_s at {n}"] for n in (1000, 10_000, 2000)] == [
        co.ENV_MEAN_S, co.ENV_MEAN_S, 0.2]
    assert data["ratios"]["floor_cpu_us_per_rpc"] > 0


def test_controller_side_split_measures_inside_the_controller(monkeypatch) -> None:
    # Opt-in: the reply-read -> next-request-sent gap, timed in the controller process. Every
    # such gap lies inside its backend-to-backend gap, so its quantiles cannot be larger.
    monkeypatch.setenv(co.SPLIT_ENV, "1")
    monkeypatch.setenv(co.PIN_ENV, "1")  # and the production layout, as far as it goes here
    cpus = os.sched_getaffinity(0)
    row = co._one_size(co.Size(64, 1024, 2, 25.0, 5.0), seed=0, gc_policy="tuned")
    assert row["controller_latency_samples"] > 0
    assert 0 <= row["controller_latency_p50_ms"] <= row["controller_latency_p99_ms"]
    assert row["controller_latency_p50_ms"] <= row["added_latency_p50_ms"]
    # Each call's two transport legs, matched across the processes.
    assert row["leg_samples"] > 0
    assert 0 <= row["request_leg_p50_ms"] <= row["request_leg_p99_ms"]
    assert 0 <= row["reply_leg_p50_ms"] <= row["reply_leg_p99_ms"]
    assert row["pinned"] == (len(cpus) >= 2)
    assert os.sched_getaffinity(0) == cpus  # the controller's CPUs are given back
    # the patch is gone with the run
    from rollart.transport.rpc import RpcClient

    assert RpcClient.submit_call.__qualname__ == "RpcClient.submit_call"


def test_legs_are_the_transport_on_each_side_of_a_backend_handler() -> None:
    # generate t1/t0: sent by the controller at 1.0, handled 1.002-1.004, read at 1.010;
    # env step 0 of s1: sent 1.011, handled 1.014-3.0, read 3.001; a call outside the window
    # and a backend call the controller did not record (an open) are left out.
    backend = (srv.Records(calls=[("t1/t0", -1, 1.002, 1.004), ("t9/t0", -1, 20.0, 20.1)]),
               srv.Records(calls=[("s1", -1, 0.5, 0.6), ("s1", 0, 1.014, 3.0)]))
    controller = (srv.Records(calls=[("t1/t0", -1, 1.0, 1.010), ("t9/t0", -1, 19.9, 20.2)]),
                  srv.Records(calls=[("s1", 0, 1.011, 3.001)]))
    request, reply = co._legs(backend, controller, (0.0, 10.0))
    assert request == pytest.approx([2.0, 3.0]) and reply == pytest.approx([1.0, 6.0])


def test_controller_side_records_pair_replies_with_the_next_request() -> None:
    split = co.ControllerSide()
    # trajectory t1 on session s1: generate t0 sent 1.0, read 1.1; step 0 sent 1.3, read 5.0;
    # generate t1 sent 5.002, read 5.1; a generate with no reply (timed out) is left out
    split.sent = {(1, b"a"): ("g", "t1/t0", 1.0), (2, b"a"): ("e", "s1", 1.3),
                  (1, b"b"): ("g", "t1/t1", 5.002), (1, b"c"): ("g", "t9/t0", 2.0)}
    split.got = {(1, b"a"): 1.1, (2, b"a"): 5.0, (1, b"b"): 5.1}
    gen, env = split.records()
    assert env.calls == [("s1", 0, 1.3, 5.0)]
    # a turn refused with prefix_unknown and resent: from its first send to its last reply
    split.sent[(1, b"d")] = ("g", "t1/t1", 5.004)
    split.got[(1, b"b")], split.got[(1, b"d")] = 5.003, 5.2
    gen, _ = split.records()
    assert ("t1/t1", -1, 5.002, 5.2) in gen.calls and len(gen.calls) == 2
    after_env, after_gen, _ = co._gaps(gen, env, {"s1": "t1"}, (0.0, 10.0), {})
    assert after_env == pytest.approx([2.0]) and after_gen == pytest.approx([200.0])


def test_under_two_busy_processes_no_reply_is_lost_and_every_figure_reported(
        monkeypatch) -> None:
    # Overload slows the controller but must not stop it: both cores stay busy with other
    # processes for the whole run, at the smallest size; no timing is asserted.
    monkeypatch.setattr(co, "QUICK", (co.Size(64, 1024, 2, 25.0, 5.0),))
    monkeypatch.setattr(co, "_floor", lambda quick: {"floor_cpu_us_per_rpc": 10.0,
                                                      "floor_cpu_us_per_rpc_ci95": 1.5})
    res = co.main(["--quick", "--load", "2"])
    (row,) = res["rows"]
    assert row["lost_replies"] == 0 and row["failed"] == {}
    assert row["turns"] > 0 and row["added_latency_samples"] > 0
    assert row["load_processes"] == 2 == res["ratios"]["load_processes"]
    assert row["loadavg_1min"] > 0 and res["ratios"]["loadavg_1min"] > 0
    for key in ("lost_replies at 64", "cpu_us_per_turn at 64", "added_latency_p99_ms at 64",
                "loop_lag_p99_ms at 64", "turns_per_s at 64", "loop_sleeps_per_turn at 64"):
        assert not math.isnan(res["ratios"][key])
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("cpu-load")]


def test_the_load_processes_stop_when_the_run_raises() -> None:
    with pytest.raises(RuntimeError), co.cpu_load(2) as procs:
        assert all(p.is_alive() for p in procs)
        raise RuntimeError("the run failed")
    assert not any(p.is_alive() for p in procs)
    assert all(p.exitcode is not None for p in procs)
