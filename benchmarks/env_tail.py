"""``env_tail``: trajectory-level (``sync_plus``) vs batch-barrier (``sync``) rollout when env
steps take normal(mean 10 s, std 1 / 2 / 5 / 10 s) (SIMULATED envs, REAL controller).

Paper Fig. 11b: 1.23x (std 1 s) -> 2.27x (std 10 s), a ROLLOUT speedup, so the ratio compares
rollout time (first trajectory start to last finish of each step's batch, mean over steps
after the first), not whole step time: training and weight sync take the same time in both
modes and would dilute it. Each ratio is measured on 3 (quick) / 5 seeds. The *ideal* speedup
uses the same latency samples the run drew: per batch of ``batch_size`` sessions (in open order), a barrier rollout
waits sum_t max_i L[i][t], a trajectory-level one max_i sum_t L[i][t]; ideal = the ratio of the
sums over batches (generation time ignored). Latencies are clipped at 0.

Real nodes: ``--scenario FILE`` (``benchmarks.on_scenario``) runs ``sync`` and ``sync_plus`` on
that scenario instead, with every env host the launcher starts injecting normal(``--env-mean-s``,
std) latency on every env step (``[env_hosts.latency."*"]``, seeded by the run's seed; hosts
named by address keep their own injection, listed in ``meta.notes``). ``--stds``
picks the stds (default all four; ``--quick``: 1 and 10 s). Same rows, ratios and ci95 (with
``--seeds`` >= 2), except the ideal speedup: it needs every session's drawn latencies, which only
the simulator records.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.common import main_for, mean_rows, result, seeds_for, small, summarize
from benchmarks.on_scenario import mean_after_first, scenario_main, steps_for, train
from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated
from rollart.sim.workload import Dist, DomainSpec, const

NAME = "env_tail"
STDS = (1.0, 2.0, 5.0, 10.0)


def scenario(std: float, quick: bool, mode: str) -> SimScenario:
    spec = DomainSpec("env", prompt_tokens=const(1024), obs_tokens=const(256),
                      response_tokens=Dist("lognormal", 256, 128, 8, 1e9),
                      num_turns=const(5), step_latency_s=Dist("normal", 10.0, std, 0.0, 1e9))
    return SimScenario(pools=(SimPool("h800", "h800", 4 if small(quick) else 16, max_batch=256),),
                       domains=(SimDomain(spec, "h800"),), model="qwen3-8b", mode=mode,
                       steps=3 if quick else 5, batch_size=64 if small(quick) else 256, group_size=8,
                       trainer_gpus=8, max_tokens_per_turn=4096,
                       max_tokens_per_trajectory=16384)


def ideal_speedup(sessions: list[tuple[float, list[float]]], batch_size: int) -> float:
    barrier = async_ = 0.0
    for i in range(0, len(sessions) - batch_size + 1, batch_size):
        batch = [lat for _, lat in sessions[i:i + batch_size]]
        turns = max(len(lat) for lat in batch)
        barrier += sum(max(lat[t] for lat in batch if t < len(lat)) for t in range(turns))
        async_ += max(sum(lat) for lat in batch)
    return barrier / async_ if async_ else float("nan")


def _rollout_s(steps: list[dict]) -> float:
    return statistics.fmean(s["rollout_time_s"] for s in steps[1:])


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, samples = [], {}
    for std in STDS:
        for sd in seeds:
            sync = run_simulated(scenario(std, quick, "sync"), sd)
            plus = run_simulated(scenario(std, quick, "sync_plus"), sd)
            ideal = ideal_speedup(sync.session_latencies, scenario(std, quick, "sync").batch_size)
            speedup = _rollout_s(sync.steps) / _rollout_s(plus.steps)
            rows.append({"env_std_s": std, "batch_rollout_s": _rollout_s(sync.steps),
                         "traj_level_rollout_s": _rollout_s(plus.steps),
                         "batch_step_s": sync.step_time_s,
                         "traj_level_step_s": plus.step_time_s, "speedup": speedup,
                         "ideal_speedup": ideal})
            samples.setdefault(f"std {std:g}s: trajectory-level vs batch", []).append(speedup)
            samples.setdefault(f"std {std:g}s: ideal", []).append(ideal)
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("env_std_s",)), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes="paper Fig. 11b: 1.23x (std 1) -> 2.27x (std 10); rollout time, "
                  "mean over steps after the first")


def with_env_latency(base: Any, *, mode: str, std_s: float, mean_s: float, seed: int,
                     steps: int) -> tuple[Any, list[str]]:
    """``base`` (a ``rollart.config.Scenario``) in ``mode`` (``sync`` / ``sync_plus``), every
    local env host injecting normal(``mean_s``, ``std_s``) seconds (clipped at 0) on every env
    step; returns it validated and the names of hosts given by address (not injected).
    Raises ValueError if no env host is started locally."""
    from benchmarks.modes import scenario_for_mode
    from rollart.envhost.latency import LatencyConfig

    latency = LatencyConfig(distribution="normal", mean_s=mean_s, std_s=std_s, seed=seed)
    local = [h for h in base.env_hosts if h.address is None]
    if not local:
        raise ValueError("the scenario starts no env host (every [[env_hosts]] has an address "
                         "or there is none): nothing to inject env latency into")
    hosts = [h if h.address is not None else
             msgspec.structs.replace(h, latency={"*": latency}) for h in base.env_hosts]
    changed = msgspec.structs.replace(base, env_hosts=hosts)
    return (scenario_for_mode(changed, mode, seed=seed, steps=steps),
            [h.name for h in base.env_hosts if h.address is not None])


def run_on_scenario(path: Path, quick: bool, seed: int, *, num_seeds: int, cache_dir: Path,
                    run_dir: Path, args: argparse.Namespace) -> dict:
    """``sync`` vs ``sync_plus`` rollout time on the REAL scenario at ``path`` under injected
    env latency; raises what ``open_cluster`` raises (ConfigError, ProcessFailedError, ...)."""
    from rollart.config import load_scenario

    started = time.perf_counter()
    base = load_scenario(path)
    stds = args.stds or ((1.0, 10.0) if quick else STDS)
    seeds = [seed + i for i in range(num_seeds)]
    rows, samples, remote = [], {}, []
    for std in stds:
        for sd in seeds:
            got = {}
            for mode in ("sync", "sync_plus"):
                sc, remote = with_env_latency(base, mode=mode, std_s=std, mean_s=args.env_mean_s,
                                              seed=sd, steps=steps_for(quick, base, args))
                got[mode] = train(sc, run_dir / f"{mode}-std{std:g}-{sd}", cache_dir,
                                  str(path))
            sync, plus = got["sync"], got["sync_plus"]
            speedup = (mean_after_first(sync, "rollout_time_s")
                       / mean_after_first(plus, "rollout_time_s"))
            rows.append({"env_std_s": std,
                         "batch_rollout_s": mean_after_first(sync, "rollout_time_s"),
                         "traj_level_rollout_s": mean_after_first(plus, "rollout_time_s"),
                         "batch_step_s": mean_after_first(sync, "step_time_s"),
                         "traj_level_step_s": mean_after_first(plus, "step_time_s"),
                         "speedup": speedup})
            samples.setdefault(f"std {std:g}s: trajectory-level vs batch", []).append(speedup)
    ratios, ci = summarize(samples)
    return result(NAME, simulated=False, rows=mean_rows(rows, ("env_std_s",)), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes=f"measured wall clock, real services of {path}; env latency "
                  f"normal({args.env_mean_s:g} s, std) on every step of local env hosts"
                  + (f"; hosts at addresses, not injected: {remote}" if remote else ""))


def _seconds(text: str) -> float:
    """An argparse type: seconds, finite and within the env hosts' latency bounds [0, 3600]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.0 <= value <= 3600.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text} s is outside [0, 3600]")
    return value


def _scenario_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--stds", type=_seconds, nargs="+", default=None,
                        help="env-latency stds, seconds (default 1 2 5 10; --quick: 1 10)")
    parser.add_argument("--env-mean-s", type=_seconds, default=10.0,
                        help="mean injected env-step latency, seconds (the paper's 10)")


def main(argv: list[str] | None = None) -> dict:
    return scenario_main(NAME, argv, lambda rest: main_for(NAME, __doc__ or "", run, rest),
                         run_on_scenario, _scenario_args)


if __name__ == "__main__":
    main()
