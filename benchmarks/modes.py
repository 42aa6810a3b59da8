"""``modes``: step time of sync, sync_plus, one_off, areal, rollart (alpha = 1) for Qwen3-8B /
14B / 32B profiles on a SIMULATED 96 x H800 + 32 x H20 cluster, GRPO batch 512, group 8.

Paper (Qwen3-32B, Fig. 10): rollart 2.05x vs Sync+, 1.35x vs One-off, 1.31x vs AReaL.
The real controller runs every mode on the same workload and seed, side by side; each ratio
over 3 (quick) / 5 seeds, 2 (quick) / 10 measured steps.

``areal`` is AReaL as the paper ran it, as far as rollart's controller can express it: the
staleness check only at admission (its ModeSpec), the buffer bound ``(alpha + 1) x batch``
(AReaL's admission capacity ``min(C - running, (eta + v + 1) B - (accepted + running))`` with
eta = alpha), no hardware affinity (both domains spread over every engine in proportion to
pool size) and interrupt + re-prefill of running requests on each weight update. Not
expressed: AReaL keeps samples that finish stale (rollart's buffer drops them at completion).
"""

from __future__ import annotations

import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, summarize
from benchmarks.workloads import paper_cluster
from rollart.sim.harness import run_simulated

MODES = ("sync", "sync_plus", "one_off", "areal", "rollart")
NAME = "modes"


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, samples = [], {}
    models = ("qwen3-8b", "qwen3-32b") if quick else ("qwen3-8b", "qwen3-14b", "qwen3-32b")
    for model in models:
        for sd in seeds:
            times = {}
            for mode in MODES:
                # AReaL as the paper ran it: no hardware affinity (one homogeneous pool),
                # interrupt + re-prefill of running requests on every weight update.
                areal = mode == "areal"
                res = run_simulated(paper_cluster(model, quick=quick, mode=mode,
                                                  steps=3 if quick else 11,
                                                  affinity=not areal, reprefill=areal), sd)
                times[mode] = res.step_time_s
                rows.append({"model": model, "mode": mode, "step_time_s": res.step_time_s,
                             "trainer_idle_s": _mean(res.steps, "trainer_idle_s"),
                             "staleness_mean": _mean(res.steps, "staleness_mean"),
                             "wall_s": res.wall_s})
            for base in ("sync", "sync_plus", "one_off", "areal"):
                samples.setdefault(f"{model}: rollart vs {base}", []).append(
                    times[base] / times["rollart"])
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("model", "mode")),
                  ratios=ratios, ci95=ci, seeds=seeds, quick=quick, seed=seed,
                  started=started, notes="paper (32B): 2.05x vs sync_plus, 1.35x vs one_off, "
                  "1.31x vs areal; step time = mean over steps after the first")


def _mean(steps: list[dict], key: str) -> float:
    vals = [s[key] for s in steps[1:]]
    return sum(vals) / len(vals)


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
