"""``affinity``: a sweep of equal-cost H800:H20 rollout pools on a prefill-heavy + decode-heavy
task mix (SIMULATED GPUs, REAL controller and LLM proxy, rollart mode).

Budget 72 H800 units (H20 = 1/3 H800, from the paper's own equal-cost pools: 64 H800 + 24 H20
= 72 H800); ``--quick`` uses an eighth (9 units). Every split ``h800 + 3 x (budget - h800)``
H20 is run (full size: every 8 H800; ``--quick``: 6 and 4 of 9, to stay within the CI time
budget; ``--reduced``: 8, 6, 4, 2 of 9): the two homogeneous ends (``h800_only``, ``h20_only``: both domains on the one
pool) and mixed splits with affinity (prefill-heavy agentic domain -> H800, decode-heavy
reasoning domain -> H20; 50/50 domain mix). The paper's 64:24 split is one of them at full
size. Ratios are step-time ratios on the same seed; the best mixed split is the one with the
lowest mean step time over seeds (a max over splits, so slightly optimistic), compared with the
homogeneous layouts. Paper Fig. 11a: affinity 1.30-1.68x vs H20-only, 1.12-1.37x vs H800-only.

Every layout's row reports its regime (``benchmarks.modes.regime_of``, over the steps after the
first): ``rollout_share`` (a batch's rollout seconds / step seconds; rollart overlaps rollout
with training, so it can exceed 1), ``trainer_idle_share`` (high: rollout-bound, low:
trainer-bound), ``util_<pool>`` (engine busy seconds / (run seconds x engines) per pool),
``prefix_hit_share`` (prompt tokens served from the prefix cache), ``stale_waste_share``
(generated tokens discarded as stale) and ``trained_tokens`` per step. Sync+'s rollout share (the paper's "rollout share") is not run
here: ``modes`` and the ``staleness`` alpha 0 row report it for the paper's cluster.

Real nodes: ``--scenario FILE`` (``benchmarks.on_scenario``) sweeps pool layouts of that
scenario instead (rollart mode, its own alpha and domains). The scenario has exactly two pools
of local workers (a pool given by worker addresses has a fixed size: refused); each pool costs
``--cost LABEL=UNITS`` per worker by its hardware label (default h800 1, h20 1/3 as above,
anything else 1). The budget is the scenario's own layout's cost; the layouts are both
homogeneous ends (``<pool>_only``: that pool alone with as many workers as the budget buys, every
domain on it) and every mixed split ``<a>x<pool A>+<b>x<pool B>`` with at least one worker per
pool that spends the budget (domains on their declared pools: affinity), or only the splits
named by ``--splits A B ...`` (workers of pool A). Same rows, ratios (``best mixed vs best
<pool>_only``) and ci95 with ``--seeds`` >= 2. On one machine whose pools share the same CPUs
(hardware ``cpu``) a layout changes only how many engines serve which domain, not the hardware,
so it measures routing and isolation, not hardware affinity.

``--adaptive``: rollart's online affinity (``[run.adaptive_affinity]``, its defaults: spill
between pools and the KV working-set hold) on the layout rollart chooses, against the best
static layout of the same budget, at load x1, x2 and x8 (trajectories per step times the
benchmark's batch, same pools) and under a drifting task mix (the agentic domain's share of new
groups 30% -> 70% a third of the way in, load x2), over the splits of the sweep above with
the benchmark's trainer. rollart's choice: every split run with online affinity on seeds of
its own (``SEARCH_SEED_OFFSET`` + the evaluation seeds), the fastest kept: what the planner
finds with no budget limit in this space, chosen on data the score does not use. The
trainer's size is not searched here: with it, 20 layouts at ``--quick``, three seeds of its
own do not find the fastest (at load x8 such a pick takes a third longer on the scoring
seeds than on its own), while the best static is the minimum of 20 on the scoring seeds
themselves; the re-planning bound below covers those sizes. The best static layout is the
fastest static one on the evaluation seeds themselves (a minimum over layouts, biased
towards static). Ratios ``adaptive
vs best static at load xK`` / ``under drift`` (best static's step time over adaptive's, per
seed; the mean step time after the first, as everywhere); the same ``(whole run)``: the mean of
every step, the first included (the best static layout chosen again by that measure), since a
run's first burst starts every trajectory of its first steps at once and a hold that shortens
the first step moves work into the second; the same ``(per trained token)``: seconds per
trained token (the step mean over the mean trained tokens of the same steps; the best static
layout chosen again by that measure), since a hold that lets short trajectories finish first
fills a step's batch with fewer tokens and shortens the step without doing the same work;
``adaptive vs static on its layout (<layout>)`` (the chosen layout without online affinity);
``adaptive on <paper layout> vs best static`` and ``adaptive vs static <paper layout>`` (online
affinity on the paper's split, the first mixed one); ``adaptive vs static on the best mixed
split``: online affinity on the fastest mixed split of each case against that split static
(where the split is already right, adaptive must not cost). Rows count spilled trajectories,
moves, first turns the working-set hold delayed and turns that found their prefix evicted, and
report each run's regime as above and the trainer's GPUs.

``best layout per drift phase vs best static under drift (bound on re-planning)``: an
estimate of the most that re-planning among these layouts could gain under the drift. Every
layout of ``replan_space`` (every split of the sweep with the trainer from half to 1.5x the
benchmark's size, GPUs moved between trainer and rollout at the same cost) runs static on
each phase's mix alone; the best single layout's step time (each phase weighted by its steps
in the drifting run's step mean) over that of switching to each phase's best layout at the
drift, at no cost and knowing the drift in advance, the layouts chosen on the scoring seeds
themselves. Where it reads near 1.0, the
same layout is (nearly) best in both phases, and switching among these layouts cannot gain
more. Not covered: other tensor-parallel degrees or alphas, and online admission (the hold),
which is not a layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.common import main_for, mean_rows, result, seeds_for, small, summarize
from benchmarks.modes import regime_of
from benchmarks.on_scenario import mean_after_first, scenario_main, steps_for, train
from benchmarks.plan import SEARCH_SEED_OFFSET
from benchmarks.workloads import agentic, reasoning
from rollart.sim.harness import SimDomain, SimPool, SimScenario, run_simulated

NAME = "affinity"
#: H800 counts of the mixed splits at full size (budget 72); quick divides by 8
FULL_SPLITS = (64, 56, 48, 40, 32, 24, 16, 8)
QUICK_SPLITS = (6, 4)
#: ``--reduced`` (full-size steps on the quick budget of 9 units): every second split
REDUCED_SPLITS = (8, 6, 4, 2)


def scenario(h800: int, h20: int, quick: bool) -> SimScenario:
    pools = tuple(SimPool(hw, hw, n, max_batch=128) for hw, n in (("h800", h800), ("h20", h20))
                  if n)
    # 1 s env steps: ASSUMED, a lighter env than ``workloads.agentic``'s default (see the
    # scale references beside ``workloads.AGENTIC_STEP_LATENCY_S``).
    pre, dec = agentic(latency_mean_s=1.0, latency_std_s=1.0), reasoning()
    if h800 and h20:
        domains = (SimDomain(pre, "h800"), SimDomain(dec, "h20"))
    else:
        only = pools[0].name
        domains = (SimDomain(pre, only), SimDomain(dec, only))
    scale = 8 if small(quick) else 1
    return SimScenario(pools=pools, domains=domains, model="qwen3-8b", mode="rollart",
                       steps=3 if quick else 11, batch_size=512 // scale, group_size=8,
                       trainer_gpus=32 // scale, max_tokens_per_turn=16384,
                       max_tokens_per_trajectory=32768)


def layouts(quick: bool) -> dict[str, tuple[int, int]]:
    budget = 9 if small(quick) else 72
    out = {"h800_only": (budget, 0), "h20_only": (0, 3 * budget)}
    for h800 in QUICK_SPLITS if quick else REDUCED_SPLITS if small(quick) else FULL_SPLITS:
        out[f"{h800}xh800+{3 * (budget - h800)}xh20"] = (h800, 3 * (budget - h800))
    return out


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, times = [], {}
    for layout, (h800, h20) in layouts(quick).items():
        for sd in seeds:
            sim = scenario(h800, h20, quick)
            res = run_simulated(sim, sd)
            times.setdefault(layout, []).append(res.step_time_s)
            busy = [w["busy_s"] / res.total_time_s for w in res.workers.values()]
            rows.append({"layout": layout, "h800": h800, "h20": h20,
                         "cost_h800_units": h800 + h20 / 3, "step_time_s": res.step_time_s,
                         "rollout_time_s": statistics.fmean(s["rollout_time_s"]
                                                            for s in res.steps[1:]),
                         "mean_engine_busy": statistics.fmean(busy), **regime_of(sim, res)})
    best, samples = _best_mixed(times, ("h20_only", "h800_only"))
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("layout",)), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes=f"best mixed split: {best}; paper: 1.30-1.68x vs H20-only, "
                  "1.12-1.37x vs H800-only (Fig. 11a)")


#: load multipliers of ``--adaptive`` (trajectories per step x the benchmark's own batch)
LOADS = (1, 2, 8)
#: ``--adaptive``'s drift: the prefill-heavy (agentic) domain's share of new groups goes from
#: 30% to 70% after step ``steps // 3``, at load x2
DRIFT = (0.3, 0.7)
DRIFT_LOAD = 2


def _adaptive_config() -> Any:
    from rollart.config import AdaptiveAffinityConfig

    return AdaptiveAffinityConfig(enabled=True)  # its documented defaults: nothing tuned here


def _mixed(sc: SimScenario, agentic_share: float) -> SimScenario:
    """``sc`` with the agentic domain at ``agentic_share`` of new groups, reasoning the rest."""
    return sc.replace(domains=tuple(
        dataclasses.replace(d, weight=agentic_share if d.spec.name == "agentic"
                            else 1 - agentic_share) for d in sc.domains))


def _drift_steps(steps: int) -> tuple[int, int, int]:
    """A drifting run built from a ``steps``-step scenario: (its steps, the step the mix
    changes at, the steps of the step mean (all after the first) that come before it)."""
    total = 2 * steps
    after = total // 3
    return total, after, after - 1


def _drifting(sc: SimScenario) -> SimScenario:
    """``sc`` with the agentic domain at ``DRIFT[0]`` of the mix, then ``DRIFT[1]``."""
    lo, hi = DRIFT
    steps, after, _ = _drift_steps(sc.steps)
    return _mixed(sc, lo).replace(steps=steps, weight_changes=(
        (after, "agentic", hi), (after, "reasoning", 1 - hi)))


def replan_space(quick: bool) -> dict[str, tuple[int, int, int]]:
    """The layouts the re-planning bound under drift chooses from: name -> (rollout H800s,
    rollout H20s, trainer GPUs). Every split of the sweep with the trainer from half to 1.5x
    the benchmark's size, a quarter of it apart (the planner searches the trainer vs rollout
    split too). Each trainer GPU added is taken from the layout's rollout H800s, or 3 of its
    H20s where it has none (H20 = 1/3 H800, as the budget), and each removed given back the
    same way, so every layout costs the same; a mixed split that would keep no rollout H800
    is left out at that trainer size."""
    trainer = scenario(1, 0, quick).trainer_gpus
    space: dict[str, tuple[int, int, int]] = {}
    for name, (h800, h20) in layouts(quick).items():
        for t in range(trainer // 2, trainer * 3 // 2 + 1, max(1, trainer // 4)):
            a, b = (h800 + trainer - t, h20) if h800 else (0, h20 + 3 * (trainer - t))
            if h800 and a < 1:
                continue
            if t == trainer:
                space[name] = (a, b, t)
            elif a and b:
                space[f"{a}xh800+{b}xh20, trainer {t}"] = (a, b, t)
            else:
                space[f"{name}, trainer {t}"] = (a, b, t)
    return space


def _replan_bound(rows: list[dict[str, Any]], quick: bool, seeds: list[int]) -> list[float]:
    """Per seed, the best single layout of ``replan_space`` over the best layout of each drift
    phase, both weighted by the phase's steps in the drifting run's step mean. Each layout runs
    static on each phase's mix alone (``DRIFT[0]``, then ``DRIFT[1]``, load ``DRIFT_LOAD``,
    the benchmark's steps, the step mean after the first). A re-planner that switched among
    these layouts, to each phase's best at the drift, for free and in advance, would gain this
    over the best static one (the layouts chosen by their mean over ``seeds``, the scoring
    seeds: an estimate, not a strict bound)."""
    phase_times: list[dict[str, list[float]]] = [{}, {}]
    for name, (h800, h20, trainer) in replan_space(quick).items():
        for phase, share in enumerate(DRIFT):
            for sd in seeds:
                sc = scenario(h800, h20, quick)
                sc = _mixed(sc, share).replace(batch_size=sc.batch_size * DRIFT_LOAD,
                                               trainer_gpus=trainer)
                res = run_simulated(sc, sd)
                phase_times[phase].setdefault(name, []).append(res.step_time_s)
                rows.append({"case": f"drift phase: agentic share {share}", "layout": name,
                             "trainer_gpus": trainer, "step_time_s": res.step_time_s,
                             **regime_of(sc, res)})
    steps, _, before = _drift_steps(scenario(1, 0, quick).steps)
    weights = (before, steps - 1 - before)

    def weighted(before_s: list[float], after_s: list[float]) -> list[float]:
        return [(weights[0] * a + weights[1] * b) / sum(weights)
                for a, b in zip(before_s, after_s, strict=True)]

    best_per_phase = weighted(*(min(times.values(), key=statistics.fmean)
                                for times in phase_times))
    single = {k: weighted(phase_times[0][k], phase_times[1][k]) for k in phase_times[0]}
    best_single = min(single.values(), key=statistics.fmean)
    return [s / p for s, p in zip(best_single, best_per_phase, strict=True)]


def _measure(rows: list[dict[str, Any]], times: dict[str, list[float]], case: str, load: int,
             drift: bool, layout: str, split: tuple[int, int, int], on: str, seeds: list[int],
             quick: bool, run_times: dict[str, list[float]] | None = None,
             token_times: dict[str, list[float]] | None = None) -> None:
    """Runs ``layout`` on split ``on`` (``split``: rollout H800s, rollout H20s, trainer GPUs)
    over ``seeds``: static when
    ``layout == on``, else with online affinity; appends its step times (after the first
    step), its whole-run times per step (``run_times``, first step included), its seconds per
    trained token (``token_times``: the step mean over the trained tokens' mean, both after
    the first step) and rows."""
    h800, h20, trainer = split
    for sd in seeds:
        sc = scenario(h800, h20, quick)
        sc = sc.replace(batch_size=sc.batch_size * load, trainer_gpus=trainer)
        if drift:
            sc = _drifting(sc)
        if layout != on:
            sc = sc.replace(adaptive_affinity=_adaptive_config())
        res = run_simulated(sc, sd)
        times.setdefault(layout, []).append(res.step_time_s)
        whole = statistics.fmean(st["step_time_s"] for st in res.steps)
        if run_times is not None:
            run_times.setdefault(layout, []).append(whole)
        regime = regime_of(sc, res)
        if token_times is not None:
            token_times.setdefault(layout, []).append(
                res.step_time_s / max(regime["trained_tokens"], 1.0))
        # Online affinity's counts only where it ran (static runs do not count evictions).
        counts = {} if layout == on else {
            "spilled": sum(sum(st.get("num_spilled_by_domain", {}).values())
                           for st in res.steps),
            "moves": sum(len(st.get("affinity_moves", [])) for st in res.steps),
            "kv_admission_waits": sum(st.get("num_kv_admission_waits", 0) for st in res.steps),
            "prefix_evicted_turns": sum(st.get("num_prefix_evicted_turns", 0)
                                        for st in res.steps)}
        rows.append({"case": case, "layout": layout if layout == on else f"adaptive on {on}",
                     "trainer_gpus": trainer, "step_time_s": res.step_time_s,
                     "run_time_per_step_s": whole, **counts,
                     **regime})


def run_adaptive(quick: bool, seed: int) -> dict:
    """rollart's layout choice with online affinity vs the best static layout of the same
    budget (module docstring, ``--adaptive``)."""
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    choose_on = [SEARCH_SEED_OFFSET + s for s in seeds]
    trainer = scenario(1, 0, quick).trainer_gpus
    all_layouts = {k: (h800, h20, trainer) for k, (h800, h20) in layouts(quick).items()}
    paper = next(k for k, split in all_layouts.items() if all(split[:2]))
    rows: list[dict[str, Any]] = []
    samples: dict[str, list[float]] = {}
    chosen: dict[str, str] = {}
    cases = [(f"load x{k}", k, False) for k in LOADS] + [("drift", DRIFT_LOAD, True)]
    for case, load, drift in cases:
        times: dict[str, list[float]] = {}
        run_times: dict[str, list[float]] = {}
        token_times: dict[str, list[float]] = {}

        def measure(layout: str, on: str, seeds: list[int] = seeds, case: str = case,
                    load: int = load, drift: bool = drift,
                    times: dict[str, list[float]] = times,
                    run_times: dict[str, list[float]] = run_times,
                    token_times: dict[str, list[float]] = token_times) -> None:
            _measure(rows, times, case, load, drift, layout, all_layouts[on], on, seeds, quick,
                     run_times, token_times)

        for layout in all_layouts:
            measure(layout, layout)
        # rollart's own choice: every layout with online affinity on seeds of its own, the
        # fastest kept (what the planner finds with no budget limit in this space), then
        # scored like the static layouts on the evaluation seeds.
        trial: dict[str, list[float]] = {}
        for layout in all_layouts:
            _measure([], trial, case, load, drift, layout, all_layouts[layout], "", choose_on,
                     quick)
        pick = min(trial, key=lambda k: statistics.fmean(trial[k]))
        chosen[case] = pick
        rows.append({"case": case, "layout": f"chosen with online affinity: {pick}",
                     "step_time_s_choice_seeds": statistics.fmean(trial[pick])})
        measure("adaptive", pick)
        if pick != paper:
            measure("adaptive on paper", paper)
        on_paper = times["adaptive" if pick == paper else "adaptive on paper"]
        static = list(all_layouts)
        best = min(static, key=lambda k: statistics.fmean(times[k]))
        # Where the split is already right, online affinity must not cost: adaptive on the
        # fastest mixed split against that split static.
        mixed = min((k for k in static if all(all_layouts[k][:2])),
                    key=lambda k: statistics.fmean(times[k]))
        if mixed == pick:
            on_mixed = times["adaptive"]
        elif mixed == paper:
            on_mixed = on_paper
        else:
            measure("adaptive on best mixed", mixed)
            on_mixed = times["adaptive on best mixed"]
        samples[f"adaptive vs static on the best mixed split ({mixed}) at {case}"] = [
            b / a for b, a in zip(times[mixed], on_mixed, strict=True)]
        name = f"adaptive vs best static at {case}" if not drift else \
            "adaptive vs best static under drift"
        samples[name] = _vs_best_static(static, times)
        # The same over the whole run, its first step included: a run's first burst (every
        # trajectory of the first steps started at once) is a cost every run pays, and work
        # it moves from the first step into the second would count against the step mean.
        samples[f"{name} (whole run)"] = _vs_best_static(static, run_times)
        # Like with like: a hold that lets short trajectories finish first fills a step's
        # batch with fewer tokens, which shortens the step without doing the same work.
        samples[f"{name} (per trained token)"] = _vs_best_static(static, token_times)
        samples[f"adaptive on {paper} vs best static at {case}"] = [
            b / a for b, a in zip(times[best], on_paper, strict=True)]
        samples[f"adaptive vs static {paper} at {case}"] = [
            b / a for b, a in zip(times[paper], on_paper, strict=True)]
        samples[f"adaptive vs static on its layout ({pick}) at {case}"] = [
            b / a for b, a in zip(times[pick], times["adaptive"], strict=True)]
        rows.append({"case": case, "layout": f"best static: {best}",
                     "step_time_s": statistics.fmean(times[best])})
    samples["best layout per drift phase vs best static under drift (bound on re-planning)"] = \
        _replan_bound(rows, quick, seeds)
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("case", "layout")),
                  ratios=ratios, ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes=f"adaptive: online affinity ([run.adaptive_affinity] defaults: spill "
                  f"and the KV working-set hold) on the layout rollart chooses, the fastest "
                  f"with it on seeds {choose_on} (chosen: "
                  + ", ".join(f"{c}: {k}" for c, k in chosen.items())
                  + f"), scored on seeds {seeds}; best static: the fastest static layout of "
                  f"the same budget on the scoring seeds themselves (a minimum over layouts, "
                  f"biased towards static); the paper's layout: {paper}; drift: agentic share "
                  f"{DRIFT[0]} -> {DRIFT[1]} at load x{DRIFT_LOAD}")


def _vs_best_static(static: list[str], per_layout: dict[str, list[float]]) -> list[float]:
    """Per seed, the static layout with the lowest mean of ``per_layout`` (seconds per step,
    or per trained token) over ``"adaptive"``'s."""
    best = min(static, key=lambda k: statistics.fmean(per_layout[k]))
    return [b / a for b, a in zip(per_layout[best], per_layout["adaptive"], strict=True)]


def _best_mixed(times: dict[str, list[float]], ends: tuple[str, str]
                ) -> tuple[str, dict[str, list[float]]]:
    """The mixed layout with the lowest mean step time and the per-seed ratios: ``best mixed
    vs best <end>`` for both homogeneous ``ends`` and ``<layout> vs <ends[0]>`` per mixed
    layout. Raises ValueError when no mixed layout was run."""
    mixed = [k for k in times if k not in ends]
    if not mixed:
        raise ValueError(f"no mixed layout among {sorted(times)}")
    best = min(mixed, key=lambda k: statistics.fmean(times[k]))
    samples = {f"best mixed vs best {end}": [b / m for b, m in zip(times[end], times[best],
                                                                   strict=True)]
               for end in ends}
    for k in mixed:
        samples[f"{k} vs {ends[0]}"] = [b / m for b, m in zip(times[ends[0]], times[k],
                                                              strict=True)]
    return best, samples


#: cost of one worker per hardware label, in H800 units (H20 = 1/3: the paper's equal-cost
#: pools, 64 H800 + 24 H20 = 72 H800 units, §7); labels not listed cost 1
DEFAULT_COSTS = {"h800": 1.0, "h20": 1.0 / 3.0}


def scenario_layouts(base: Any, costs: dict[str, float], splits: list[int] | None
                     ) -> dict[str, Any]:
    """Equal-cost layouts of ``base``'s two pools (see the module docstring): name ->
    unvalidated ``Scenario``. Raises ValueError if ``base`` has not exactly two pools, a pool
    is given by addresses, or no mixed split fits the budget."""
    if len(base.pools) != 2:
        raise ValueError(f"affinity --scenario needs exactly two pools, got "
                         f"{[p.name for p in base.pools]}")
    fixed = [p.name for p in base.pools if p.addresses]
    if fixed:
        raise ValueError(f"pools {fixed} are given by worker addresses: a layout changes a "
                         "pool's worker count, which only local pools allow")
    a, b = base.pools
    cost = [costs.get(p.hardware, 1.0) for p in (a, b)]
    budget = a.num_workers * cost[0] + b.num_workers * cost[1]

    def fits(units: float, unit_cost: float) -> int:
        return math.floor(units / unit_cost + 1e-9)

    out: dict[str, Any] = {}
    for pool, unit_cost in ((a, cost[0]), (b, cost[1])):
        n = fits(budget, unit_cost)
        doms = [msgspec.structs.replace(d, pool=pool.name) for d in base.domains]
        out[f"{pool.name}_only"] = msgspec.structs.replace(
            base, pools=[msgspec.structs.replace(pool, num_workers=n)], domains=doms)
    wanted = splits if splits is not None else range(1, fits(budget, cost[0]) + 1)
    for na in wanted:
        nb = fits(budget - na * cost[0], cost[1])
        if na < 1 or nb < 1:
            continue
        out[f"{na}x{a.name}+{nb}x{b.name}"] = msgspec.structs.replace(
            base, pools=[msgspec.structs.replace(a, num_workers=na),
                         msgspec.structs.replace(b, num_workers=nb)])
    if len(out) == 2:
        raise ValueError(f"no mixed split of {a.name}:{b.name} fits the budget {budget:g} "
                         f"(splits {list(wanted)})")
    return out


def run_on_scenario(path: Path, quick: bool, seed: int, *, num_seeds: int, cache_dir: Path,
                    run_dir: Path, args: argparse.Namespace) -> dict:
    """Step time of every equal-cost layout of the REAL scenario at ``path`` (rollart mode);
    raises ValueError for a scenario without two local pools, else what ``open_cluster``
    raises (ConfigError, ProcessFailedError, ...)."""
    from benchmarks.modes import scenario_for_mode
    from rollart.config import load_scenario

    started = time.perf_counter()
    base = load_scenario(path)
    costs = {**DEFAULT_COSTS, **dict(args.cost or [])}
    layouts_ = scenario_layouts(base, costs, args.splits)
    ends = tuple(f"{p.name}_only" for p in base.pools)
    seeds = [seed + i for i in range(num_seeds)]
    rows, times = [], {}
    for layout, sc in layouts_.items():
        for sd in seeds:
            variant = scenario_for_mode(sc, "rollart", seed=sd,
                                        steps=steps_for(quick, base, args))
            steps = train(variant, run_dir / f"{layout}-{sd}", cache_dir, str(path))
            times.setdefault(layout, []).append(mean_after_first(steps, "step_time_s"))
            rows.append({"layout": layout,
                         **{f"workers_{p.name}": p.num_workers for p in sc.pools},
                         "cost_units": sum(p.num_workers * costs.get(p.hardware, 1.0)
                                           for p in sc.pools),
                         "step_time_s": times[layout][-1],
                         "rollout_time_s": mean_after_first(steps, "rollout_time_s")})
    best, samples = _best_mixed(times, ends)  # type: ignore[arg-type]
    ratios, ci = summarize(samples)
    return result(NAME, simulated=False, rows=mean_rows(rows, ("layout",)), ratios=ratios,
                  ci95=ci, seeds=seeds, quick=quick, seed=seed, started=started,
                  notes=f"measured wall clock, real services of {path}; best mixed split: "
                  f"{best}; worker costs {costs}")


def _cost(text: str) -> tuple[str, float]:
    label, sep, units = text.partition("=")
    try:
        value = float(units)
    except ValueError:
        value = math.nan
    if not sep or not label or not value > 0:
        raise argparse.ArgumentTypeError(f"takes LABEL=UNITS with UNITS > 0, got {text!r}")
    return label, value


def _scenario_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost", nargs="+", type=_cost, default=None, metavar="LABEL=UNITS",
                        help="cost of one worker per hardware label (default h800=1 h20=0.333, "
                        "others 1)")
    parser.add_argument("--splits", type=int, nargs="+", default=None,
                        help="workers of the first pool in the mixed layouts (default: all)")


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--adaptive" in argv:
        argv.remove("--adaptive")
        return main_for(NAME, __doc__ or "", run_adaptive, argv)
    return scenario_main(NAME, argv, lambda rest: main_for(NAME, __doc__ or "", run, rest),
                         run_on_scenario, _scenario_args)


if __name__ == "__main__":
    main()
