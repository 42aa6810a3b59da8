"""Render benchmark JSON files as the markdown results table of ``benchmarks/README.md``.

    python -m benchmarks.report DIR   # DIR holds NAME.json files (``run_all --out DIR``)

One row per ratio of every benchmark ``run_all`` knows (``run_all.BENCHMARKS`` and its
scenario runs); a benchmark without a JSON file in DIR gets a "(not run)" row. Exits with
status 2 if DIR is not a directory or holds no benchmark JSON at all.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.run_all import BENCHMARKS, SCENARIO_RUNS

#: what the paper reports for each benchmark (RollArt, arXiv 2512.22560)
PAPER = {
    "env_tail": "1.23x (std 1 s) -> 2.27x (std 10 s), Fig. 11b",
    "modes": "32B: 2.05x vs Sync+, 1.35x vs One-off, 1.31x vs AReaL, Fig. 10",
    "affinity": "1.30-1.68x vs H20-only, 1.12-1.37x vs H800-only, Fig. 11a",
    "redundancy": "collection up to 1.62x faster, §6.1",
    "staleness": "at most 1.22x from alpha 1 to 6, Fig. 12",
    "staleness_waste": "(not reported; the default policy's goals: stale <= 0.05, long share "
                       ">= 0.90, length bias <= 0.03, step time vs lazy <= 1)",
    "weight_sync": "naive 38.6/84.1/157.0 s -> exposed 1.4/5.1/9.6 s, Table 4",
    "pd": "32B 1.03-1.05x, 30B-A3B 1.11-1.21x, Table 5",
    "ablations": "reward offload: rollout time about halved, reward GPU 6-7% busy (§3, §7.5)",
}


def _fmt(v: object) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def render(directory: Path) -> str:
    lines = ["| benchmark | simulated | ratio | value | 95% CI | paper |",
             "|---|---|---|---|---|---|"]
    for name in [*BENCHMARKS, *SCENARIO_RUNS]:
        paper = PAPER.get(name.removesuffix("-scenario"), "(not reported)")
        path = directory / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name} | | (not run) | | | {paper} |")
            continue
        res = json.loads(path.read_text())
        first = True
        intervals = res.get("ci95", {})
        for key, value in res["ratios"].items():
            low, high = intervals.get(key, [None, None])
            ci = f"[{_fmt(low)}, {_fmt(high)}]" if low is not None else ""
            lines.append(f"| {name if first else ''} | {res['simulated'] if first else ''} | "
                         f"{key} | {_fmt(value)} | {ci} | {paper if first else ''} |")
            first = False
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report",
                                     description="markdown table of every ratio in DIR")
    parser.add_argument("directory", type=Path, nargs="?", default=Path("runs/bench"),
                        help="where run_all wrote NAME.json (default runs/bench)")
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a directory")
    known = {*BENCHMARKS, *SCENARIO_RUNS}
    if not any(p.stem in known for p in args.directory.glob("*.json")):
        parser.error(f"{args.directory} holds no benchmark JSON (run benchmarks.run_all "
                     f"--out {args.directory} first)")
    table = render(args.directory)
    print(table)
    return table


if __name__ == "__main__":
    main()
