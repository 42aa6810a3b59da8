"""The planner's search: candidate layouts, scored by the simulator, by successive halving.

A candidate (``Candidate``) is a trainer size, a pool per domain (by hardware label), alpha,
redundancy and the engines' tensor-parallel degree per label (the fewest GPUs that hold the
model, or twice that); every label some domain maps to gets one pool of all its GPUs left
after the trainer (``Candidate.pools``). It is scored by its mean step time over the steps after
the warm-up (seconds of simulated time) from ``rollart.sim.harness.run_simulated``: the real
controller over simulated engines, envs and trainer, as the benchmarks run it.

Successive halving (Jamieson and Talwalkar, AISTATS 2016; Li et al., Hyperband, JMLR 2018):
rung 0 runs every (trainer size, mapping) on a short horizon with one seed, after the
scenario's own layout in the order of the cost model's predicted step time
(``predicted_step_s``: a budget that covers part of the rung runs the part ranked best), each
at the engines' tensor-parallel degree the cost model predicts faster
(``rollart.planner.tpchoice``: searching both degrees would triple the space); the best third
(at least ``MIN_KEEP``) and as many again of the candidates within the noise of that cut
(``rollart.planner.noise.cut``) go on to rung 1 (a longer horizon) at every alpha and
redundancy, and the same cut of those to rung 2 on every seed. Where the scenario has online
affinity (``[run.adaptive_affinity]``) off, rung 2 also runs rung 1's best candidate, and its
best with a larger trainer, with it on, each right after the static candidate
(``with_online_twins``): the plan turns it on when such a variant ranks first.
Every candidate of a rung runs on the same seeds. While budget is left after rung 2, the
leader and the candidates within its noise race on further common seeds
(``rollart.planner.noise``). A run longer than ``STRAGGLER_X`` times its rung's median is
stopped and its candidate dropped (a run that stops advancing its clock, or a layout that
queues long on its engines). Each rung may use a share of the budget (``RUNG_SHARES``,
cumulative), in CPU seconds of the planning process (``cpu_s``); a run that would not end
inside its rung's share is not started (or is stopped), so candidates not run at a rung are
dropped, never compared on a shorter horizon.

The budget counts CPU time, not wall time, so that other work on the machine shrinks the
search far less: a simulated run is one thread of Python busy from its start to its end (a
virtual clock, ``rollart.sim.clock``), and its CPU time leaves out the time other processes
hold the cores. Busy cores still make a run cost somewhat more CPU (shared caches and memory
bandwidth): ``rollart plan scenarios/qwen3-8b-h800-h20.toml --budget-s 120`` on 2 cores ran
12 simulated runs quiet and 9 beside three busy loops and a test run (load about 4), which
made it take 2.6x the wall time. A faster or slower machine runs more or fewer layouts in
the same budget.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rollart.controller.observe.stall import ControllerStalledError
from rollart.planner import noise, tpchoice
from rollart.planner.inputs import (
    GPUS_PER_NODE,
    TP_CHOICES,
    PlanError,
    PlanInputs,
    check_trainer_limits,
    given,
)
from rollart.sim.harness import (
    POLICY_FIELDS,
    SimDomain,
    SimPool,
    SimResult,
    SimScenario,
    run_simulated,
)

log = logging.getLogger(__name__)

#: (steps, warmup) per rung: step times are means over the steps after ``warmup``; rung 0
#: has two such steps so that a run gives its own noise estimate
RUNGS = ((3, 1), (4, 1), (5, 1))
#: cumulative share of the budget each rung may have used by its end
RUNG_SHARES = (0.45, 0.75, 0.95)
#: survivors of a rung: the best ``1 / ETA``, at least ``MIN_KEEP``
ETA = 3
MIN_KEEP = 2
#: a run longer than this many times its rung's median run so far is stopped (a straggler)
STRAGGLER_X = 4.0


@dataclass(frozen=True)
class Candidate:
    """One layout: ``trainer_gpus`` on the trainer's label, ``mapping[i]`` the hardware label
    of domain i's pool, the run's ``alpha`` and ``redundancy``; ``wide_tp``: the labels whose
    engines span twice the fewest GPUs that hold the model (``PlanInputs.tp``): fewer engines,
    each faster per token (``rollart.sim.costs``: FLOP/s and bandwidth add over ranks, less
    the all-reduce); ``online_affinity``: run with ``[run.adaptive_affinity]`` on where the
    scenario has it off (``successive_halving``'s ``try_online_affinity``)."""

    trainer_gpus: int
    mapping: tuple[str, ...]
    alpha: int
    redundancy: int
    wide_tp: tuple[str, ...] = ()
    online_affinity: bool = False

    def tp(self, inputs: PlanInputs, label: str) -> int:
        """Tensor-parallel degree of ``label``'s engines."""
        return inputs.tp[label] * (2 if label in self.wide_tp else 1)

    def gpus_left(self, inputs: PlanInputs, label: str) -> int:
        """``label``'s GPUs left after the trainer."""
        return inputs.gpus[label] - (self.trainer_gpus if label == inputs.trainer_label else 0)

    def pools(self, inputs: PlanInputs) -> dict[str, int]:
        """Workers per used label: its GPUs left after the trainer, divided by its TP."""
        return {label: self.gpus_left(inputs, label) // self.tp(inputs, label)
                for label in dict.fromkeys(self.mapping)}

    def rollout_share(self, inputs: PlanInputs) -> float:
        """Share of the GPUs in use that roll out (the rest train)."""
        rollout = sum(n * self.tp(inputs, lb) for lb, n in self.pools(inputs).items())
        return rollout / (rollout + self.trainer_gpus)

    def cost(self, inputs: PlanInputs) -> float:
        """GPUs in use x ``relative_cost`` (H800 units, ``rollart.sim.hardware``)."""
        hw = inputs.hardware
        return (self.trainer_gpus * hw(inputs.trainer_label).relative_cost
                + sum(n * self.tp(inputs, lb) * hw(lb).relative_cost
                      for lb, n in self.pools(inputs).items()))

    def describe(self, inputs: PlanInputs) -> str:
        pools = " + ".join(f"{n}x{lb}" + (f" (tp {self.tp(inputs, lb)})"
                                          if self.tp(inputs, lb) > 1 else "")
                           for lb, n in self.pools(inputs).items())
        doms = ", ".join(f"{d}->{lb}" for d, lb in zip(inputs.domain_names, self.mapping,
                                                        strict=True))
        return (f"trainer {self.trainer_gpus}x{inputs.trainer_label}; pools {pools}; {doms}; "
                f"alpha {self.alpha}, redundancy {self.redundancy}"
                + ("; online affinity on" if self.online_affinity else ""))


@dataclass
class Score:
    """A candidate's simulated figures at its highest rung: ``step_times_s`` (one mean per
    seed), ``samples_s`` (every step time after the warm-up, all seeds), ``se_s`` (the
    standard error of ``step_time_s``, ``rollart.planner.noise``), ``trainer_idle_share``
    (seconds the trainer waited for a batch / step seconds, over the steps after the warm-up
    and the seeds: high when rollout binds, near 0 when the trainer does)."""

    candidate: Candidate
    rung: int
    step_times_s: list[float]
    trainer_idle_share: float
    cost: float
    samples_s: list[float] = field(default_factory=list)
    se_s: float = 0.0
    #: trainer idle and step seconds summed over the kept steps (to extend with more seeds)
    idle_s: float = 0.0
    busy_s: float = 0.0

    @property
    def step_time_s(self) -> float:
        """Mean step time over the kept steps of every seed (seconds, SIMULATED)."""
        return statistics.fmean(self.samples_s) if self.samples_s else statistics.fmean(
            self.step_times_s)


@dataclass
class SearchLog:
    """What the search ran: candidates per rung and simulated runs, the CPU seconds of the
    budget it used (``cpu_s``) and the wall seconds that took (``wall_s``)."""

    space: int = 0
    #: (trainer size, mapping) candidates rung 0 has to run (``per_rung[0]`` ran to the end)
    first_rung_space: int = 0
    #: how many of them rung 0 started (the rest were left by a limit; a started one may
    #: have stalled, or been stopped at the budget's end: ``first_rung_cut``)
    first_rung_started: int = 0
    first_rung_cut: int = 0
    per_rung: list[int] = field(default_factory=list)
    runs: int = 0
    #: seeds the racing added after the last rung
    race_seeds: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    #: how the best-ranked layout with online affinity on compared with it static
    #: (``try_online_affinity``); empty when not tried
    online_affinity: str = ""
    #: whether the budget ran out before any such layout ran (a warning)
    online_affinity_short: bool = False
    #: whether such a layout was started (it may then have stalled or overrun its cap)
    online_affinity_started: bool = False
    #: the second round's best layout, the first that online affinity is tried on
    online_leader: Candidate | None = None
    #: per rung after the first that began: (candidates it had to run, how many of them a
    #: limit left unrun or stopped at the budget's end, how many ended on every seed); a
    #: rung no limit cut is (n, 0, scored), one whose every candidate ended (n, 0, n)
    later_rungs: list[tuple[int, int, int]] = field(default_factory=list)
    #: candidates not yet resolved against the leader (``noise.unresolved``) when a limit
    #: stopped the race (0: no limit stopped it)
    race_cut_racers: int = 0
    #: runs stopped at the budget's end, in the rungs and the race (``first_rung_cut`` of
    #: them in rung 0)
    cut_runs: int = 0
    #: the limits that left candidates or race seeds unrun in each part of the search
    #: ("rung0", "rung1", ..., "race"): "budget" (CPU seconds), "runs" (``max_runs``)
    phase_limits: dict[str, set[str]] = field(default_factory=dict)
    #: the part of the search running now (a key of ``phase_limits``)
    phase: str = "rung0"
    #: whether a run with online affinity on was stopped at the budget's end
    online_affinity_cut: bool = False

    @property
    def limited_by(self) -> set[str]:
        """The limits that left candidates or race seeds unrun anywhere in the search."""
        return set().union(*self.phase_limits.values())


def sim_of(inputs: PlanInputs, c: Candidate, steps: int) -> SimScenario:
    """The simulated run of candidate ``c`` for ``steps`` steps, with the scenario's run
    settings (its staleness policy, online affinity) as the run would use them."""
    sc, run = inputs.scenario, inputs.scenario.run
    pools = tuple(SimPool(inputs.pool_names[lb], lb, n, tp=c.tp(inputs, lb),
                          max_batch=inputs.max_batch[lb]) for lb, n in c.pools(inputs).items())
    domains = tuple(SimDomain(spec, inputs.pool_names[lb], weight=d.weight, alpha=d.alpha)
                    for spec, lb, d in zip(inputs.profiles, c.mapping, sc.domains, strict=True))
    return SimScenario(
        pools=pools, domains=domains, model=inputs.model.name, mode=run.mode, alpha=c.alpha,
        steps=steps, batch_size=run.batch_size, group_size=run.group_size,
        redundancy=c.redundancy, selection=run.selection, max_turns=run.max_turns,
        max_tokens_per_turn=run.max_tokens_per_turn,
        max_tokens_per_trajectory=run.max_tokens_per_trajectory,
        trainer_hardware=inputs.trainer_label, trainer_gpus=c.trainer_gpus,
        env_hosts=max(1, len(sc.env_hosts)), reprefill=run.reprefill,
        # the run's own online affinity (spill, the KV working-set hold): a layout's step time
        # with it can differ from its static one by a fifth where the cache fills
        adaptive_affinity=(msgspec.structs.replace(run.adaptive_affinity, enabled=True)
                           if c.online_affinity or run.adaptive_affinity.enabled else None),
        # the scenario's whole staleness policy (``None``: the mode's default, as in the run)
        **{f: getattr(run, f) for f in POLICY_FIELDS})


def space(inputs: PlanInputs) -> tuple[list[Candidate], list[tuple[int, int]]]:
    """(rung-0 candidates at the scenario's alpha and redundancy, the (alpha, redundancy)
    pairs rung 1 tries on each survivor). The scenario's own layout comes first when it is
    one of them; no candidate leaves a used pool without an engine."""
    run, sc = inputs.scenario.run, inputs.scenario
    lab = inputs.trainer_label
    own_trainer = sc.trainer.num_processes
    most = inputs.gpus[lab]
    sizes = {inputs.trainer_min * 2 ** k for k in range(8)} | {own_trainer}
    # torchrun's ranks run on one node, and every rank needs its share of each minibatch
    # (``trainer.num_processes x num_minibatches <= run.batch_size``).
    rows = run.batch_size // sc.trainer.num_minibatches
    check_trainer_limits(inputs, rows)
    most = min(most - 1, GPUS_PER_NODE, rows)
    sizes = {t for t in sizes if inputs.trainer_min <= t <= most}
    mappings = list(itertools.product(inputs.labels, repeat=len(sc.domains)))
    own = tuple(next(p.hardware.lower() for p in sc.pools if p.name == d.pool)
                for d in sc.domains)
    out = [Candidate(t, m, run.alpha, run.redundancy) for t in sorted(sizes) for m in mappings]
    out = [c for c in out if all(n >= 1 for n in c.pools(inputs).values())]
    if not out:
        raise PlanError(f"no layout leaves an engine for every used pool after the trainer "
                        f"({inputs.trainer_min} x {lab} at least); GPUs: {inputs.gpus}")
    first = Candidate(own_trainer, own, run.alpha, run.redundancy)
    # each layout at the engine TP the cost model predicts faster (``with_predicted_tp``);
    # the scenario's own layout as it is comes first
    out = list(dict.fromkeys([first] * (first in out) + [with_predicted_tp(inputs, c)
                                                          for c in out]))
    alphas = sorted(inputs.alphas or {1, 2, run.alpha}) if inputs.searches_alpha else [run.alpha]
    reds = sorted(inputs.redundancies or {0, 1, run.redundancy})
    return out, [(a, r) for a in alphas for r in reds]


def tp_variants(inputs: PlanInputs, c: Candidate) -> list[Candidate]:
    """``c`` with each subset of its used labels' engines at twice their fewest GPUs
    (``Candidate.wide_tp``), where that stays within one node (``TP_CHOICES``) and leaves
    every used pool an engine; ``c`` itself first."""
    labels = [lb for lb in c.pools(inputs) if 2 * inputs.tp[lb] <= TP_CHOICES[-1]]
    out = [c]
    for k in range(len(labels) + 1):
        for wide in itertools.combinations(sorted(labels), k):
            v = dataclasses.replace(c, wide_tp=wide)
            if all(n >= 1 for n in v.pools(inputs).values()):
                out.append(v)
    return list(dict.fromkeys(out))


def _per_step(inputs: PlanInputs) -> list[float]:
    """Trajectories each domain sends per step (the batch split by the domains' weights)."""
    run, weights = inputs.scenario.run, [d.weight for d in inputs.scenario.domains]
    return [run.batch_size * w / sum(weights) for w in weights]


def _pool_s(inputs: PlanInputs, c: Candidate, label: str, tp: int) -> float:
    """``tpchoice.predicted_pool_s`` of ``c``'s pool of ``label`` at engines of ``tp``."""
    served = [(spec, n) for spec, n, lb in zip(inputs.profiles, _per_step(inputs), c.mapping,
                                               strict=True) if lb == label]
    return tpchoice.predicted_pool_s(
        inputs.model, inputs.hardware(label), gpus=c.gpus_left(inputs, label), tp=tp,
        max_batch=inputs.max_batch[label], domains=served,
        max_tokens_per_turn=inputs.scenario.run.max_tokens_per_turn)


def with_predicted_tp(inputs: PlanInputs, c: Candidate) -> Candidate:
    """``c`` with the labels whose engines the cost model predicts faster at twice their
    fewest GPUs (``rollart.planner.tpchoice``) in ``wide_tp``; a label stays at its fewest
    GPUs when doubling leaves it no engine or leaves the node."""
    wide = []
    for label in c.pools(inputs):
        base = inputs.tp[label]
        if 2 * base > TP_CHOICES[-1] or c.gpus_left(inputs, label) < 2 * base:
            continue
        if _pool_s(inputs, c, label, 2 * base) < _pool_s(inputs, c, label, base):
            wide.append(label)
    return dataclasses.replace(c, wide_tp=tuple(sorted(wide)))


def predicted_step_s(inputs: PlanInputs, c: Candidate) -> float:
    """``tpchoice.predicted_step_s`` of layout ``c``: the order rung 0 runs in."""
    return tpchoice.predicted_step_s(
        inputs.model, pool_s=[_pool_s(inputs, c, lb, c.tp(inputs, lb)) for lb in c.pools(inputs)],
        trainer=inputs.hardware(inputs.trainer_label), trainer_gpus=c.trainer_gpus,
        batch=list(zip(inputs.profiles, _per_step(inputs), strict=True)),
        max_tokens_per_turn=inputs.scenario.run.max_tokens_per_turn)


def full_space(inputs: PlanInputs) -> list[Candidate]:
    """Every layout of the planner's space: each (trainer, mapping) at every alpha,
    redundancy and TP variant (``tp_variants``): what an exhaustive sweep runs. The search
    runs a layout only at its predicted TP (``with_predicted_tp``) and the scenario's own."""
    first, pairs = space(inputs)
    return list(dict.fromkeys(
        v for c in first for a, r in pairs
        for v in tp_variants(inputs, dataclasses.replace(c, alpha=a, redundancy=r))))


def cpu_s() -> float:
    """CPU seconds this process has used (user and system, every thread): the clock the
    search's budget, its rung shares and its per-run caps count in. Other processes do not
    move it; other threads of this process (e.g. plans run in threads) do."""
    return time.process_time()


class _Overrun(KeyboardInterrupt):
    """A simulated run past its CPU-time cap. A KeyboardInterrupt, because asyncio hands
    any other exception raised inside a callback to the loop's exception handler instead of
    letting it end the run."""


def _is_not_overrun(record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not isinstance(exc, _Overrun)


def _quiet_overruns() -> None:
    """Keep asyncio from logging "Task exception was never retrieved" for the tasks a stopped
    run leaves holding the ``_Overrun`` (the run is dropped on purpose)."""
    log = logging.getLogger("asyncio")
    if _is_not_overrun not in log.filters:
        log.addFilter(_is_not_overrun)


#: loggers of the simulated controller kept to CRITICAL while the planner runs it: its
#: trajectory failures and online-affinity decisions are the simulation's, not the user's
QUIET_LOGGERS = ("rollart.controller.rollout.tasks", "rollart.controller.routing.spill",
                 "rollart.controller.routing.workingset")


def run_capped(sim: SimScenario, seed: int, warmup: int, cap_s: float) -> SimResult | None:
    """``run_simulated(sim, seed)``, or None when it takes more than ``cap_s`` CPU seconds of
    this process (enforced by an ``ITIMER_PROF`` timer, SIGPROF, in the main thread; elsewhere
    not enforced) or its controller stalls (``ControllerStalledError``: e.g. trajectories past
    ``run.trajectory_timeout_s`` on a layout far too small for the load)."""
    # A stalled layout is dropped and counted; its controller's "fatal error in traj-..."
    # lines would read as the planner failing (the stall is logged at INFO below), and its
    # proxy's "affinity: ..." decisions as the user's run's.
    quiet = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL)
    try:
        return _run_timed(sim, seed, warmup, cap_s)
    except ControllerStalledError as exc:
        log.info("simulated layout stalled, dropped: %s", exc)
        return None
    finally:
        for lg, level in zip(quiet, levels, strict=True):
            lg.setLevel(level)


def _run_timed(sim: SimScenario, seed: int, warmup: int, cap_s: float) -> SimResult | None:
    if threading.current_thread() is not threading.main_thread():
        return run_simulated(sim, seed, warmup=warmup)

    overran: list[bool] = []

    def fire(signum: int, frame: Any) -> None:
        overran.append(True)
        # Stop the simulation's event loop rather than raise into it: an exception raised
        # inside one of its callbacks is only logged by the loop, and the run would go on.
        try:
            asyncio.get_running_loop().stop()
        except RuntimeError:  # between loops (set-up, teardown)
            raise _Overrun from None

    _quiet_overruns()
    # ITIMER_PROF counts this process's CPU time, as the budget does (``cpu_s``); a run
    # waiting on nothing is ended by the virtual clock's idle timeout, not by this timer.
    # A sampling profiler may own SIGPROF and ITIMER_PROF: both are handed back after the run.
    previous = signal.signal(signal.SIGPROF, fire)
    timer: tuple[float, float] = (0.0, 0.0)
    try:
        timer = signal.setitimer(signal.ITIMER_PROF, max(cap_s, 1e-3))
        try:
            return run_simulated(sim, seed, warmup=warmup)
        finally:
            signal.setitimer(signal.ITIMER_PROF, 0)
    except _Overrun:
        return None
    except RuntimeError:
        if overran:  # "Event loop stopped before Future completed."
            return None
        raise
    finally:
        signal.signal(signal.SIGPROF, previous)
        if timer != (0.0, 0.0):
            # a delay of 0 would disarm it: a periodic timer due now fires at once instead
            signal.setitimer(signal.ITIMER_PROF, max(timer[0], 1e-6), timer[1])


#: the longest search budget accepted, seconds (the run cap's timer takes finite values only)
MAX_BUDGET_S = 7 * 24 * 3600.0


def budget_words(budget_s: float, option: str = "budget_s") -> str:
    """The budget as its user gave it: ``--budget-s 5`` on the command line, ``budget_s=5``
    in a call (``option``: the name they typed)."""
    return given(option, f"{budget_s:g}")


def successive_halving(inputs: PlanInputs, *, budget_s: float, seeds: tuple[int, ...],
                       progress: Callable[[str], None] | None = None,
                       budget_option: str = "budget_s",
                       try_online_affinity: bool = True,
                       max_runs: int | None = None,
                       max_runs_option: str = "max_runs") -> tuple[list[Score], SearchLog]:
    """Scores of the last rung's candidates, best first, and what was run (module
    docstring). ``try_online_affinity``: where the scenario has ``[run.adaptive_affinity]``
    off, the last rung also runs the best layout of the one before, and its best with a larger
    trainer, with it on (each right after that layout, ``with_online_twins``), and the race
    weighs them like any others; ``log.online_affinity`` says how the best-ranked of them
    compared with its static twin. A run longer than ``STRAGGLER_X`` x the median of its
    rung's runs so far, or past its rung's share of the budget, is stopped and its candidate
    dropped (a run that stops advancing its virtual clock, or a layout whose engines queue
    long). Raises PlanError when ``budget_s`` is not in (0, ``MAX_BUDGET_S``] or cannot cover
    one simulated run, naming it ``budget_option`` (``"--budget-s"`` from the command line).

    ``max_runs``: the most simulated runs the search may make (a run that stalls counts). With
    it each rung stops before the run that would pass its ``RUNG_SHARES`` of them, the race may
    use the rest, and ``budget_s`` only ends the search: a plan whose runs end before
    ``budget_s`` does (and that no straggler rule stops) is the same on any machine, since the
    simulation is deterministic per seed. ``log.limited_by`` records which limits left
    candidates or seeds unrun. Raises PlanError when it is not a whole number >= 1, naming it
    ``max_runs_option``."""
    if max_runs is not None and (isinstance(max_runs, bool) or not isinstance(max_runs, int)
                                 or max_runs < 1):
        raise PlanError(f"{max_runs_option} must be a whole number >= 1, got {max_runs!r}")
    if not 0 < budget_s <= MAX_BUDGET_S:
        raise PlanError(f"{budget_option} must be > 0 and <= {MAX_BUDGET_S:g} (a week), got "
                        f"{budget_s:g}")
    if not seeds:
        raise PlanError("seeds: need at least one")
    t0, wall0 = cpu_s(), time.perf_counter()
    try_online = try_online_affinity and not inputs.scenario.run.adaptive_affinity.enabled
    first, pairs = space(inputs)
    # the scenario's own layout, then the rest fastest-predicted first (a budget that covers
    # part of the rung runs the part the cost model ranks best); the seeded shuffle orders ties
    rest = first[1:]
    random.Random(seeds[0]).shuffle(rest)
    rest.sort(key=lambda c: predicted_step_s(inputs, c))
    pending = [first[0], *rest]
    log = SearchLog(space=len(full_space(inputs)), first_rung_space=len(first))
    ranked: list[Score] = []
    walls: list[float] = []
    for rung, ((steps, _warmup), share) in enumerate(zip(RUNGS, RUNG_SHARES, strict=True)):
        rung_seeds = seeds if rung == len(RUNGS) - 1 else seeds[:1]
        # with ``max_runs`` the rung's share counts runs, and CPU seconds only end the search
        end = t0 + budget_s * (share if max_runs is None else 1.0)
        walls = []  # this rung's completed runs
        scores: list[Score] = []
        started, cut_before = 0, log.cut_runs
        log.phase = f"rung{rung}"
        for c in pending:
            now = cpu_s()
            est = statistics.median(walls) * len(rung_seeds) if walls else 0.0
            # the first run of the search always starts; a layout that stalled still counts;
            # at the share's end exactly a run would get no CPU at all
            if _stop(log, runs_past=bool(log.runs) and _past_runs(
                         log.runs + len(rung_seeds), max_runs, share),
                     budget_past=bool(scores or rung > 0) and (now >= end or now + est > end)):
                break
            started += 1
            first_ever = not scores and rung == 0
            if rung == 0:
                log.first_rung_started += 1
            log.online_affinity_started |= c.online_affinity
            score = _score(inputs, c, rung, rung_seeds, walls, log,
                           end=t0 + budget_s if first_ever else end)
            if score is not None:
                scores.append(score)
            elif first_ever and cpu_s() >= t0 + budget_s:
                raise PlanError(
                    f"{budget_words(budget_s, budget_option)} is too small: one simulated "
                    f"candidate ({steps} steps of batch {inputs.scenario.run.batch_size}) did "
                    f"not end within it; give a larger {budget_option}")
        if rung > 0:
            log.later_rungs.append((len(pending), len(pending) - started
                                    + log.cut_runs - cut_before, len(scores)))
        if not scores:  # this rung's share ran out: the previous rung's ranking stands
            break
        scores.sort(key=lambda s: (s.step_time_s, s.cost))
        noise.set_standard_errors(scores)
        ranked = scores
        log.per_rung.append(len(scores))
        keep = max(MIN_KEEP, math.ceil(len(scores) / ETA))
        kept = [scores[i] for i in noise.cut(scores, keep)]
        if progress:
            best = min(keep, len(scores))  # a rung may score fewer than it would keep
            progress(f"rung {rung}: {len(scores)} candidate(s) x {len(rung_seeds)} seed(s) "
                     f"at {steps} steps, best {scores[0].step_time_s:.1f} "
                     f"+- {scores[0].se_s:.1f} s/step, kept the best {best} and {len(kept) - best} "
                     f"within their noise, {cpu_s() - t0:.0f} CPU s used")
        survivors = [s.candidate for s in kept]
        if rung == 0:
            # each survivor at every alpha and redundancy, its own settings first (a rung
            # whose budget share runs out drops what it has not run: the leaders' variants
            # run first)
            survivors = list(dict.fromkeys(
                dataclasses.replace(c, alpha=a, redundancy=r) for c in survivors
                for a, r in [(c.alpha, c.redundancy), *pairs]))
        elif rung == 1 and try_online and survivors:
            # each layout online affinity is tried on, with it on right after it: the last
            # rung and the race then weigh it against its static twin like any two candidates
            survivors = with_online_twins(survivors)
            log.online_leader = survivors[0]
        pending = survivors
    if len(log.per_rung) == len(RUNGS):
        # runs cannot overrun the way seconds can: with ``max_runs`` the race may use them all
        ranked = _race(inputs, ranked, seeds, walls, log,
                       end=t0 + budget_s * (RUNG_SHARES[-1] if max_runs is None else 1.0),
                       progress=progress, max_runs=max_runs)
    log.cpu_s = cpu_s() - t0
    log.wall_s = time.perf_counter() - wall0
    if try_online and log.per_rung:
        _note_online_affinity(ranked, log)
    return ranked, log


def with_online_twins(survivors: list[Candidate]) -> list[Candidate]:
    """``survivors`` (best first) with a twin that has online affinity on right after the
    leader and right after the best survivor whose trainer is larger than the leader's, if
    one is. Online affinity shortens a step's rollout (spill to the pool with room, and the KV
    working-set hold keeping prefixes cached) and leaves the trainer's side as it is, so where
    it helps, the fastest layout with it can give the trainer more GPUs than the fastest
    static one (measured once on ``benchmarks.affinity --adaptive``'s H800 pool at load x8,
    GPUs moved between its trainer and rollout: fastest static with 3 trainer GPUs, fastest
    with online affinity with 6). Trying every survivor would cost the last rung as many runs
    again."""
    leader = survivors[0]
    larger = next((c for c in survivors[1:] if c.trainer_gpus > leader.trainer_gpus), None)
    tried = [leader] + ([larger] if larger is not None else [])
    out = []
    for c in survivors:
        out.append(c)
        if c in tried:
            out.append(dataclasses.replace(c, online_affinity=True))
    return out


def _stop(log: SearchLog, *, runs_past: bool, budget_past: bool) -> bool:
    """Whether a limit stops the search here; records each limit that does (both, when both
    do: either alone would stop it, so the user needs to raise both)."""
    if runs_past:
        _bound(log, "runs")
    if budget_past:
        _bound(log, "budget")
    return runs_past or budget_past


def _bound(log: SearchLog, limit: str) -> None:
    """Record that ``limit`` ("budget" or "runs") left something unrun in the current part
    of the search."""
    log.phase_limits.setdefault(log.phase, set()).add(limit)


def _past_runs(runs: int, max_runs: int | None, share: float) -> bool:
    """Whether ``runs`` simulated runs in all would pass ``share`` of ``max_runs``."""
    return max_runs is not None and runs > max_runs * share


def _note_online_affinity(ranked: list[Score], log: SearchLog) -> None:
    """Set ``log.online_affinity``: how the best-ranked layout with online affinity on
    compared with the same layout static, or that the budget did not reach it, or that the
    search ended (its later rounds' candidates stalled) before it."""
    on = next((s for s in ranked if s.candidate.online_affinity), None)
    if on is None and log.online_affinity_cut:
        log.online_affinity = ("online affinity on the best layouts of the second round: "
                               "stopped at the budget's end before a run with it on ended")
        log.online_affinity_short = True
        return
    if on is None and log.online_affinity_started:
        log.online_affinity = ("online affinity on the best layouts of the second round: no "
                               "run with it on ended (one stalled or overran its cap, dropped "
                               "like any such layout; any other ran out of budget): left off")
        return
    # the round before the last scored nothing: on stalls alone where no limit cut it
    if (on is None and len(log.per_rung) < len(RUNGS) and log.later_rungs
            and not log.later_rungs[-1][1]):
        log.online_affinity = ("online affinity was not tried: the search ended before its "
                               "last round, where it is tried (no candidate of the round "
                               "before ended)")
        return
    if on is None:
        log.online_affinity = ("online affinity was not tried on the best layout: the budget "
                               "ran out before it")
        log.online_affinity_short = True
        return
    twin = dataclasses.replace(on.candidate, online_affinity=False)
    static = next((s for s in ranked if s.candidate == twin), None)
    against = "" if static is None else (
        f" against {static.step_time_s:.1f} +- {static.se_s:.1f} static")
    chosen = ranked[0] is on
    which = ("the best layout of the second round" if log.online_leader == twin else
             f"the second round's best layout with a larger trainer ({twin.trainer_gpus} GPUs)")
    log.online_affinity = (
        f"online affinity on {which}: {on.step_time_s:.1f} +- "
        f"{on.se_s:.1f} s/step{against}: "
        + ("the plan turns it on ([run.adaptive_affinity] enabled = true)" if chosen
           else "not the plan's choice: left off"))


def _score(inputs: PlanInputs, c: Candidate, rung: int, seeds: tuple[int, ...],
           walls: list[float], log: SearchLog, *, end: float,
           into: Score | None = None) -> Score | None:
    """Candidate ``c`` run on every seed of ``seeds`` at ``rung``'s horizon (appended to
    ``into`` when given), or None when a run is stopped (past ``end``, a straggler of
    ``walls``) or stalls. Appends each completed run's CPU seconds to ``walls``."""
    steps, warmup = RUNGS[rung]
    times, samples, idle_s, busy_s = [], [], 0.0, 0.0
    for sd in seeds:
        cap = end - cpu_s()
        if len(walls) >= 2:
            cap = min(cap, STRAGGLER_X * statistics.median(walls))
        w0 = cpu_s()
        res = run_capped(sim_of(inputs, c, steps), sd, warmup, cap)
        log.runs += 1
        if res is None:
            if cpu_s() >= end:  # stopped by the budget, not stalled or a straggler
                _bound(log, "budget")
                log.first_rung_cut += rung == 0
                log.cut_runs += 1
                log.online_affinity_cut |= c.online_affinity
            return None
        walls.append(cpu_s() - w0)
        kept = res.steps[warmup:]
        times.append(res.step_time_s)
        samples += [s["step_time_s"] for s in kept]
        idle_s += sum(s["trainer_idle_s"] for s in kept)
        busy_s += sum(s["step_time_s"] for s in kept)
    if into is not None:
        times, samples = into.step_times_s + times, into.samples_s + samples
        idle_s, busy_s = into.idle_s + idle_s, into.busy_s + busy_s
    return Score(c, rung, times, idle_s / max(busy_s, 1e-9), c.cost(inputs), samples,
                 idle_s=idle_s, busy_s=busy_s)


def _unresolved(ranked: list[Score]) -> int:
    """How many of ``ranked`` (best first) are not yet resolved against the leader."""
    return len(noise.racers(ranked, len(ranked))) - 1


def _race(inputs: PlanInputs, ranked: list[Score], seeds: tuple[int, ...],
          walls: list[float], log: SearchLog, *, end: float,
          progress: Callable[[str], None] | None,
          max_runs: int | None = None) -> list[Score]:
    """The last rung's ``ranked`` with the leader and every candidate within its noise run on
    further common seeds (``max(seeds) + 1``, ...) while ``end`` allows and
    ``rollart.planner.noise.unresolved`` says so. A seed that does not end for every racer
    (past ``end``, a straggler) is left out for all of them, and the race ends: the seeds
    stay common. Best first."""
    rung = len(RUNGS) - 1
    log.phase = "race"
    for extra in range(max(seeds) + 1, max(seeds) + 1 + noise.MAX_RACE_SEEDS):
        group = noise.racers(ranked, noise.RACE_WIDTH)
        need = statistics.median(walls) * len(group) if walls else 0.0
        if len(group) < 2:
            break
        if _stop(log, runs_past=_past_runs(log.runs + len(group), max_runs, 1.0),
                 budget_past=cpu_s() + need > end):
            log.race_cut_racers = _unresolved(ranked)
            break
        racing = {id(ranked[i]) for i in group}
        out, cut_before = [], log.cut_runs
        for s in ranked:
            more = s if id(s) not in racing else _score(
                inputs, s.candidate, rung, (extra,), walls, log, end=end, into=s)
            if more is None:
                if log.cut_runs > cut_before:  # the budget's end, not a straggler
                    log.race_cut_racers = _unresolved(ranked)
                return ranked
            out.append(more)
        out.sort(key=lambda s: (s.step_time_s, s.cost))
        noise.set_standard_errors(out)
        ranked = out
        log.race_seeds += 1
        if progress:
            progress(f"race: seed {extra} on {len(racing)} candidate(s) within the noise of "
                     f"the best, best {ranked[0].step_time_s:.1f} +- {ranked[0].se_s:.1f} "
                     f"s/step")
    return ranked
