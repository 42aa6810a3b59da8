"""``staleness``: rollart step time for alpha = 1, 2, 4, 6, and the on-policy alpha = 0
(SIMULATED cluster, REAL controller).

rollart mode needs alpha >= 1 (overlap implies one version of lag), so the alpha = 0 row runs
``sync_plus`` (trajectory-level, on-policy, no overlap). Paper Fig. 12/13: at most 1.22x more
step-time gain from alpha 1 to 6.
"""

from __future__ import annotations

import time

from benchmarks.common import main_for, result
from benchmarks.workloads import paper_cluster
from rollart.sim.harness import run_simulated

NAME = "staleness"
ALPHAS = (0, 1, 2, 4, 6)


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    rows, times = [], {}
    for alpha in ALPHAS:
        mode = "sync_plus" if alpha == 0 else "rollart"
        sim = paper_cluster("qwen3-8b", quick=quick, mode=mode, alpha=max(alpha, 1),
                            steps=6 if quick else 10)
        res = run_simulated(sim, seed, warmup=2)
        times[alpha] = res.step_time_s
        rows.append({"alpha": alpha, "mode": mode, "step_time_s": res.step_time_s,
                     "staleness_max": max(s["staleness_max"] for s in res.steps),
                     "restarted_stale": res.buffer["restarted_stale"],
                     "wasted_tokens": res.buffer["wasted_tokens"].get("stale", 0)})
    ratios = {f"alpha {a} vs alpha 1": times[1] / times[a] for a in ALPHAS if a != 1}
    return result(NAME, simulated=True, rows=rows, ratios=ratios, quick=quick, seed=seed,
                  started=started, notes="paper: at most 1.22x from alpha 1 to 6; model "
                  "qwen3-8b, step time = mean over steps after the first two")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
