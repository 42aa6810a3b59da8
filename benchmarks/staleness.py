"""``staleness``: rollart step time for alpha = 1, 2, 4, 6, and the on-policy alpha = 0
(SIMULATED cluster, REAL controller).

rollart mode needs alpha >= 1 (overlap implies one version of lag), so the alpha = 0 row runs
``sync_plus`` (trajectory-level, on-policy, no overlap). Paper Fig. 12/13: at most 1.22x more
step-time gain from alpha 1 to 6. Each ratio: 3 (quick) / 5 seeds, 3 / 10 measured steps; ``--quick`` skips alpha 4.

Rows ``policy = "default"`` run rollart's default staleness policy (``RunConfig``'s, nothing
set); rows ``policy = "lazy"`` run alpha 1 and 6 again with the previous default spelled out
(``staleness_waste.POLICIES["lazy"]``), under which alpha 1 discards held samples on every
version bump, most of what alpha 6 gained there: ``alpha 6 vs alpha 1 (lazy policy)`` says
how much alpha 6 gains with that waste, ``alpha 6 vs alpha 1`` without it.

Every row reports its regime (``benchmarks.modes.regime_of``, over the steps after the first):
``rollout_share`` (the alpha 0 row runs ``sync_plus``, so its share is the paper's Sync+
rollout share; rollart rows overlap rollout with training), ``trainer_idle_share``,
``util_<pool>`` per pool, ``prefix_hit_share``, ``stale_waste_share`` and ``trained_tokens``.
"""

from __future__ import annotations

import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, small, summarize
from benchmarks.modes import regime_of
from benchmarks.staleness_waste import POLICIES
from benchmarks.workloads import paper_cluster
from rollart.sim.harness import run_simulated

NAME = "staleness"
ALPHAS = (0, 1, 2, 4, 6)
QUICK_ALPHAS = (0, 1, 2, 6)  # CI time budget
#: alphas run again with the lazy (previous default) staleness policy
LAZY_POLICY_ALPHAS = (1, 6)


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, times = [], {}
    alphas = QUICK_ALPHAS if quick else ALPHAS
    variants = [(a, "default") for a in alphas] + [(a, "lazy") for a in LAZY_POLICY_ALPHAS]
    for alpha, policy in variants:
        mode = "sync_plus" if alpha == 0 else "rollart"
        for sd in seeds:
            sim = paper_cluster("qwen3-8b", quick=small(quick), mode=mode, alpha=max(alpha, 1),
                                steps=5 if quick else 12).replace(**POLICIES[policy])
            res = run_simulated(sim, sd, warmup=2)
            times.setdefault((alpha, policy), []).append(res.step_time_s)
            rows.append({"alpha": alpha, "policy": policy, "mode": mode,
                         "step_time_s": res.step_time_s,
                         "staleness_max": max(s["staleness_max"] for s in res.steps),
                         "restarted_stale": res.buffer["restarted_stale"],
                         "wasted_tokens": res.buffer["wasted_tokens"].get("stale", 0),
                         **regime_of(sim, res)})
    samples = {f"alpha {a} vs alpha 1": _ratio(times[(1, "default")], times[(a, "default")])
               for a in alphas if a != 1}
    samples["alpha 6 vs alpha 1 (lazy policy)"] = _ratio(times[(1, "lazy")], times[(6, "lazy")])
    samples["alpha 1: default vs lazy policy"] = _ratio(times[(1, "lazy")], times[(1, "default")])
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("alpha", "policy")), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes="paper: at most 1.22x from alpha 1 to 6; model qwen3-8b, step time = "
                  "mean over steps after the first two")


def _ratio(base: list[float], other: list[float]) -> list[float]:
    """Per-seed ``base / other`` step-time ratios (> 1: ``other`` is faster)."""
    return [b / o for b, o in zip(base, other, strict=True)]


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
