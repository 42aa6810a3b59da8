"""``redundancy``: redundant env rollouts under stragglers and failures (SIMULATED envs, REAL
controller, ``sync_plus`` mode so each step's collection time is measured without overlap).

Redundancy ``k`` starts ``group_size + k`` members per group and cancels the rest once
``group_size`` succeed. Stragglers: env step latency normal(10 s, std 10 s) clipped at 0, the
widest spread of the paper's Fig. 11b. Failures: the paper's production rate, env reset success
> 99.99% (production deployment, paper §7), charged per env step (a conservative reading: 1e-4 per call). Beside it, a
sweep of failure rates (1% (full size only), 5% per step) shows where redundancy starts to pay for failures
rather than stragglers. Reports collection (rollout) time, the share of generated tokens thrown
away, and the response-length bias of ``first`` (the paper's) vs ``unbiased`` selection (kept
length relative to k = 0, which keeps every member). Each ratio: 3 (quick) / 5 seeds.
Paper §6.1: collection up to 1.62x faster.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, small, summarize
from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated
from rollart.sim.workload import Dist, DomainSpec, const

NAME = "redundancy"
#: env reset success > 99.99% (paper §7, production deployment)
PAPER_FAILURE = 1e-4
#: (failure per env step, k, selection) configurations; the first block is the paper's rate
CONFIGS = ((PAPER_FAILURE, 0, "first"), (PAPER_FAILURE, 2, "first"), (PAPER_FAILURE, 4, "first"),
           (PAPER_FAILURE, 4, "unbiased"), (0.01, 0, "first"), (0.01, 2, "first"),
           (0.05, 0, "first"), (0.05, 2, "first"))


def scenario(quick: bool, k: int, selection: str, failure: float) -> SimScenario:
    spec = DomainSpec("straggly", prompt_tokens=const(2000), obs_tokens=const(500),
                      response_tokens=Dist("lognormal", 200, 150, 8, 1e9),
                      num_turns=Dist("uniform", 6, 1.5, 1, 1e9),
                      step_latency_s=Dist("normal", 10.0, 10.0, 0.0, 1e9),
                      reset_latency_s=const(0.5), step_failure_prob=failure)
    return SimScenario(pools=(SimPool("h800", "h800", 4 if small(quick) else 16, max_batch=256),),
                       domains=(SimDomain(spec, "h800"),), model="qwen3-8b", mode="sync_plus",
                       steps=3 if quick else 11, batch_size=64 if small(quick) else 256, group_size=8,
                       redundancy=k, selection=selection, selection_deadline_s=30.0,
                       trainer_gpus=8, max_tokens_per_turn=4096,
                       max_tokens_per_trajectory=16384, max_attempts=5)


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, times, kept = [], {}, {}
    configs = [c for c in CONFIGS if not (quick and c[0] == 0.01)]  # CI time budget
    for failure, k, selection in configs:
        for sd in seeds:
            res = run_simulated(scenario(quick, k, selection, failure), sd)
            gen = sum(s["num_generated_tokens"] for s in res.steps)
            wasted = sum(s["wasted_tokens"] for s in res.steps)
            rollout = statistics.fmean(s["rollout_time_s"] for s in res.steps[1:])
            times.setdefault((failure, k, selection), []).append(rollout)
            kept.setdefault((failure, k, selection), []).append(res.buffer["kept_mean_len"])
            rows.append({"failure_per_step": failure, "redundancy": k, "selection": selection,
                         "step_time_s": res.step_time_s, "rollout_time_s": rollout,
                         "wasted_share": wasted / gen if gen else 0.0,
                         "kept_len_mean": res.buffer["kept_mean_len"],
                         "cancelled_len_mean": res.buffer["cancelled_mean_len"],
                         "failed": sum(res.buffer["failed"].values())})
    samples = {}
    for failure, k, selection in configs:
        if k == 0:
            continue
        base = (failure, 0, "first")
        label = f"fail {failure:g}: k={k} {selection} vs k=0"
        samples[f"{label} (rollout)"] = [b / t for b, t in zip(times[base],
                                                               times[(failure, k, selection)],
                                                               strict=True)]
        if failure == PAPER_FAILURE:
            samples[f"{label}: kept length ratio"] = [
                x / b if b else float("nan")
                for b, x in zip(kept[base], kept[(failure, k, selection)], strict=True)]
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True,
                  rows=mean_rows(rows, ("failure_per_step", "redundancy", "selection")),
                  ratios=ratios, ci95=ci, seeds=seeds, quick=quick, seed=seed,
                  started=started, notes="paper: collection up to 1.62x faster (§6.1); env "
                  "reset success > 99.99% (paper §7)")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
