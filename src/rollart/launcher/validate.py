"""``rollart validate SCENARIO.toml [--quiet]``: check a scenario without running it.

Decodes the file (unknown fields, types and bounds, every one named in one error) and checks
the cross-field rules, then
prints the resolved scenario (every default filled in) as JSON: what ``config.json`` of a run
would hold. Then it checks everything ``rollart run`` (``--cluster``, default local) would refuse
before starting a process: an env host for the domains' envs, env names an env host can make (a
known family, GEM game or reasoning-gym dataset) and the ``env_options`` they take
(``rollart.config.envoptions``), local rewards something registers
(``rollart.launcher.local.preflight``), a warm-up of the tiny model with a domain to imitate
(``check_warmup_domains``: else ``tiny_warmup = false`` under ``[model]``), and what this
machine must give (``rollart.launcher.machine``: reward functions the reward service serves, ``trainer.device =
"cuda"`` on a torch with CUDA, ``wandb`` installed for ``output.wandb``, a reachable Ray
cluster, a local ``model.path``, no torchvision / torchaudio / torchcodec built for another
torch). A ``run.local_module`` is imported (it is the operator's own file) and its ``REWARDS`` /
``ENVS`` count as registered; a missing file or one that fails to import makes the scenario
invalid.

Notes (printed, exit 0) name what would not stop a run but would cost it: an engine/trainer
agreement check that may quarantine or stop while every batch after the first holds no token of
the trainer's version (``agreement_notes``), a ``py:`` env whose package is not on this
machine's path (``py_env_notes``; the env host imports it, on its own path), prefix stores and
send windows too small, and (``--cluster local``) a scenario ``--cluster ray`` could not place
(``placement.plan_placement``, no Ray needed). The run's authentication is checked as ``rollart
run`` would (``runkeys.check_run_auth``): ``run.key_file`` must exist and be readable by its
owner only, and a scenario naming services started by hand needs a key.

The resolved scenario goes to stdout (not with ``--quiet``); every other line goes to stderr,
starting ``rollart validate: `` (then ``note: ``, ``error: `` or ``config error: ``, each
naming the file and the field), and a closing ``rollart validate: SCENARIO: ...`` line says
the verdict (not with ``--quiet`` when valid). Exit codes (``EXIT_CODES``): 0 valid, notes or
not; 1 valid as a file, but ``rollart run`` would refuse it here (one ``error:`` line per
reason, naming the field and the fix); 2 invalid: one ``config error:`` line naming the field
(e.g. ``domains[1].weight: Expected `float` >= ...``), or a command-line usage error.
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

#: ``rollart validate``'s exit statuses, as its ``--help`` shows them.
EXIT_CODES = """\
exit status:
  0  valid: `rollart run` would start it here (notes, if any, name what would cost the run)
  1  valid as a file, but `rollart run` would refuse it here: one `error:` line per reason
  2  invalid: unreadable, a field or cross-field rule broken, run.local_module failing to
     import, or an unusable run key (one `config error:` line); or a usage error

Every line on stderr starts `rollart validate: ` (then `note: `, `error: ` or `config error: `,
each naming SCENARIO and the field); the last says the verdict. The resolved scenario (JSON)
goes to stdout."""


def prefix_store_notes(sc: Scenario) -> list[str]:
    """One note per pool whose workers' prefix stores may be too small: the trajectories the
    in-flight bound admits (``(alpha + 1) x batch_size / group_size`` groups of
    ``group_size + redundancy``), spread evenly over the pool's workers, each at
    ``max_tokens_per_trajectory``, against ``engine.max_prefix_tokens`` (default 16 Mi). An
    upper bound (every trajectory on this pool, each at its longest): a note, not an error. A
    worker that evicts a prefix makes that trajectory's next turn fail with
    ``prefix_unknown`` and go again with its whole context (at 10k trajectories,
    ~every turn)."""
    from rollart.controller.buffer.core import SampleBuffer

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
    policy's own change within alpha (``rollart.controller.training.agreement``)."""
    from rollart.controller.modes import mode_spec

    run = sc.run
    if (run.worker_checks.agreement_policy in ("quarantine", "stop")
            and mode_spec(run.mode).overlap
            and run.effective_weight_apply == "at_batch"):
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
    p = argparse.ArgumentParser(prog="rollart validate",
                                description=(__doc__ or "").split("\n\n")[0], epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", type=Path, help="scenario TOML file")
    p.add_argument("--quiet", action="store_true",
                   help="print neither the resolved scenario nor the closing line when it is "
                        "valid (notes and errors are still printed)")
    p.add_argument("--cluster", default="local", metavar="local|ray|ray://HOST:PORT",
                   help="check as `rollart run --cluster` would (default local)")
    args = p.parse_args(argv)
    from rollart.launcher import localmodule, machine
    from rollart.launcher.local import check_warmup_domains, preflight
    from rollart.launcher.placement import parse_cluster
    from rollart.launcher.runkeys import check_run_auth

    source = str(args.scenario)
    try:
        parse_cluster(args.cluster)  # a usage error, as `rollart run` has it: not the scenario's
        scenario = load_scenario(args.scenario)
        regs = localmodule.load(scenario, args.scenario.parent, source)
    except ConfigError as exc:
        print(f"rollart validate: config error: {exc}", file=sys.stderr)
        return 2
    # Notes and refusals are printed after the resolved scenario, so a terminal ends on them.
    notes: list[str] = []
    refusals: list[str] = []
    try:
        preflight(scenario, source, local_rewards=regs.rewards, local_envs=regs.envs)
    except ConfigError as exc:
        refusals += exc.reasons  # e.g. each domain whose env_options its env would refuse
    try:  # `rollart run`'s model phase: a warm-up of the tiny model with nothing to imitate
        check_warmup_domains(scenario, note=lambda text: notes.append(f"{source}: {text}"))
    except ConfigError as exc:
        refusals.append(str(in_file(source, exc)))
    refusals += [str(in_file(source, ConfigError(text)))
                 for text in machine.refusals(scenario, args.cluster)]
    notes += [f"{source}: {note}"
              for note in cost_notes(scenario) + py_env_notes(scenario, regs.envs)]
    try:  # only pure checks: nothing connects to Ray, nothing imports it
        from rollart.launcher.placement import plan_placement

        plan_placement(scenario)
    except ConfigError as exc:
        if args.cluster == "local":
            notes.append(f"`rollart run --cluster ray` would refuse it: {in_file(source, exc)}")
        else:
            refusals.append(str(in_file(source, exc)))
    try:  # the run's key: a key file others can read, or services named without a key
        check_run_auth(scenario)
    except ConfigError as exc:
        print(f"rollart validate: config error: {in_file(source, exc)}", file=sys.stderr)
        return 2
    if not args.quiet:
        sys.stdout.write(scenario_to_json(scenario).decode())
        sys.stdout.flush()
    for note in notes:
        print(f"rollart validate: note: {note}", file=sys.stderr)
    for refusal in refusals:
        print(f"rollart validate: error: `rollart run` would refuse it: {refusal}",
              file=sys.stderr)
    if refusals:
        print(f"rollart validate: {source}: valid as a file, but `rollart run` would refuse it: "
              f"{len(refusals)} reason(s) above", file=sys.stderr)
        return 1
    if not args.quiet:
        tail = f"; {len(notes)} note(s) above" if notes else ""
        print(f"rollart validate: {source}: valid ({len(scenario.domains)} domains, "
              f"{len(scenario.pools)} pools){tail}", file=sys.stderr)
    return 0
