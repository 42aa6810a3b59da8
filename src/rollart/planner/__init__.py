"""``rollart plan``: choose the layout that is fastest for a scenario's work (SIMULATED).

``plan(scenario)`` reads the GPUs the scenario uses, its model and task domains
(``rollart.planner.inputs``), searches the trainer vs rollout split, the pools per hardware
label, each domain's pool, alpha and redundancy with the simulator by successive halving
(``rollart.planner.search``) within a budget of CPU seconds, and returns the candidates of the
last rung, best first, with the chosen layout as a scenario (``rollart.planner.layout``).
Predictions are simulated step times: the real controller over simulated engines, envs and
trainer, with the workload profiles stated in ``rollart.planner.inputs``.

Modules: ``inputs`` (inventory, model, profiles, refusals), ``measured`` (profiles measured
from a run folder), ``search`` (candidates,
successive halving), ``layout`` (the scenario TOML), ``command`` (the CLI).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart.config import Scenario, load_scenario
from rollart.planner.inputs import PlanError, PlanInputs, raw_of, read_inputs
from rollart.planner.layout import layout_dict, scenario_toml
from rollart.planner.measured import MeasuredProfiles, measure_profiles
from rollart.planner.search import (
    Candidate,
    Score,
    SearchLog,
    budget_words,
    successive_halving,
)
from rollart.sim.workload import DomainSpec

__all__ = ["Candidate", "MeasuredProfiles", "PlanError", "PlanResult", "Score", "plan"]

#: the default search budget (CPU seconds of the planning process: five CPU minutes)
DEFAULT_BUDGET_S = 300.0
_ORDINAL = {1: "first", 2: "second", 3: "third"}


@dataclass
class PlanResult:
    """A plan: ``ranked`` scores of the last rung, best first (``best`` is the chosen one),
    ``scenario`` / ``toml`` the chosen layout, ``log`` what the search ran, ``inputs`` what
    it read. Every step time is SIMULATED (seconds of simulated time)."""

    ranked: list[Score]
    scenario: Scenario
    toml: str
    log: SearchLog
    inputs: PlanInputs
    budget_s: float
    #: the workload profiles measured from a run folder (``profiles_from=``), else None
    measured: MeasuredProfiles | None = None
    #: what the budget is called where the user gave it (``--budget-s`` on the command line)
    budget_option: str = "budget_s"
    #: the most simulated runs the search could make (``max_runs``), else None
    max_runs: int | None = None

    @property
    def best(self) -> Score:
        return self.ranked[0]

    @property
    def warnings(self) -> list[str]:
        """What the user should know about how far the search got, and about workloads
        measured on another model than the plan's (one line each)."""
        lg, out = self.log, []
        budget = f"{self.budget_s:g} CPU s" + (
            "" if self.max_runs is None else
            f", {self.max_runs} run{'s' if self.max_runs != 1 else ''}")
        note = self.measured.model_note(self.inputs.model.name) if self.measured else None
        if note is not None:
            out.append(note)
        ran = lg.per_rung[0] if lg.per_rung else 0
        if lg.online_affinity_short:
            out.append(f"{lg.online_affinity} ({budget}); give a larger "
                       f"{self._limits()} to have it tried")
        # layouts a limit left unrun or stopped, and layouts that stalled on their own
        short = lg.first_rung_space - lg.first_rung_started + lg.first_rung_cut
        stalled = lg.first_rung_started - lg.first_rung_cut - ran
        if short > 0:
            out.append(f"the budget ({budget}) simulated only {ran} of the "
                       f"{lg.first_rung_space} layouts of the first round (each trainer / pool "
                       f"mapping, the scenario's own layout among them where the space holds "
                       f"it; {lg.space} layouts in all) to its end"
                       + (f" ({stalled} more started and {'was' if stalled == 1 else 'were'} "
                          "dropped)" if stalled > 0 else "")
                       + f": the plan is the best of those, not of all; give a larger "
                       f"{self._limits('rung0')}")
        elif stalled > 0:
            out.append(f"{stalled} of the {lg.first_rung_space} layouts of the first round "
                       f"stalled or overran their cap and were dropped (their simulated "
                       f"trajectories past run.trajectory_timeout_s, or a run far slower than "
                       f"the others): the plan is the best of the rest")
        for rung, (n, short, scored) in enumerate(lg.later_rungs, 2):
            out += self._later_round(rung, n, short, scored, budget)
        if lg.race_cut_racers:
            out.append(f"the budget ({budget}) stopped the race on further seeds with "
                       f"{lg.race_cut_racers} candidate(s) not yet resolved against the best "
                       f"(neither slower with about 95% confidence nor known to within 5% of "
                       f"it): the plan is the best on the seeds run so far; give a larger "
                       f"{self._limits('race')}")
        return out

    def _later_round(self, rung: int, n: int, short: int, scored: int,
                     budget: str) -> list[str]:
        """The warning for round ``rung`` (2, 3) of ``n`` candidates, ``short`` of them left
        unrun or stopped by a limit, ``scored`` ended; the rest stalled or overran their cap.
        Empty when every candidate ended."""
        which, stalled = f"the {_ORDINAL[rung]} round", n - short - scored
        limits = self._limits(f"rung{rung - 1}")
        stalls = (f"{stalled} stalled or overran their cap" if stalled else "")
        if not scored:  # the search stops there: the plan is the round before's ranking
            why = (f"the budget ({budget}) left all {n} candidates of {which} unrun or "
                   f"stopped" if short == n else
                   f"none of the {n} candidates of {which} ended ({stalls}"
                   + (f", {short} left unrun or stopped by the budget ({budget})"
                      if short else "") + ")")
            return [f"{why}: the plan is the best of the {_ORDINAL[rung - 1]} round, on its "
                    f"shorter runs, and no later round or race ran"
                    + (f"; give a larger {limits}" if short else "")]
        if short:
            return [f"the budget ({budget}) left {short} of the {n} candidates of {which} "
                    f"unrun or stopped (the round before's best, longer runs)"
                    + (f" and {stalls}" if stalled else "")
                    + f": the plan is the best of the {scored} that ended; give a larger "
                    f"{limits}"]
        if stalled:
            return [f"{stalled} of the {n} candidates of {which} stalled or overran their cap "
                    f"and were dropped: the plan is the best of the rest"]
        return []

    def _limits(self, phase: str | None = None) -> str:
        """The option(s) that left ``phase`` of the search short (``"rung0"``, ...,
        ``"race"``; None: any part of it), as the user would give them."""
        runs = "--max-runs" if self.budget_option.startswith("--") else "max_runs"
        bound = (self.log.limited_by if phase is None else
                 self.log.phase_limits.get(phase) or self.log.limited_by)
        named = [name for key, name in (("budget", self.budget_option), ("runs", runs))
                 if key in bound]
        return " or ".join(named or [self.budget_option])

    def table(self, top: int = 5) -> str:
        """The best ``top`` candidates, one line each, and a summary line."""
        lines = [f"{'rank':>4}  {'step s':>9}  {'+-':>5}  {'rollout':>7}  {'idle':>5}  "
                 f"{'cost':>6}  layout"]
        for i, s in enumerate(self.ranked[:top], 1):
            share = s.candidate.rollout_share(self.inputs)
            lines.append(f"{i:>4}  {s.step_time_s:>9.1f}  {s.se_s:>5.1f}  {share:>7.0%}  "
                         f"{s.trainer_idle_share:>5.0%}  {s.cost:>6.1f}  "
                         f"{s.candidate.describe(self.inputs)}")
        lg = self.log
        lines.append(f"(SIMULATED step times; +-: their standard error; rollout: share of the "
                     f"GPUs rolling out; idle: the trainer's idle share of a step; cost in H800 "
                     f"units; searched {lg.runs} runs"
                     + (f" of {self.max_runs}" if self.max_runs is not None else "")
                     + f" over {lg.space} layouts, rungs "
                     f"{lg.per_rung}, {lg.race_seeds} racing seed(s), {lg.cpu_s:.0f} CPU s of "
                     f"{self.budget_s:g} s, {lg.wall_s:.0f} s wall)")
        if lg.online_affinity and not lg.online_affinity_short:
            lines.append(lg.online_affinity)
        if self.measured is not None:
            lines += [f"profile from {self.measured.run_dir}: {line}"
                      for line in self.measured.describe()]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def write(self, path: str | Path) -> None:
        """Write the chosen layout's scenario TOML to ``path``."""
        Path(path).write_text(self.toml)


def plan(scenario: str | Path | Scenario, *, budget_s: float = DEFAULT_BUDGET_S,
         seeds: tuple[int, ...] = (0, 1), model: str | None = None,
         profiles: dict[str, DomainSpec] | None = None,
         profiles_from: str | Path | None = None,
         alphas: tuple[int, ...] | None = None, redundancies: tuple[int, ...] | None = None,
         progress: Any = None, budget_option: str = "budget_s",
         try_online_affinity: bool = True, max_runs: int | None = None) -> PlanResult:
    """Plan the layout of ``scenario`` (a path to a scenario TOML or a ``Scenario``).

    ``budget_s``: CPU seconds of this process the search may take (it stops starting runs
    before; ``rollart.planner.search``: other work on the machine shrinks it far less than it
    would wall seconds); ``seeds``: simulation seeds (the first ranks the early rungs, all of them the last; racing adds
    ``max(seeds) + 1``, ... while budget is left, ``rollart.planner.noise``); ``model``: the
    simulated model profile (default: from ``model.path``); ``profiles``: workload per domain
    name (default: assumed from each domain's env, ``rollart.planner.inputs``);
    ``profiles_from``: a run folder whose ``metrics.jsonl`` (and ``transcripts.jsonl``) the
    workloads of the domains ``profiles`` does not name are measured from
    (``rollart.planner.measured``: turns, generated tokens per turn, prompt and observation
    tokens; env latencies stay assumed); ``alphas`` /
    ``redundancies``: the values to search (default 1-2 / 0-1 and the scenario's own);
    ``progress``: a callable given one line per rung; ``budget_option``: what errors and
    warnings call the budget (``rollart plan`` passes ``"--budget-s"``; a name starting with
    ``--`` also makes every other message spell arguments as command-line options,
    ``--model`` rather than ``model=``); ``try_online_affinity``: where the scenario has
    ``[run.adaptive_affinity]`` off, the last round also runs the best layout of the round
    before, and its best with a larger trainer, with it on, and the plan turns it on when such
    a variant ranks first (by mean step time, after the race, as every choice); ``False``: plan with the scenario's setting only;
    ``max_runs``: the most simulated runs the search may make (``successive_halving``: the
    rungs then stop on runs, and a plan that ``budget_s`` does not cut short is the same on any
    machine).

    Raises PlanError naming what is short or unknown (hardware that cannot hold the model,
    fewer GPUs than the trainer plus one engine per domain, a trainer larger than one node
    or than a minibatch's rows, CPU pools, a budget too small for one
    simulated run, a model or hardware without a simulated profile, a ``profiles_from``
    folder without metrics or without a domain of the scenario) and ConfigError for an
    invalid scenario file.
    """
    if isinstance(scenario, Scenario):
        sc, raw, source = scenario, raw_of(scenario), "<scenario>"
    else:
        import tomllib

        sc, source = load_scenario(scenario), str(scenario)
        raw = tomllib.loads(Path(scenario).read_text())
    cli = budget_option.startswith("--")  # `rollart plan`: messages spell its options
    measured = None
    if profiles_from is not None:
        # The scenario's own refusals (CPU pools, too few GPUs) come before the run folder's:
        # a folder fixed for a scenario the planner refuses anyway is time lost.
        read_inputs(sc, model=model, profiles=profiles, cli=cli)
        rest = tuple(d.name for d in sc.domains if d.name not in (profiles or {}))
        measured = measure_profiles(profiles_from, sc, rest, cli=cli)
        profiles = {**measured.profiles, **(profiles or {})}
    inputs = dataclasses.replace(read_inputs(sc, model=model, profiles=profiles, cli=cli),
                                 alphas=alphas, redundancies=redundancies)
    ranked, log = successive_halving(inputs, budget_s=budget_s, seeds=tuple(seeds),
                                     progress=progress, budget_option=budget_option,
                                     try_online_affinity=try_online_affinity,
                                     max_runs=max_runs,
                                     max_runs_option="--max-runs" if cli else "max_runs")
    if not ranked:
        runs = "" if "runs" not in log.limited_by else (
            f" or {'--max-runs' if cli else 'max_runs'} {max_runs} too few runs")
        raise PlanError(
            f"no layout of {source} could be simulated to the end: every candidate tried "
            f"stalled (trajectories past run.trajectory_timeout_s) or overran its share of the "
            f"budget; the GPUs are likely too few for model {inputs.model.name!r} at this batch size, "
            f"or the budget ({budget_words(budget_s, budget_option)}) too small{runs}")
    text, chosen = scenario_toml(layout_dict(raw, inputs, ranked[0].candidate),
                                 f"plan of {source}")
    header = (f"# Layout planned by `rollart plan` for {source} (SIMULATED step time "
              f"{ranked[0].step_time_s:.1f} s):\n# {ranked[0].candidate.describe(inputs)}\n")
    res = PlanResult(ranked=ranked, scenario=chosen, toml=header + text, log=log,
                     inputs=inputs, budget_s=budget_s, measured=measured,
                     budget_option=budget_option, max_runs=max_runs)
    res.toml = "".join(f"# warning: {w}\n" for w in res.warnings) + res.toml
    return res
