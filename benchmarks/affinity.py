"""``affinity``: equal-cost rollout pools on a prefill-heavy + decode-heavy task mix
(SIMULATED GPUs, REAL controller and LLM proxy, rollart mode).

Pools of equal cost (H20 = 1/3 H800, from the paper's own equal-cost pools): 216 x H20 only,
72 x H800 only, and 64 x H800 + 24 x H20 with affinity (prefill-heavy agentic domain -> H800,
decode-heavy reasoning domain -> H20). ``--quick`` uses an eighth. Paper Fig. 11a: affinity
1.30-1.68x vs H20-only, 1.12-1.37x vs H800-only.
"""

from __future__ import annotations

import time

from benchmarks.common import main_for, result
from benchmarks.workloads import agentic, reasoning
from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated

NAME = "affinity"


def scenario(layout: str, quick: bool) -> SimScenario:
    scale = 8 if quick else 1
    n = {"h20_only": {"h20": 216}, "h800_only": {"h800": 72},
         "mixed_affinity": {"h800": 64, "h20": 24}}[layout]
    pools = tuple(SimPool(hw, hw, max(1, count // scale), max_batch=128)
                  for hw, count in n.items())
    pre, dec = agentic(latency_mean_s=1.0, latency_std_s=1.0), reasoning()
    if layout == "mixed_affinity":
        domains = (SimDomain(pre, "h800"), SimDomain(dec, "h20"))
    else:
        only = pools[0].name
        domains = (SimDomain(pre, only), SimDomain(dec, only))
    return SimScenario(pools=pools, domains=domains, model="qwen3-8b", mode="rollart",
                       steps=4 if quick else 6, batch_size=512 // scale, group_size=8,
                       trainer_gpus=32 // scale, max_tokens_per_turn=16384,
                       max_tokens_per_trajectory=32768)


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    rows, times = [], {}
    for layout in ("h20_only", "h800_only", "mixed_affinity"):
        sim = scenario(layout, quick)
        res = run_simulated(sim, seed)
        times[layout] = res.step_time_s
        busy = [w["busy_s"] / res.total_time_s for w in res.workers.values()]
        rows.append({"layout": layout,
                     "pools": " + ".join(f"{p.num_workers}x{p.hardware}" for p in sim.pools),
                     "cost_h800_units": sum(p.num_workers * (1 / 3 if p.hardware == "h20" else 1)
                                            for p in sim.pools),
                     "step_time_s": res.step_time_s,
                     "mean_engine_busy": sum(busy) / len(busy)})
    ratios = {"affinity vs h20_only": times["h20_only"] / times["mixed_affinity"],
              "affinity vs h800_only": times["h800_only"] / times["mixed_affinity"]}
    return result(NAME, simulated=True, rows=rows, ratios=ratios, quick=quick, seed=seed,
                  started=started, notes="paper: 1.30-1.68x vs H20-only, 1.12-1.37x vs "
                  "H800-only (Fig. 11a)")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
