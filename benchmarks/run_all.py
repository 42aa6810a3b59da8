"""Run a set of benchmarks: ``python -m benchmarks.run_all [--set NAME | --only NAME...]
--quick --out DIR``.

Each benchmark runs in its own process and writes ``DIR/NAME.json``; a summary of every ratio
is printed and written to ``DIR/summary.json`` with, per benchmark, its wall seconds, the CPU
seconds (user + system) of its process tree and the 1-minute load average before and after, so
that a time measured on a shared machine can be read against what else ran, and each ratio's
95% interval where the benchmark's JSON has one (``ci95``). On a terminal the summary is a
table; written to a file or pipe (a log, CI) it is one line per figure
(``NAME  FIGURE = VALUE  95% CI [LOW, HIGH]``), never wrapped. Exit status 1 if any benchmark
failed.

Sets (``SETS``; ``--only`` picks any names instead):

- ``paper`` (default; ``nox -s bench``): the benchmarks that compare with the paper's figures
  and tables, simulated (``env_tail`` ... ``pd``), the two cheap measured ones (``rpc_floor``,
  ``token_path``) and ONE real-service proof, ``env_tail-scenario`` (2 cluster starts). With
  ``--quick`` it fits 15 minutes on the 2-core dev machine (benchmarks/README.md, "`nox -s
  bench` wall time").
- ``measured`` (``nox -s bench_measured``): what needs real engines or many cluster starts:
  ``controller_overhead``, ``real_engine``, ``weight_transfer``, ``rpc_overhead`` and the
  other scenario runs.
- ``all``: both.

``SCENARIO_RUNS`` (``NAME-scenario``) run ``modes`` / ``env_tail`` / ``affinity`` on the REAL
services of the small CPU scenario ``scenarios/cpu-two-pools.toml`` (vLLM CPU engine,
tiny model) at the smallest size that gives a ratio: one seed, 2 steps per variant (a warm-up
and one measured step), so they prove the path rather than measure the modes; each variant
starts its own cluster (2 for env_tail, 3 for affinity, 5 for modes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

BENCHMARKS = ("env_tail", "modes", "ablations", "affinity", "plan", "redundancy", "staleness", "staleness_waste",
              "weight_sync", "pd", "controller_overhead", "rpc_floor", "real_engine",
              "weight_transfer", "token_path", "rpc_overhead")
_CPU_SCENARIO = ["--scenario", "scenarios/cpu-two-pools.toml", "--steps", "2"]
#: run name -> (benchmark module, its arguments): real-service runs (module docstring)
SCENARIO_RUNS = {
    "env_tail-scenario": ("env_tail", [*_CPU_SCENARIO, "--stds", "2", "--env-mean-s", "0.5"]),
    "affinity-scenario": ("affinity", [*_CPU_SCENARIO, "--splits", "1"]),
    "modes-scenario": ("modes", _CPU_SCENARIO),
}
#: the one real-service proof in the default set: fewest cluster starts (2) that give a ratio
PROOF_RUN = "env_tail-scenario"
#: measured benchmarks that need real engines or trainers (minutes each): not in ``paper``
MEASURED = ("controller_overhead", "real_engine", "weight_transfer", "rpc_overhead")
_PAPER = tuple(b for b in BENCHMARKS if b not in MEASURED) + (PROOF_RUN,)
#: set name -> benchmark / scenario-run names, in run order (module docstring)
SETS: dict[str, tuple[str, ...]] = {
    "paper": _PAPER,
    "measured": MEASURED + tuple(r for r in SCENARIO_RUNS if r != PROOF_RUN),
    "all": (*BENCHMARKS, *SCENARIO_RUNS),
}
DEFAULT_SET = "paper"


def _child_cpu_s() -> float:
    """User + system CPU seconds of every waited-for child process tree so far."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _load1() -> float:
    return round(os.getloadavg()[0], 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, required=True, help="directory for NAME.json files")
    group = parser.add_mutually_exclusive_group()
    # default None, not DEFAULT_SET: argparse's exclusion check skips a value that is the default
    group.add_argument("--set", choices=sorted(SETS), default=None,
                       help=f"named set (default {DEFAULT_SET}; module docstring)")
    group.add_argument("--only", nargs="+", default=None,
                       help="these benchmark / scenario-run names instead of a set")
    parser.add_argument("--timeout-s", type=float, default=900.0,
                        help="per benchmark; a scenario run (one cluster start per variant, "
                        "minutes each on a loaded 2-core machine) gets 3x")
    args = parser.parse_args(argv)
    known = [*BENCHMARKS, *SCENARIO_RUNS]
    names = args.only or list(SETS[args.set or DEFAULT_SET])
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; known: {known}")
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console()
    summary: dict[str, dict] = {}
    failed = []
    for name in names:
        module, extra = SCENARIO_RUNS.get(name, (name, []))
        if importlib.util.find_spec(f"benchmarks.{module}") is None:
            summary[name] = {"status": "missing"}
            failed.append(name)
            continue
        out = args.out / f"{name}.json"
        cmd = [sys.executable, "-m", f"benchmarks.{module}", *extra, "--json", str(out)]
        if args.quick:
            cmd.append("--quick")
        console.rule(f"benchmarks.{name}")
        t0, cpu0, load0 = time.perf_counter(), _child_cpu_s(), _load1()
        try:
            limit = args.timeout_s * (3 if name in SCENARIO_RUNS else 1)
            proc = subprocess.run(cmd, timeout=limit, check=False)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            status = f"timeout after {limit:.0f} s"
        wall = time.perf_counter() - t0
        # A timed-out child is killed but still waited for by subprocess.run, so its CPU counts.
        entry: dict = {"status": status, "wall_s": round(wall, 1),
                       "cpu_s": round(_child_cpu_s() - cpu0, 1), "load1_before": load0,
                       "load1_after": _load1(), "command": " ".join(cmd[1:])}
        if status == "ok" and out.exists():
            res = json.loads(out.read_text())
            entry.update(simulated=res["simulated"], ratios=res["ratios"],
                         ci95=intervals(res))
        else:
            failed.append(name)
        summary[name] = entry
    if sys.stdout.isatty():
        console.print(summary_table(summary))
    else:
        print("\n".join(summary_lines(summary)), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failed else 0


def intervals(res: dict) -> dict[str, list[float]]:
    """A benchmark result's 95% intervals by ratio name, those it has (one measurement gives
    ``[null, null]``: left out)."""
    return {k: ci for k, ci in (res.get("ci95") or {}).items()
            if isinstance(ci, list) and len(ci) == 2 and None not in ci}


def _ratio_text(key: str, value: object, ci: list[float] | None) -> str:
    text = f"{key} = {value:.3g}" if isinstance(value, float) else f"{key} = {value}"
    return text + (f"  95% CI [{ci[0]:.3g}, {ci[1]:.3g}]" if ci else "")


def _totals(summary: dict[str, dict]) -> tuple[str, str]:
    timed = [e for e in summary.values() if "wall_s" in e]
    return (f"{sum(e['wall_s'] for e in timed):.1f}", f"{sum(e['cpu_s'] for e in timed):.1f}")


def summary_lines(summary: dict[str, dict]) -> list[str]:
    """The summary one figure per line (for a log): per benchmark its status and costs, then
    each ratio with its 95% interval when it has one; then the totals."""
    lines = []
    for name, entry in summary.items():
        head = f"{name}  status = {entry['status']}"
        if "wall_s" in entry:
            head += (f"  wall_s = {entry['wall_s']}  cpu_s = {entry['cpu_s']}  load1 = "
                     f"{entry['load1_before']}-{entry['load1_after']}")
        if "simulated" in entry:
            head += f"  simulated = {entry['simulated']}"
        lines.append(head)
        cis = entry.get("ci95", {})
        lines += [f"{name}  {_ratio_text(k, v, cis.get(k))}"
                  for k, v in entry.get("ratios", {}).items()]
    wall, cpu = _totals(summary)
    lines.append(f"total  wall_s = {wall}  cpu_s = {cpu}")
    return lines


def summary_table(summary: dict[str, dict]) -> Table:
    """The summary as a rich table (for a terminal); ratios with their 95% intervals."""
    table = Table(title="rollart benchmarks")
    for col in ("benchmark", "status", "simulated", "wall_s", "cpu_s", "load", "ratios"):
        table.add_column(col)
    for name, entry in summary.items():
        cis = entry.get("ci95", {})
        ratios = "\n".join(_ratio_text(k, v, cis.get(k))
                           for k, v in entry.get("ratios", {}).items())
        table.add_row(name, entry["status"], str(entry.get("simulated", "")),
                      str(entry.get("wall_s", "")), str(entry.get("cpu_s", "")),
                      f"{entry.get('load1_before', '')}-{entry.get('load1_after', '')}"
                      if "wall_s" in entry else "", ratios)
    table.add_row("total", "", "", *_totals(summary), "", "")
    return table


if __name__ == "__main__":
    sys.exit(main())
