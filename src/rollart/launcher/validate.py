"""``rollart validate SCENARIO.toml [--quiet]``: check a scenario without running it.

Decodes the file (unknown fields, types and bounds) and checks the cross-field rules, then
prints the resolved scenario (every default filled in) as JSON: what ``config.json`` of a run
would hold. What ``rollart run`` needs beyond a valid scenario (an env host for the domains'
envs, no local reward it cannot register: ``rollart.launcher.local.preflight``) is printed as a
note: a driver script can register those in-process. A ``run.local_module`` is imported (it is
the operator's own file) and its ``REWARDS`` / ``ENVS`` count as registered; a missing file or
one that fails to import makes the scenario invalid.

A ``model.path`` other than ``tiny`` that is not a local checkpoint directory here gets a note
(the scenario may be checked on another machine than the one it runs on).

It also places the scenario as ``--cluster ray`` would (``placement.plan_placement``, no Ray
needed) and prints a note when that would fail, and checks the run's authentication as ``rollart run`` would (``runkeys.check_run_auth``):
``run.key_file`` must exist and be readable by its owner only, and a scenario naming services
started by hand needs a key.

Exit codes: 0 valid; 2 invalid, with one line ``SCENARIO: field.path: reason`` on stderr
(e.g. ``domains[1].weight: Expected `float` >= ...``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rollart.config import in_file, load_scenario, scenario_to_json
from rollart.transport.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollart validate", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario", type=Path, help="scenario TOML file")
    p.add_argument("--quiet", action="store_true", help="print nothing when it is valid")
    args = p.parse_args(argv)
    from rollart.launcher import localmodule
    from rollart.launcher.local import preflight
    from rollart.launcher.runkeys import check_run_auth

    try:
        scenario = load_scenario(args.scenario)
        regs = localmodule.load(scenario, args.scenario.parent, str(args.scenario))
    except ConfigError as exc:
        print(f"rollart validate: config error: {exc}", file=sys.stderr)
        return 2
    try:
        preflight(scenario, str(args.scenario), local_rewards=regs.rewards,
                  local_envs=regs.envs)
    except ConfigError as exc:
        print(f"rollart validate: note: `rollart run` would refuse it: {exc}", file=sys.stderr)
    model = Path(scenario.model.path)
    if scenario.model.path != "tiny" and not (model / "config.json").exists():
        # a note, not an error: the scenario may be checked away from the machine it runs on
        print(f"rollart validate: note: `rollart run` would refuse it on this machine: "
              f"{args.scenario}: model.path: {model} is not a local Hugging Face checkpoint "
              "directory (no config.json)", file=sys.stderr)
    try:  # only pure checks: nothing connects to Ray, nothing imports it
        from rollart.launcher.placement import plan_placement

        plan_placement(scenario)
    except ConfigError as exc:
        print(f"rollart validate: note: `rollart run --cluster ray` would refuse it: "
              f"{in_file(str(args.scenario), exc)}", file=sys.stderr)
    try:  # the run's key: a key file others can read, or services named without a key
        check_run_auth(scenario)
    except ConfigError as exc:
        print(f"rollart validate: config error: {in_file(str(args.scenario), exc)}",
              file=sys.stderr)
        return 2
    if not args.quiet:
        sys.stdout.write(scenario_to_json(scenario).decode())
        print(f"rollart validate: {args.scenario}: valid ({len(scenario.domains)} domains, "
              f"{len(scenario.pools)} pools)", file=sys.stderr)
    return 0
