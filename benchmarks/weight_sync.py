"""``weight_sync``: total vs exposed weight-transfer time per step for Qwen3-8B/14B/32B
(SIMULATED links and engines, REAL controller protocol).

``naive`` = ``sync_plus``: the push (trainer -> workers over the cross-cluster link, bytes /
0.42 GB/s per engine) and the apply sit on the critical path. ``overlapped`` = ``rollart``: the
push of version v+1 runs in the background during rollout; only what is left of it plus
pause -> apply (host -> device) -> resume is exposed. Values are means over steps after the
first. Paper Table 4: naive 38.6 / 84.1 / 157.0 s, exposed 1.4 / 5.1 / 9.6 s.
"""

from __future__ import annotations

import time

from benchmarks.common import main_for, result
from benchmarks.workloads import paper_cluster
from rollart.sim.harness import run_simulated

NAME = "weight_sync"
PAPER = {"qwen3-8b": (38.6, 1.4), "qwen3-14b": (84.1, 5.1), "qwen3-32b": (157.0, 9.6)}


def _mean(steps: list[dict], key: str) -> float:
    vals = [s[key] for s in steps[1:]]
    return sum(vals) / len(vals)


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    rows, ratios = [], {}
    for model, (paper_naive, paper_exposed) in PAPER.items():
        naive = run_simulated(paper_cluster(model, quick=quick, mode="sync_plus"), seed)
        over = run_simulated(paper_cluster(model, quick=quick, mode="rollart"), seed)
        row = {"model": model,
               "naive_total_s": _mean(naive.steps, "weight_sync_total_s"),
               "naive_exposed_s": _mean(naive.steps, "weight_sync_exposed_s"),
               "overlap_total_s": _mean(over.steps, "weight_sync_total_s"),
               "overlap_exposed_s": _mean(over.steps, "weight_sync_exposed_s"),
               "paper_naive_s": paper_naive, "paper_exposed_s": paper_exposed}
        rows.append(row)
        ratios[f"{model}: naive exposed / overlapped exposed"] = (
            row["naive_exposed_s"] / row["overlap_exposed_s"]
            if row["overlap_exposed_s"] else float("inf"))
    return result(NAME, simulated=True, rows=rows, ratios=ratios, quick=quick, seed=seed,
                  started=started, notes="paper Table 4: 38.6/84.1/157.0 s naive -> "
                  "1.4/5.1/9.6 s exposed")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
