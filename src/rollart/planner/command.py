"""``rollart plan SCENARIO --out PLAN.toml [--budget-s S] [--max-runs N] [--model PROFILE]
[--seeds N] [--profiles-from RUN_DIR] [--static-affinity] [--force]``.

Searches the scenario's layout with the simulator (``rollart.planner``), prints the best
candidates (SIMULATED step time and its standard error, the share of the GPUs rolling out,
the trainer's idle share of a step, cost in H800 units) and writes the chosen layout as a
scenario file. Where the scenario has ``[run.adaptive_affinity]`` off, the last round also runs
the best layout, and the best with a larger trainer, with it on, and the plan turns it on when
such a variant ranks first (``--static-affinity``: never). Exit codes: 0 written; 2 a
scenario, request or --out the planner refuses (one line ``rollart plan: error: ...`` naming
what is short or unknown).
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
    # a str, not a Path: Path("") is "." and an empty --out would read as a directory
    p.add_argument("--out", required=True, help="where to write the planned scenario")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help="CPU seconds of this process the search may take (default "
                   f"{DEFAULT_BUDGET_S:g}); other work on the machine makes the search take "
                   "longer in wall time and shrinks it a little")
    p.add_argument("--max-runs", type=int, default=None, metavar="N",
                   help="the most simulated runs the search may make (default: no limit); the "
                   "rounds then stop on runs, not CPU seconds, and a plan that neither "
                   "--budget-s nor the straggler rule cuts short is the same on any machine")
    p.add_argument("--model", default=None,
                   help="simulated model profile (default: from model.path, e.g. qwen3-8b)")
    p.add_argument("--seeds", type=int, default=2,
                   help="simulation seeds of the last rung (default 2)")
    p.add_argument("--profiles-from", type=Path, default=None, metavar="RUN_DIR",
                   help="measure each domain's workload (turns, generated, prompt and "
                   "observation tokens) from this run folder's metrics.jsonl and "
                   "transcripts.jsonl instead of assuming it from its env")
    p.add_argument("--static-affinity", action="store_true",
                   help="keep the scenario's [run.adaptive_affinity] setting: do not try "
                   "online affinity on the best layouts")
    p.add_argument("--force", action="store_true",
                   help="overwrite an existing --out file (never the input scenario)")
    args = p.parse_args(argv)
    if args.seeds < 1:  # one line, as every refusal of the request
        print(f"rollart plan: error: --seeds must be >= 1, got {args.seeds}", file=sys.stderr)
        return 2
    if not args.out.strip():
        print("rollart plan: error: --out is empty: name the file to write the planned "
              "scenario to (e.g. --out plan.toml)", file=sys.stderr)
        return 2
    out = Path(args.out)
    # Checked before the search, which takes minutes: the plan must have somewhere to go.
    problem = _out_problem(args.scenario, out, args.force)
    if problem is not None:
        print(f"rollart plan: error: --out {out}: {problem}", file=sys.stderr)
        return 2
    try:
        res = plan(args.scenario, budget_s=args.budget_s, model=args.model,
                   seeds=tuple(range(args.seeds)), profiles_from=args.profiles_from,
                   progress=lambda line: print(f"rollart plan: {line}", file=sys.stderr),
                   budget_option="--budget-s",
                   try_online_affinity=not args.static_affinity, max_runs=args.max_runs)
    except (PlanError, ConfigError) as exc:
        print(f"rollart plan: error: {exc}", file=sys.stderr)
        return 2
    print(res.table())
    for line in res.warnings:  # also on stderr: seen when stdout goes to a file
        print(f"rollart plan: warning: {line}", file=sys.stderr)
    try:
        res.write(out)
    except OSError as exc:
        print(f"rollart plan: error: --out {out}: cannot write: {exc}", file=sys.stderr)
        return 2
    print(f"rollart plan: wrote {out}: {res.best.candidate.describe(res.inputs)}",
          file=sys.stderr)
    return 0


def _out_problem(scenario: Path, out: Path, force: bool) -> str | None:
    """What stops the plan being written to ``out``, or None."""
    if out.exists() and scenario.exists() and out.resolve() == scenario.resolve():
        return "is the input scenario; write the plan to another file"
    if out.is_dir():
        return "is a directory; name a file"
    if out.exists() and not force:
        return "exists; pass --force to overwrite it"
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        return f"its directory {parent} does not exist"
    return None
