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

The per-turn check only matters when a *running* trajectory outlives the bound (rows:
``restarted_stale``); in the ``paper`` workload (8-turn agentic trajectories, ~3 s env steps)
none does, so ``no_per_turn`` is also run on ``long_horizon``: the agentic domain with 30 turns
(the paper's agentic tasks run 20-50 turns, §7) and 500-token observations (so that prompt +
30 turns stay within the 32k context).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, small, summarize
from benchmarks.workloads import paper_cluster
from rollart.sim.env import SERVERLESS_REWARD_LATENCY
from rollart.sim.harness import SimDomain, SimScenario, run_simulated
from rollart.sim.workload import Dist, const

NAME = "ablations"
MODEL = "qwen3-32b"
#: paper §7.8 / notes: env reset success > 99.99% -> 1e-4 failures per env call
ENV_FAILURE = 1e-4
#: dedicated reward GPUs: one per 16 rollout GPUs (1 quick, 6 full). The paper gives no count;
#: the utilisation reported scales inversely with it.
ROLLOUT_GPUS_PER_REWARD_GPU = 16
WORKLOADS = ("paper", "long_horizon")
KNOBS = ("full", "no_affinity", "no_per_turn", "no_redundancy", "dedicated_reward",
         "no_overlap_sync")


def scenario(knob: str, quick: bool, workload: str = "paper") -> SimScenario:
    """The ``modes`` rollart scenario with ``knob`` switched off (``"full"``: none);
    ``workload="long_horizon"``: 30-turn agentic trajectories (module docstring)."""
    base = paper_cluster(MODEL, quick=small(quick), mode="rollart", steps=3 if quick else 11,
                         affinity=knob != "no_affinity")
    long = {"num_turns": Dist("uniform", 30, 7.5, 1, 1e9), "obs_tokens": const(500)}
    domains = tuple(SimDomain(dataclasses.replace(
        d.spec, step_failure_prob=ENV_FAILURE,
        **(long if workload == "long_horizon" and d.spec.name.startswith("agentic") else {})),
        d.pool, d.weight) for d in base.domains)
    return base.replace(
        domains=domains, reward_latency_s=SERVERLESS_REWARD_LATENCY,
        max_turns=40 if workload == "long_horizon" else base.max_turns,
        redundancy=0 if knob == "no_redundancy" else 2,
        check="admission" if knob == "no_per_turn" else None,
        reward_gpus=max(1, sum(p.num_gpus for p in base.pools) // ROLLOUT_GPUS_PER_REWARD_GPU)
        if knob == "dedicated_reward" else 0,
        push_at_pause=knob == "no_overlap_sync")


def run(quick: bool, seed: int, workloads: tuple[str, ...] | None = None) -> dict:
    """``workloads``: ``paper`` (every knob) and/or ``long_horizon`` (``full`` and
    ``no_per_turn``); default both at full size, ``paper`` only with ``quick`` (the 30-turn
    runs cost ~2.5 min more on 2 cores: ``--workloads paper long_horizon`` adds them)."""
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, samples = [], {}
    if workloads is None:
        workloads = ("paper",) if quick else WORKLOADS
    runs = ([("paper", k) for k in KNOBS] if "paper" in workloads else []) + (
        [("long_horizon", "full"), ("long_horizon", "no_per_turn")]
        if "long_horizon" in workloads else [])
    for sd in seeds:
        times = {}
        for workload, knob in runs:
            res = run_simulated(scenario(knob, quick, workload), sd)
            times[workload, knob] = res.step_time_s
            wasted = res.buffer["wasted_tokens"]
            rows.append({"workload": workload, "knob": knob, "step_time_s": res.step_time_s,
                         "rollout_s": statistics.fmean(s["rollout_time_s"]
                                                       for s in res.steps[1:]),
                         "sync_exposed_s": statistics.fmean(s["weight_sync_exposed_s"]
                                                            for s in res.steps[1:]),
                         "stale_waste_share": wasted.get("stale", 0)
                         / max(1, res.buffer["generated_tokens"]),
                         "restarted_stale": res.buffer["restarted_stale"],
                         "reward_gpu_util": res.reward_utilisation,
                         # utilisation = calls/s x GPU s per call / reward GPUs
                         "reward_calls_per_s": res.reward_calls / res.total_time_s,
                         "reward_gpu_s_per_call": res.reward_busy_s / max(1, res.reward_calls),
                         "reward_gpus": scenario(knob, quick, workload).reward_gpus,
                         "wall_s": res.wall_s})
        for workload, knob in runs:
            if knob != "full":
                samples.setdefault(f"{workload}: {knob} / full (step time)", []).append(
                    times[workload, knob] / times[workload, "full"])
    ratios, ci = summarize(samples)
    util = [r["reward_gpu_util"] for r in rows if r["knob"] == "dedicated_reward"]
    if util:
        u_mean, u_ci = summarize({"dedicated reward GPU utilisation": util})
        ratios.update(u_mean)
        ci.update(u_ci)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("workload", "knob")), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes="ratio > 1: switching the feature off slows the step; paper: reward "
                  "offload about halves rollout time, dedicated reward GPU ~6-7% busy")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=None,
                        help="workloads to run (default: paper with --quick, else all; "
                             "long_horizon adds ~2.5 min on 2 cores)")
    known, _ = parser.parse_known_args(argv)
    wl = tuple(known.workloads) if known.workloads else None
    return main_for(NAME, __doc__ or "", functools.partial(run, workloads=wl), argv,
                    parents=[parser])


if __name__ == "__main__":
    main()
