"""``ablations``: RollArt with each feature switched off alone, side by side with everything
on, on the ``modes`` workload (SIMULATED cluster, REAL controller; Qwen3-32B, alpha 1).

"Everything on" (``full``): hardware affinity (agentic -> H800, reasoning -> H20), the per-turn
staleness check, redundant rollouts (2 extra members per group of 8, ``first`` selection),
serverless reward (remote I/O per call lognormal mean 0.015 s, max 2.1 s: paper §7.5) and the
weight push overlapped with rollout (only the apply at the pause is exposed). Env steps fail
with the paper's rate (reset success > 99.99%: 1e-4 per call). One knob off each:

- ``no_affinity``: both domains spread over every engine in proportion to pool size;
- ``no_per_turn``: the staleness check only at a trajectory's first turn (the alpha bound is
  still enforced when it completes and at batch assembly, so stale work is found late);
- ``no_redundancy``: exactly ``group_size`` members per group;
- ``dedicated_reward``: rewards on dedicated H800 reward GPUs (paper §3: "dedicated reward
  GPUs"; one per 16 rollout GPUs, an assumption), each one call at a time, each a prefill of prompt + final response on a reward model of
  the policy's size (assumption: the paper names no reward model), plus the same I/O latency;
  its utilisation is reported (paper §3: as low as 7.4%; 6% before offloading, §7.5);
- ``no_overlap_sync``: the push is made at the pause point, blocking (all of it exposed).

Ratio per knob: step time with the knob off / with everything on (> 1: the feature pays),
same seed, 3 (quick) / 5 seeds, mean and 95% interval; 2 (quick) / 10 measured steps.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, summarize
from benchmarks.workloads import paper_cluster
from rollart.sim.env import SERVERLESS_REWARD_LATENCY
from rollart.sim.harness import SimDomain, SimScenario, run_simulated

NAME = "ablations"
MODEL = "qwen3-32b"
#: paper §7.8 / notes: env reset success > 99.99% -> 1e-4 failures per env call
ENV_FAILURE = 1e-4
#: dedicated reward GPUs: one per 16 rollout GPUs (1 quick, 6 full). The paper gives no count;
#: the utilisation reported scales inversely with it.
ROLLOUT_GPUS_PER_REWARD_GPU = 16
KNOBS = ("full", "no_affinity", "no_per_turn", "no_redundancy", "dedicated_reward",
         "no_overlap_sync")


def scenario(knob: str, quick: bool) -> SimScenario:
    """The ``modes`` rollart scenario with ``knob`` switched off (``"full"``: none)."""
    base = paper_cluster(MODEL, quick=quick, mode="rollart", steps=3 if quick else 11,
                         affinity=knob != "no_affinity")
    domains = tuple(SimDomain(dataclasses.replace(d.spec, step_failure_prob=ENV_FAILURE),
                              d.pool, d.weight) for d in base.domains)
    return base.replace(
        domains=domains, reward_latency_s=SERVERLESS_REWARD_LATENCY,
        redundancy=0 if knob == "no_redundancy" else 2,
        check="admission" if knob == "no_per_turn" else None,
        reward_gpus=max(1, sum(p.num_gpus for p in base.pools) // ROLLOUT_GPUS_PER_REWARD_GPU)
        if knob == "dedicated_reward" else 0,
        push_at_pause=knob == "no_overlap_sync")


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, samples = [], {}
    for sd in seeds:
        times = {}
        for knob in KNOBS:
            res = run_simulated(scenario(knob, quick), sd)
            times[knob] = res.step_time_s
            wasted = res.buffer["wasted_tokens"]
            rows.append({"knob": knob, "step_time_s": res.step_time_s,
                         "rollout_s": statistics.fmean(s["rollout_time_s"]
                                                       for s in res.steps[1:]),
                         "sync_exposed_s": statistics.fmean(s["weight_sync_exposed_s"]
                                                            for s in res.steps[1:]),
                         "stale_waste_share": wasted.get("stale", 0)
                         / max(1, res.buffer["generated_tokens"]),
                         "reward_gpu_util": res.reward_utilisation,
                         "wall_s": res.wall_s})
        for knob in KNOBS[1:]:
            samples.setdefault(f"{knob} / full (step time)", []).append(
                times[knob] / times["full"])
    ratios, ci = summarize(samples)
    util = [r["reward_gpu_util"] for r in rows if r["knob"] == "dedicated_reward"]
    samples_util = {"dedicated reward GPU utilisation": util}
    u_mean, u_ci = summarize(samples_util)
    ratios.update(u_mean)
    ci.update(u_ci)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("knob",)), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes="ratio > 1: switching the feature off slows the step; paper: reward "
                  "offload about halves rollout time, dedicated reward GPU ~6-7% busy")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
