"""``affinity``: a sweep of equal-cost H800:H20 rollout pools on a prefill-heavy + decode-heavy
task mix (SIMULATED GPUs, REAL controller and LLM proxy, rollart mode).

Budget 72 H800 units (H20 = 1/3 H800, from the paper's own equal-cost pools: 64 H800 + 24 H20
= 72 H800); ``--quick`` uses an eighth (9 units). Every split ``h800 + 3 x (budget - h800)``
H20 is run (full size: every 8 H800; ``--quick``: 6 and 4 of 9, to stay within the CI time
budget): the two homogeneous ends (``h800_only``, ``h20_only``: both domains on the one
pool) and mixed splits with affinity (prefill-heavy agentic domain -> H800, decode-heavy
reasoning domain -> H20; 50/50 domain mix). The paper's 64:24 split is one of them at full
size. Ratios are step-time ratios on the same seed; the best mixed split is the one with the
lowest mean step time over seeds (a max over splits, so slightly optimistic), compared with the
homogeneous layouts. Paper Fig. 11a: affinity 1.30-1.68x vs H20-only, 1.12-1.37x vs H800-only.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, summarize
from benchmarks.workloads import agentic, reasoning
from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated

NAME = "affinity"
#: H800 counts of the mixed splits at full size (budget 72); quick divides by 8
FULL_SPLITS = (64, 56, 48, 40, 32, 24, 16, 8)
QUICK_SPLITS = (6, 4)


def scenario(h800: int, h20: int, quick: bool) -> SimScenario:
    pools = tuple(SimPool(hw, hw, n, max_batch=128) for hw, n in (("h800", h800), ("h20", h20))
                  if n)
    pre, dec = agentic(latency_mean_s=1.0, latency_std_s=1.0), reasoning()
    if h800 and h20:
        domains = (SimDomain(pre, "h800"), SimDomain(dec, "h20"))
    else:
        only = pools[0].name
        domains = (SimDomain(pre, only), SimDomain(dec, only))
    scale = 8 if quick else 1
    return SimScenario(pools=pools, domains=domains, model="qwen3-8b", mode="rollart",
                       steps=3 if quick else 6, batch_size=512 // scale, group_size=8,
                       trainer_gpus=32 // scale, max_tokens_per_turn=16384,
                       max_tokens_per_trajectory=32768)


def layouts(quick: bool) -> dict[str, tuple[int, int]]:
    budget = 9 if quick else 72
    out = {"h800_only": (budget, 0), "h20_only": (0, 3 * budget)}
    for h800 in QUICK_SPLITS if quick else FULL_SPLITS:
        out[f"{h800}xh800+{3 * (budget - h800)}xh20"] = (h800, 3 * (budget - h800))
    return out


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, times = [], {}
    for layout, (h800, h20) in layouts(quick).items():
        for sd in seeds:
            res = run_simulated(scenario(h800, h20, quick), sd)
            times.setdefault(layout, []).append(res.step_time_s)
            busy = [w["busy_s"] / res.total_time_s for w in res.workers.values()]
            prefill = sum(w["prefill_tokens"] for w in res.workers.values())
            hits = sum(w["prefix_hit_tokens"] for w in res.workers.values())
            rows.append({"layout": layout, "h800": h800, "h20": h20,
                         "cost_h800_units": h800 + h20 / 3, "step_time_s": res.step_time_s,
                         "rollout_time_s": statistics.fmean(s["rollout_time_s"]
                                                            for s in res.steps[1:]),
                         "mean_engine_busy": statistics.fmean(busy),
                         "prefix_hit_share": hits / (hits + prefill) if hits + prefill else 0.0})
    mixed = [k for k in times if k not in ("h800_only", "h20_only")]
    best = min(mixed, key=lambda k: statistics.fmean(times[k]))
    samples = {
        f"best mixed vs best {base}": [b / m for b, m in zip(times[base], times[best],
                                                             strict=True)]
        for base in ("h20_only", "h800_only")}
    for k in mixed:
        samples[f"{k} vs h20_only"] = [b / m for b, m in zip(times["h20_only"], times[k],
                                                             strict=True)]
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("layout",)), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes=f"best mixed split: {best}; paper: 1.30-1.68x vs H20-only, "
                  "1.12-1.37x vs H800-only (Fig. 11a)")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
