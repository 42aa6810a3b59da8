"""Run every benchmark (``nox -s bench`` calls ``python -m benchmarks.run_all --quick --out DIR``).

Each benchmark runs in its own process and writes ``DIR/NAME.json``; a summary of every ratio
is printed and written to ``DIR/summary.json``. Exit status 1 if any benchmark failed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

BENCHMARKS = ("env_tail", "modes", "ablations", "affinity", "redundancy", "staleness", "staleness_waste",
              "weight_sync", "pd", "controller_overhead", "rpc_floor", "real_engine",
              "weight_transfer", "token_path")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="directory for NAME.json files")
    parser.add_argument("--only", nargs="*", default=None, help="subset of benchmark names")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per benchmark")
    args = parser.parse_args(argv)
    names = args.only or list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; known: {list(BENCHMARKS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console()
    summary: dict[str, dict] = {}
    failed = []
    for name in names:
        if importlib.util.find_spec(f"benchmarks.{name}") is None:
            summary[name] = {"status": "missing"}
            failed.append(name)
            continue
        out = args.out / f"{name}.json"
        cmd = [sys.executable, "-m", f"benchmarks.{name}", "--json", str(out)]
        if args.quick:
            cmd.append("--quick")
        console.rule(f"benchmarks.{name}")
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=args.timeout_s, check=False)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timeout after {args.timeout_s:.0f} s"
        wall = time.perf_counter() - t0
        entry: dict = {"status": status, "wall_s": round(wall, 1), "command": " ".join(cmd[1:])}
        if status == "ok" and out.exists():
            res = json.loads(out.read_text())
            entry.update(simulated=res["simulated"], ratios=res["ratios"])
        else:
            failed.append(name)
        summary[name] = entry
    table = Table(title="rollart benchmarks")
    for col in ("benchmark", "status", "simulated", "wall_s", "ratios"):
        table.add_column(col)
    for name, entry in summary.items():
        ratios = "\n".join(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}"
                           for k, v in entry.get("ratios", {}).items())
        table.add_row(name, entry["status"], str(entry.get("simulated", "")),
                      str(entry.get("wall_s", "")), ratios)
    console.print(table)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
