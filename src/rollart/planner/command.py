"""``rollart plan SCENARIO --out PLAN.toml [--budget-s S] [--model PROFILE] [--seeds N]``.

Searches the scenario's layout with the simulator (``rollart.planner``), prints the best
candidates (SIMULATED step time, rollout share of a step, cost in H800 units) and writes the
chosen layout as a scenario file. Exit codes: 0 written; 2 a scenario or request the planner
refuses (one line ``rollart plan: error: ...`` naming what is short or unknown).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollart.transport.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    from rollart.planner import DEFAULT_BUDGET_S, PlanError, plan

    p = argparse.ArgumentParser(prog="rollart plan", description=(__doc__ or "").split("\n\n")[1])
    p.add_argument("scenario", type=Path, help="scenario TOML file")
    p.add_argument("--out", type=Path, required=True, help="where to write the planned scenario")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"wall seconds the search may take (default {DEFAULT_BUDGET_S:g})")
    p.add_argument("--model", default=None,
                   help="simulated model profile (default: from model.path, e.g. qwen3-8b)")
    p.add_argument("--seeds", type=int, default=2,
                   help="simulation seeds of the last rung (default 2)")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error(f"--seeds must be >= 1, got {args.seeds}")
    try:
        res = plan(args.scenario, budget_s=args.budget_s, model=args.model,
                   seeds=tuple(range(args.seeds)),
                   progress=lambda line: print(f"rollart plan: {line}", file=sys.stderr))
    except (PlanError, ConfigError) as exc:
        print(f"rollart plan: error: {exc}", file=sys.stderr)
        return 2
    print(res.table())
    res.write(args.out)
    print(f"rollart plan: wrote {args.out}: {res.best.candidate.describe(res.inputs)}",
          file=sys.stderr)
    return 0
