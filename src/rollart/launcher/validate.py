"""``rollart validate SCENARIO.toml [--quiet]``: check a scenario without running it.

Decodes the file (unknown fields, types and bounds) and checks the cross-field rules, then
prints the resolved scenario (every default filled in) as JSON: what ``config.json`` of a run
would hold. What ``rollart run`` needs beyond a valid scenario (an env host for the domains'
envs, env names an env host can make (a known family, GEM game or reasoning-gym dataset), no
local reward it cannot register: ``rollart.launcher.local.preflight``) is printed as a note: a
driver script can serve those envs and register those rewards in-process. A
``run.local_module`` is imported (it is the operator's own file) and its ``REWARDS`` / ``ENVS``
count as registered; a missing file or one that fails to import makes the scenario invalid.

A ``model.path`` other than ``tiny`` that is not a local checkpoint directory here gets a note
(the scenario may be checked on another machine than the one it runs on), and so does an
engine/trainer agreement check that may quarantine or stop while every batch after the first
holds no token of the trainer's version (``agreement_notes``), and a ``py:`` env whose
package is not on this machine's path (``py_env_notes``; the env host imports it, on its own
path).

It also places the scenario as ``--cluster ray`` would (``placement.plan_placement``, no Ray
needed) and prints a note when that would fail, and checks the run's authentication as ``rollart run`` would (``runkeys.check_run_auth``):
``run.key_file`` must exist and be readable by its owner only, and a scenario naming services
started by hand needs a key.

Exit codes: 0 valid; 2 invalid, with one line ``SCENARIO: field.path: reason`` on stderr
(e.g. ``domains[1].weight: Expected `float` >= ...``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Collection
from pathlib import Path

from rollart.config import Scenario, in_file, load_scenario, scenario_to_json
from rollart.inference.prefixes import DEFAULT_MAX_PREFIX_TOKENS
from rollart.transport.errors import ConfigError


def prefix_store_notes(sc: Scenario) -> list[str]:
    """One note per pool whose workers' prefix stores may be too small: the trajectories the
    in-flight bound admits (``(alpha + 1) x batch_size / group_size`` groups of
    ``group_size + redundancy``), spread evenly over the pool's workers, each at
    ``max_tokens_per_trajectory``, against ``engine.max_prefix_tokens`` (default 16 Mi). An
    upper bound (every trajectory on this pool, each at its longest): a note, not an error. A
    worker that evicts a prefix makes that trajectory's next turn fail with
    ``prefix_unknown`` and go again with its whole context (issue 11: at 10k trajectories,
    ~every turn)."""
    from rollart.controller.buffer import SampleBuffer

    run = sc.run
    groups = SampleBuffer.groups_bound(run.alpha, run.batch_size, run.group_size)
    in_flight = groups * (run.group_size + run.redundancy)
    served = {d.pool for d in sc.domains}
    notes = []
    for pool in sc.pools:
        if pool.name not in served:
            continue
        workers = len(pool.addresses) or pool.num_workers
        per_worker = -(-in_flight // workers)
        need = per_worker * run.max_tokens_per_trajectory
        have = pool.engine.max_prefix_tokens or DEFAULT_MAX_PREFIX_TOKENS
        if need > have:
            notes.append(
                f"pools.{pool.name}.engine.max_prefix_tokens: up to {in_flight} trajectories "
                f"in flight over {workers} worker(s) may need {need} prefix tokens per worker "
                f"({per_worker} x max_tokens_per_trajectory {run.max_tokens_per_trajectory}), "
                f"more than its {have}: an evicted trajectory resends its whole context "
                "(num_prefix_resends in the step metrics)")
    return notes


def agreement_notes(sc: Scenario) -> list[str]:
    """A note when the engine/trainer agreement check can act on a worker (``quarantine`` /
    ``stop``) while every batch after the first holds no token of the trainer's version
    (an overlapped mode with ``weight_apply = "at_batch"``: the version is applied once its
    batch was taken): each worker is then judged on all its tokens, which include the
    policy's own change within alpha (``rollart.controller.agreement``)."""
    from rollart.controller.modes import mode_spec

    run = sc.run
    if (run.worker_checks.agreement_policy in ("quarantine", "stop")
            and mode_spec(run.mode).overlap and run.weight_apply == "at_batch"):
        return [f"run.worker_checks.agreement_policy = {run.worker_checks.agreement_policy!r} "
                f"with mode {run.mode!r} and weight_apply = 'at_batch': after the first step "
                "no batch holds tokens of the trainer's version, so workers are judged on all "
                "their tokens, the policy's change within alpha included; set "
                "max_logprob_mismatch / max_iw_capped_fraction above that drift, or "
                "weight_apply = 'eager' (which helps only where a batch's rollout outlasts a "
                "training step: metrics' agreement_basis_by_worker says which tokens were "
                "judged)"]
    return []


def window_notes(sc: Scenario) -> list[str]:
    """A note per pool whose engines may run as many sequences at once as the controller sends
    one worker, or more (``engine.max_num_seqs`` not below ``run.max_generate_in_flight``): the
    engine would have no request waiting to start when one finishes, or never a full batch.
    ``max_num_seqs`` unset (vLLM's default, up to 1024) is not checked here."""
    cap = sc.run.max_generate_in_flight
    return [f"pools.{pool.name}.engine.max_num_seqs = {pool.engine.max_num_seqs} is not below "
            f"run.max_generate_in_flight = {cap}: each worker gets at most {cap} requests at "
            "once, so its engine has none queued to start when one finishes"
            + ("" if pool.engine.max_num_seqs == cap else " and never runs a full batch")
            for pool in sc.pools
            if pool.engine.max_num_seqs is not None and pool.engine.max_num_seqs >= cap]


def py_env_notes(sc: Scenario, local_envs: Collection[str] = ()) -> list[str]:
    """A note per ``py:`` env (served by env hosts) whose top-level package cannot be found
    on this machine's path. Only found, never imported: the env host imports it, on its own
    path, so this is a note, not an error."""
    notes = []
    for i, dom in enumerate(sc.domains):
        if not dom.env.startswith("py:") or dom.env in local_envs:
            continue
        top = dom.env[3:].partition(":")[0].split(".")[0]
        try:
            found = bool(top) and importlib.util.find_spec(top) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            notes.append(f"domains[{i}].env: {dom.env!r}: no package {top!r} on this "
                         "machine's Python path; an env host without it fails every session "
                         "open")
    return notes


def cost_notes(sc: Scenario) -> list[str]:
    """What would not stop a run but would cost it (``prefix_store_notes``,
    ``agreement_notes``, ``window_notes``): printed by ``rollart validate`` and at the start of
    ``rollart run``."""
    return prefix_store_notes(sc) + agreement_notes(sc) + window_notes(sc)


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
    # Notes are printed after the resolved scenario, so a terminal ends on them.
    notes: list[str] = []
    refused = False
    try:
        preflight(scenario, str(args.scenario), local_rewards=regs.rewards,
                  local_envs=regs.envs)
    except ConfigError as exc:
        notes.append(f"`rollart run` would refuse it: {exc}")
        refused = True
    model = Path(scenario.model.path)
    if scenario.model.path != "tiny" and not (model / "config.json").exists():
        # a note, not an error: the scenario may be checked away from the machine it runs on
        notes.append(f"`rollart run` would refuse it on this machine: {args.scenario}: "
                     f"model.path: {model} is not a local Hugging Face checkpoint directory "
                     "(no config.json)")
        refused = True
    notes += [f"{args.scenario}: {note}"
              for note in cost_notes(scenario) + py_env_notes(scenario, regs.envs)]
    try:  # only pure checks: nothing connects to Ray, nothing imports it
        from rollart.launcher.placement import plan_placement

        plan_placement(scenario)
    except ConfigError as exc:
        notes.append(f"`rollart run --cluster ray` would refuse it: "
                     f"{in_file(str(args.scenario), exc)}")
    try:  # the run's key: a key file others can read, or services named without a key
        check_run_auth(scenario)
    except ConfigError as exc:
        print(f"rollart validate: config error: {in_file(str(args.scenario), exc)}",
              file=sys.stderr)
        return 2
    if not args.quiet:
        sys.stdout.write(scenario_to_json(scenario).decode())
        sys.stdout.flush()
    for note in notes:
        print(f"rollart validate: note: {note}", file=sys.stderr)
    if not args.quiet:
        tail = (f"; {len(notes)} note(s) above" if notes else "") + (
            ", and `rollart run` would refuse it as it stands" if refused else "")
        print(f"rollart validate: {args.scenario}: valid ({len(scenario.domains)} domains, "
              f"{len(scenario.pools)} pools){tail}", file=sys.stderr)
    return 0
