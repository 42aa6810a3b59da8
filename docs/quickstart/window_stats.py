"""Per-domain reward change of a finished run, with a 95% interval, and flat-group shares by half.

For each task domain in ``RUN_DIR/metrics.jsonl``: the mean batch reward over its first and last
10 steps with samples (the same windows as ``summary.json``'s ``reward_first10_mean`` /
``reward_last10_mean``), the change, and a 95% interval on the change from the 10 per-step means
of each window (normal approximation, 1.96 standard errors, unequal variances); and the share of
its trained groups whose rewards were all equal (``flat_groups_by_domain``) in the run's first and
second half of steps. README "What the quickstart learns" quotes it.

    python docs/quickstart/window_stats.py runs/quickstart
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

WINDOW = 10


def main(run_dir: str) -> None:
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    half = len(rows) // 2
    print(f"{len(rows)} steps")
    for dom in sorted({d for r in rows for d in r["reward_mean_by_domain"]}):
        xs = [r["reward_mean_by_domain"][dom] for r in rows if dom in r["reward_mean_by_domain"]]
        first, last = xs[:WINDOW], xs[-WINDOW:]
        change = statistics.mean(last) - statistics.mean(first)
        ci = 1.96 * (statistics.variance(first) / len(first)
                     + statistics.variance(last) / len(last)) ** 0.5
        shares = []
        for part in (rows[:half], rows[half:]):
            groups = sum(r.get("groups_by_domain", {}).get(dom, 0) for r in part)
            flat = sum(r.get("flat_groups_by_domain", {}).get(dom, 0) for r in part)
            shares.append(f"{flat}/{groups} = {flat / groups:.0%}" if groups else "no groups")
        print(f"{dom}: first {WINDOW} {statistics.mean(first):.3f}, last {WINDOW} "
              f"{statistics.mean(last):.3f}, change {change:+.3f} +- {ci:.3f} (95%); flat groups "
              f"steps 1-{half}: {shares[0]}, steps {half + 1}-{len(rows)}: {shares[1]}")


if __name__ == "__main__":
    main(sys.argv[1])
