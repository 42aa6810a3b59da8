"""Shared plumbing of the benchmarks: arguments, the JSON result, the rich table.

Every benchmark writes ``{"benchmark": NAME, "simulated": bool, "rows": [...],
"ratios": {NAME: value}, "meta": {...}}``; simulated ones say so in the JSON and in the table
title, and ratios are always measured side by side within one run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def parse_args(name: str, description: str, argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description)
    parser.add_argument("--quick", action="store_true", help="smaller workload (CI / nox bench)")
    parser.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    parser.add_argument("--seed", type=int, default=0, help="base seed of the simulation")
    return parser.parse_args(argv)


def result(name: str, *, simulated: bool, rows: list[dict[str, Any]], ratios: dict[str, float],
           quick: bool, seed: int, notes: str = "", started: float | None = None) -> dict[str, Any]:
    return {
        "benchmark": name,
        "simulated": simulated,
        "rows": rows,
        "ratios": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in ratios.items()},
        "meta": {
            "quick": quick,
            "seed": seed,
            "notes": notes,
            "wall_s": round(time.perf_counter() - started, 3) if started else None,
            "python": sys.version.split()[0],
            "machine": platform.machine(),
            "command": " ".join(["python -m", f"benchmarks.{name}", *sys.argv[1:]]),
        },
    }


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def emit(res: dict[str, Any], json_path: Path | None, console: Console | None = None) -> None:
    """Print the rows and ratios as rich tables and write the JSON (if asked)."""
    console = console or Console()
    label = "SIMULATED" if res["simulated"] else "measured"
    rows = res["rows"]
    if rows:
        table = Table(title=f"{res['benchmark']} ({label})")
        columns = list(dict.fromkeys(k for row in rows for k in row))
        for col in columns:
            table.add_column(col)
        for row in rows:
            table.add_row(*(_fmt(row.get(c, "")) for c in columns))
        console.print(table)
    if res["ratios"]:
        ratios = Table(title=f"{res['benchmark']} ratios ({label}, side by side in one run)")
        ratios.add_column("ratio")
        ratios.add_column("value")
        for key, value in res["ratios"].items():
            ratios.add_row(key, _fmt(value))
        console.print(ratios)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=2) + "\n")


def main_for(name: str, description: str, run: Callable[[bool, int], dict[str, Any]],
             argv: list[str] | None = None) -> dict[str, Any]:
    """Parse arguments, call ``run(quick, seed)`` and emit its result."""
    args = parse_args(name, description, argv)
    res = run(args.quick, args.seed)
    emit(res, args.json)
    return res
