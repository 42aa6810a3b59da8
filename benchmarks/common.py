"""Shared plumbing of the benchmarks: arguments, the JSON result, the rich table.

Every benchmark writes ``{"benchmark": NAME, "simulated": bool, "rows": [...],
"ratios": {NAME: value}, "ci95": {NAME: [low, high]}, "meta": {...}}``; simulated ones say so
in the JSON and in the table title, and ratios are always measured side by side within one run.

A ratio is measured once per seed (both sides of it on that seed: a paired comparison); the
reported value is the mean over seeds and ``ci95`` the Student-t 95% confidence interval of
that mean, ``mean +- t(0.975, n - 1) x sd / sqrt(n)``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

#: Student-t 0.975 quantiles by degrees of freedom (any statistics table, e.g. NIST/SEMATECH
#: e-Handbook of Statistical Methods, §1.3.6.7.2); larger df use the nearest smaller entry.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}

#: seeds per ratio: the issue asks for >= 3; quick runs use exactly 3
QUICK_SEEDS = 3
FULL_SEEDS = 5


@dataclass
class Size:
    """What ``parse_args`` read besides ``--quick``. ``reduced``: the benchmark's full-size
    steps (>= 10 measured) on its ``--quick`` cluster (an eighth of the paper's) with
    ``QUICK_SEEDS`` seeds, for machines where the whole cluster takes hours; ``seeds``: number
    of seeds (None: the size's default); ``models``: the model profiles a benchmark that runs
    several (``modes``, ``weight_sync``) runs (None: its default)."""

    reduced: bool = False
    seeds: int | None = None
    models: tuple[str, ...] | None = None


#: the current process's ``Size`` (set by ``parse_args``; defaults when called directly)
SIZE = Size()


def small(quick: bool) -> bool:
    """Whether to build the small (``--quick``) cluster: with ``--quick`` or ``--reduced``."""
    return quick or SIZE.reduced


def seeds_for(quick: bool, base: int) -> list[int]:
    """The seeds a benchmark runs: ``base``, ``base + 1``, ... (``--seeds`` of them, else 3 with
    ``--quick`` / ``--reduced``, else 5)."""
    n = SIZE.seeds or (QUICK_SEEDS if small(quick) else FULL_SEEDS)
    return [base + i for i in range(n)]


def t975(df: int) -> float:
    """Student-t 0.975 quantile for ``df`` >= 1 degrees of freedom (table; conservative)."""
    if df < 1:
        raise ValueError(f"need df >= 1, got {df}")
    return _T975[max(k for k in _T975 if k <= df)]


def ci95(values: list[float]) -> tuple[float, list[float]]:
    """(mean, [low, high]) of ``values`` (one per seed). One value gives [nan, nan]."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("ci95 of no values")
    mean = statistics.fmean(vals)
    if len(vals) < 2 or any(math.isnan(v) or math.isinf(v) for v in vals):
        return mean, [math.nan, math.nan]
    half = t975(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
    return mean, [mean - half, mean + half]


def summarize(samples: dict[str, list[float]]) -> tuple[dict[str, float], dict[str, list]]:
    """Per-seed ratio samples -> (``ratios`` of means, ``ci95`` of [low, high] pairs)."""
    ratios, intervals = {}, {}
    for key, vals in samples.items():
        ratios[key], intervals[key] = ci95(vals)
    return ratios, intervals


def mean_rows(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Average per-seed rows that agree on ``keys`` (numbers averaged, the rest kept; a
    ``seeds`` column counts them), in first-seen order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    out = []
    for group in groups.values():
        merged: dict[str, Any] = {}
        for col in group[0]:
            vals = [r[col] for r in group]
            if col not in keys and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                       for v in vals):
                merged[col] = statistics.fmean(vals)
            else:
                merged[col] = vals[0]
        merged["seeds"] = len(group)
        out.append(merged)
    return out


#: which benchmarks use each size option (any other benchmark refuses the option rather than
#: ignoring it and recording it in its JSON's meta)
USES_MODELS = frozenset({"modes", "weight_sync"})
USES_REDUCED = frozenset({"ablations", "affinity", "env_tail", "modes", "redundancy",
                          "staleness", "weight_sync"})
USES_SEEDS = USES_REDUCED | {"pd", "staleness_waste"}


def parse_args(name: str, description: str, argv: list[str] | None = None, *,
               baseline: str | None = None,
               parents: list[argparse.ArgumentParser] | None = None) -> argparse.Namespace:
    """The common options; ``baseline`` (a git ref) adds ``--baseline REF`` with that default,
    for a benchmark that measures old code from git (``benchmarks.gitbaseline``); ``parents``:
    parsers (``add_help=False``) of a benchmark's own options, so ``--help`` lists them."""
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=description,
                                     parents=parents or [])
    if baseline is not None:
        parser.add_argument("--baseline", default=baseline, metavar="REF",
                            help=f"git ref of the old code measured as the baseline (default "
                                 f"{baseline}); skipped with a note when git or the ref is "
                                 f"missing")
    parser.add_argument("--quick", action="store_true", help="smaller workload (CI / nox bench)")
    parser.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    parser.add_argument("--seed", type=int, default=0, help="base seed of the simulation")
    parser.add_argument("--reduced", action="store_true",
                        help="full-size steps on the --quick cluster, 3 seeds (see common.Size)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (>= 2 for "
                        "an interval; default 3 with --quick / --reduced, else 5)")
    parser.add_argument("--models", nargs="+", default=None,
                        choices=("qwen3-8b", "qwen3-14b", "qwen3-32b"),
                        help="model profiles (modes, weight_sync; default: the size's)")
    args = parser.parse_args(argv)
    if args.quick and args.reduced:
        parser.error("--quick and --reduced exclude each other")
    if args.seeds is not None and args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    for option, given, users in (("--models", args.models, USES_MODELS),
                                 ("--reduced", args.reduced, USES_REDUCED),
                                 ("--seeds", args.seeds is not None, USES_SEEDS)):
        if given and name not in users:
            parser.error(f"{name} has no {option} (used by {', '.join(sorted(users))})")
    SIZE.reduced, SIZE.seeds = args.reduced, args.seeds
    SIZE.models = tuple(args.models) if args.models else None
    return args


def _round(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) else (str(v) if math.isinf(v) else round(v, 4))
    return v


def result(name: str, *, simulated: bool, rows: list[dict[str, Any]], ratios: dict[str, float],
           quick: bool, seed: int, notes: str = "", started: float | None = None,
           ci95: dict[str, list[float]] | None = None,
           seeds: list[int] | None = None) -> dict[str, Any]:
    """The benchmark's JSON object. ``ci95`` maps ratio names to [low, high] (``summarize``);
    a ratio without one gets [null, null] (a single measurement)."""
    intervals = ci95 or {}
    return {
        "benchmark": name,
        "simulated": simulated,
        "rows": rows,
        "ratios": {k: _round(v) for k, v in ratios.items()},
        "ci95": {k: [_round(x) for x in intervals.get(k, [math.nan, math.nan])]
                 for k in ratios},
        "meta": {
            "seeds": seeds if seeds is not None else [seed],
            "quick": quick,
            "reduced": SIZE.reduced,
            "models": list(SIZE.models) if SIZE.models else None,
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
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"  # e.g. a ci95 interval
    return str(value)


#: rows tables with more columns than this print transposed (one line per figure)
TRANSPOSE_ABOVE_COLUMNS = 12


def _row_label(row: dict[str, Any], i: int) -> str:
    """A transposed table's column header: the row's size or name keys, else its index."""
    keys = [k for k in ("n", "name", "mode", "size", "context_tokens") if k in row]
    return ", ".join(f"{k}={_fmt(row[k])}" for k in keys[:2]) or f"row {i}"


def emit(res: dict[str, Any], json_path: Path | None, console: Console | None = None) -> None:
    """Print the rows and ratios as rich tables and write the JSON (if asked)."""
    console = console or Console()
    label = "SIMULATED" if res["simulated"] else "measured"
    rows = res["rows"]
    if rows:
        table = Table(title=f"{res['benchmark']} ({label})")
        columns = list(dict.fromkeys(k for row in rows for k in row))
        if len(columns) > TRANSPOSE_ABOVE_COLUMNS:
            # Many figures, few rows: one line per figure, one column per row (rich would
            # squeeze 40 columns into an 80-character non-terminal output, one letter wide).
            table.add_column("figure")
            for i, row in enumerate(rows):
                table.add_column(_row_label(row, i))
            for col in columns:
                table.add_row(col, *(_fmt(row.get(col, "")) for row in rows))
        else:
            for col in columns:
                table.add_column(col)
            for row in rows:
                table.add_row(*(_fmt(row.get(c, "")) for c in columns))
        console.print(table)
    if res["ratios"]:
        seeds = res["meta"].get("seeds") or [res["meta"].get("seed")]
        ratios = Table(title=f"{res['benchmark']} ratios ({label}, side by side in one run, "
                             f"mean of {len(seeds)} seed(s))")
        ratios.add_column("ratio")
        ratios.add_column("mean")
        ratios.add_column("95% CI")
        for key, value in res["ratios"].items():
            low, high = res.get("ci95", {}).get(key, [None, None])
            ci = f"[{_fmt(low)}, {_fmt(high)}]" if low is not None else "-"
            ratios.add_row(key, _fmt(value), ci)
        console.print(ratios)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=2) + "\n")


def main_for(name: str, description: str, run: Callable[[bool, int], dict[str, Any]],
             argv: list[str] | None = None, *,
             parents: list[argparse.ArgumentParser] | None = None) -> dict[str, Any]:
    """Parse arguments (the common ones and ``parents``', see `parse_args`), call
    ``run(quick, seed)`` and emit its result."""
    args = parse_args(name, description, argv, parents=parents)
    res = run(args.quick, args.seed)
    emit(res, args.json)
    return res
