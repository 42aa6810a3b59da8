"""``staleness``: rollart step time for alpha = 1, 2, 4, 6, and the on-policy alpha = 0
(SIMULATED cluster, REAL controller).

rollart mode needs alpha >= 1 (overlap implies one version of lag), so the alpha = 0 row runs
``sync_plus`` (trajectory-level, on-policy, no overlap). Paper Fig. 12/13: at most 1.22x more
step-time gain from alpha 1 to 6. Each ratio: 3 (quick) / 5 seeds, 3 / 10 measured steps; ``--quick`` skips alpha 4.
"""

from __future__ import annotations

import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, small, summarize
from benchmarks.workloads import paper_cluster
from rollart.sim.harness import run_simulated

NAME = "staleness"
ALPHAS = (0, 1, 2, 4, 6)
QUICK_ALPHAS = (0, 1, 2, 6)  # CI time budget


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, times = [], {}
    alphas = QUICK_ALPHAS if quick else ALPHAS
    for alpha in alphas:
        mode = "sync_plus" if alpha == 0 else "rollart"
        for sd in seeds:
            sim = paper_cluster("qwen3-8b", quick=small(quick), mode=mode, alpha=max(alpha, 1),
                                steps=5 if quick else 12)
            res = run_simulated(sim, sd, warmup=2)
            times.setdefault(alpha, []).append(res.step_time_s)
            rows.append({"alpha": alpha, "mode": mode, "step_time_s": res.step_time_s,
                         "staleness_max": max(s["staleness_max"] for s in res.steps),
                         "restarted_stale": res.buffer["restarted_stale"],
                         "wasted_tokens": res.buffer["wasted_tokens"].get("stale", 0)})
    samples = {f"alpha {a} vs alpha 1": [one / t for one, t in zip(times[1], times[a],
                                                                   strict=True)]
               for a in alphas if a != 1}
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("alpha",)), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes="paper: at most 1.22x from alpha 1 to 6; model qwen3-8b, step time = "
                  "mean over steps after the first two")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
