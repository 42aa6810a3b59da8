"""``env_tail``: trajectory-level (``sync_plus``) vs batch-barrier (``sync``) rollout when env
steps take normal(mean 10 s, std 1 / 2 / 5 / 10 s) (SIMULATED envs, REAL controller).

Paper Fig. 11b: 1.23x (std 1 s) -> 2.27x (std 10 s), a ROLLOUT speedup, so the ratio compares
rollout time (first trajectory start to last finish of each step's batch, mean over steps
after the first), not whole step time: training and weight sync take the same time in both
modes and would dilute it. Each ratio is measured on 3 (quick) / 5 seeds. The *ideal* speedup
uses the same latency samples the run drew: per batch of ``batch_size`` sessions (in open order), a barrier rollout
waits sum_t max_i L[i][t], a trajectory-level one max_i sum_t L[i][t]; ideal = the ratio of the
sums over batches (generation time ignored). Latencies are clipped at 0.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, summarize
from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated
from rollart.sim.workload import Dist, DomainSpec, const

NAME = "env_tail"
STDS = (1.0, 2.0, 5.0, 10.0)


def scenario(std: float, quick: bool, mode: str) -> SimScenario:
    spec = DomainSpec("env", prompt_tokens=const(1024), obs_tokens=const(256),
                      response_tokens=Dist("lognormal", 256, 128, 8, 1e9),
                      num_turns=const(5), step_latency_s=Dist("normal", 10.0, std, 0.0, 1e9))
    return SimScenario(pools=(SimPool("h800", "h800", 4 if quick else 16, max_batch=256),),
                       domains=(SimDomain(spec, "h800"),), model="qwen3-8b", mode=mode,
                       steps=3 if quick else 5, batch_size=64 if quick else 256, group_size=8,
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


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
