"""``weight_sync``: total vs exposed weight-sync seconds per step for Qwen3-8B/14B/32B
(SIMULATED links and engines, REAL controller protocol), on the paper's cluster (§7).

How rollart syncs (paper §6.3): after each training step the trainer streams the new version in
~1 GB buckets over the cross-cluster link (200 Gb Ethernet, §7.1) into every inference
worker's host memory while rollout continues; at the next pause each worker only applies it
(host-to-device copy of its TP shard + reload). ``rollart`` runs exactly that: the push
overlaps rollout, and only what is left of it at the pause plus the apply is exposed.
``naive`` (``sync_plus``): the push starts after training and the step waits for it and the
apply (blocking). The trainer's pushes share its nodes' NICs (``ceil(trainer_gpus / 8)`` x
25 GB/s) across every engine's pull; nothing is backed out of the paper's Table 4.

Per model: ``push_s`` (one push, all engines), ``total_s`` (push + pause/apply/resume of the
version a step applies) and ``exposed_s`` (what the training loop waited for), means over steps
after the first and over 3 (quick) / 5 seeds. Paper Table 4: naive 38.6 / 84.1 / 157.0 s,
exposed 1.4 / 5.1 / 9.6 s.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.common import main_for, mean_rows, result, seeds_for, summarize
from benchmarks.workloads import paper_cluster
from rollart.sim.harness import run_simulated

NAME = "weight_sync"
PAPER = {"qwen3-8b": (38.6, 1.4), "qwen3-14b": (84.1, 5.1), "qwen3-32b": (157.0, 9.6)}


def _mean(steps: list[dict], key: str) -> float:
    return statistics.fmean(s[key] for s in steps[1:])


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, samples = [], {}
    for model, (paper_naive, paper_exposed) in PAPER.items():
        for sd in seeds:
            naive = run_simulated(paper_cluster(model, quick=quick, mode="sync_plus",
                                                steps=3 if quick else None), sd)
            over = run_simulated(paper_cluster(model, quick=quick, mode="rollart",
                                               steps=3 if quick else None), sd)
            row = {"model": model,
                   "push_s": statistics.fmean(over.push_times_s),
                   "naive_total_s": _mean(naive.steps, "weight_sync_total_s"),
                   "naive_exposed_s": _mean(naive.steps, "weight_sync_exposed_s"),
                   "rollart_total_s": _mean(over.steps, "weight_sync_total_s"),
                   "rollart_exposed_s": _mean(over.steps, "weight_sync_exposed_s"),
                   "paper_naive_s": paper_naive, "paper_exposed_s": paper_exposed}
            rows.append(row)
            samples.setdefault(f"{model}: naive exposed / rollart exposed", []).append(
                row["naive_exposed_s"] / row["rollart_exposed_s"]
                if row["rollart_exposed_s"] else float("inf"))
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("model",)), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes="paper Table 4: 38.6/84.1/157.0 s naive -> 1.4/5.1/9.6 s exposed; "
                  "link = 200 Gb Ethernet, trainer egress shared by every engine")


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
