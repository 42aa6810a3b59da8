"""``plan``: the layout planner (``rollart plan``) against the best layout of an exhaustive
sweep and against the paper's layout, in three regimes (SIMULATED GPUs, REAL controller).

The cluster is the paper's, halved twice over (``benchmarks.modes.regime_base`` with
``--quick``: 6 H800 + 2 H20, Qwen3-8B, batch 32; without: the eighth, 12 H800 + 4 H20,
batch 64), rollart mode, the prefill-heavy agentic + decode-heavy reasoning mix
(``benchmarks.workloads``). Regimes:

- ``rollout-bound``: the paper's workload (the trainer waits ~70% of a step on the paper's
  layout);
- ``trainer-bound``: reasoning responses a quarter as long (mean 1000 tokens) and env steps
  10x faster (the trainer waits ~30%);
- ``loaded``: the paper's workload at load x8 (8x the trajectories per step).

``--modes rollart,one_off,areal,sync_plus`` runs the same for each mode named (default
rollart only; any of ``benchmarks.modes.MODES``): a baseline runs the same cluster and
workload with its own staleness rule and the policy the baselines run with in
``benchmarks.modes`` (lazy: ``staleness_waste.POLICIES["lazy"]``; re-prefill where it applies
weights under in-flight trajectories). AReaL keeps the per-domain pools here (the planner's
space: one pool per hardware label), not the one homogeneous pool ``benchmarks.modes`` gives
it; modes without alpha (sync, sync_plus, one_off) search the split and mapping only, and
their paper layout has their own alpha.

In each, ``rollart.planner.plan`` searches the layouts of that inventory (trainer GPUs, a
pool per hardware label, each domain's pool, alpha 1-2, redundancy 0-1; ``--quick``:
redundancy 0 only) by successive
halving within ``--budget-s`` (per regime; default 30 with ``--quick``, 120 without) on
its own seeds (1000 + seed, ...), never the evaluation seeds. The exhaustive sweep runs
every layout of the same space on the planner's last-rung horizon, on the planner's seeds and
on every evaluation seed. Its best is the layout with the lowest mean step time on the
planner's seeds: the layout the search would find with no budget, chosen on the same data,
and scored like the plan on the evaluation seeds it was not chosen on. The lowest mean on the
evaluation seeds themselves is reported too (``sweep's in-sample minimum``): a minimum over
many noisy means scored on the seeds that chose it, so it is biased low (optimistic for the
sweep) by as much as the layouts' run-to-run noise. The paper's layout is the inventory as
``paper_cluster`` splits it (trainer GPUs, agentic -> H800, reasoning -> H20, alpha 1, no
redundancy).

Ratios, per evaluation seed and then mean with ``ci95`` (for a mode other than rollart the
names end in ``, <mode>``): ``plan vs exhaustive best:
<regime>`` (the best layout's step time over the planner's choice's: 1.0 = it found the
best; goal >= 0.95; layouts whose simulated run did not end within 20x the median run are
left out of the sweep and counted in ``sweep_stopped``), ``plan vs sweep's in-sample minimum:
<regime>`` (the same against the optimistic minimum above) and ``plan vs paper layout:
<regime>`` (> 1: the planner's layout is faster than the paper's). Rows: the planner's
choice, the exhaustive best, the in-sample minimum and the paper's layout per regime, with
step time on the evaluation seeds, the share of GPUs rolling out, the trainer's idle share of
a step and cost, and the planner's CPU and wall seconds (its budget counts CPU seconds, as
``rollart plan``'s does).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any

import msgspec

from benchmarks.common import main_for, mean_rows, result, seeds_for, summarize
from benchmarks.modes import MODES, REPREFILL_MODES, regime_base
from benchmarks.staleness_waste import POLICIES
from benchmarks.workloads import reasoning
from rollart.planner import plan
from rollart.planner.search import RUNGS, Candidate, cpu_s, full_space, run_capped, sim_of
from rollart.sim.harness import MODE_ALPHA, SimScenario, scenario_of

NAME = "plan"
MODEL = "qwen3-8b"
#: per-regime planner budget (CPU seconds) with and without ``--quick``
QUICK_BUDGET_S, FULL_BUDGET_S = 30.0, 120.0
REGIMES = ("rollout-bound", "trainer-bound", "loaded")
#: ``--quick`` searches (and sweeps) redundancy 0 only, halving the exhaustive sweep
QUICK_REDUNDANCIES = (0,)
#: a sweep run is stopped after this many times the sweep's median run (at least
#: ``SWEEP_CAP_MIN_S``; CPU seconds): a run that never ends (a controller that stops advancing the clock)
#: must not stall the benchmark; its layout is left out of the sweep and counted
SWEEP_CAP_X, SWEEP_CAP_MIN_S = 20.0, 30.0
#: the planner's search seeds: offset from the evaluation seeds
SEARCH_SEED_OFFSET = 1000

_BUDGET: list[float | None] = [None]
#: the modes ``--modes`` names
_MODES: list[tuple[str, ...]] = [("rollart",)]


def regime(name: str, quick: bool, mode: str = "rollart") -> SimScenario:
    """The simulated cluster and workload of regime ``name`` in ``mode`` (module docstring)."""
    base = regime_base(MODEL, "rollart", quick)
    if mode != "rollart":
        base = base.replace(mode=mode, reprefill=mode in REPREFILL_MODES, **POLICIES["lazy"])
    if name == "rollout-bound":
        return base
    if name == "trainer-bound":
        doms = []
        for d in base.domains:
            spec = d.spec
            if spec.name == "reasoning":
                spec = reasoning(mean_len=1000, std_len=750)
            else:
                lat = spec.step_latency_s
                spec = dataclasses.replace(spec, step_latency_s=dataclasses.replace(
                    lat, mean=lat.mean / 10, std=lat.std / 10))
            doms.append(dataclasses.replace(d, spec=spec))
        return base.replace(domains=tuple(doms))
    if name == "loaded":
        return base.replace(batch_size=8 * base.batch_size)
    raise ValueError(f"unknown regime {name!r}; known: {REGIMES}")


def as_scenario(sim: SimScenario) -> Any:
    """``sim`` as the ``rollart.config.Scenario`` the planner reads (the trainer's GPUs as its
    ranks)."""
    sc = scenario_of(sim, 0)
    return msgspec.structs.replace(sc, trainer=msgspec.structs.replace(
        sc.trainer, num_processes=sim.trainer_gpus))


def paper_candidate(sim: SimScenario) -> Candidate:
    """The paper's layout of ``sim`` as a planner candidate (alpha 1, or the mode's own)."""
    by_pool = {p.name: p.hardware for p in sim.pools}
    alpha = MODE_ALPHA.get(sim.mode)
    return Candidate(sim.trainer_gpus, tuple(by_pool[d.pool] for d in sim.domains),
                     1 if alpha is None else alpha, 0)


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    budget = _BUDGET[0] or (QUICK_BUDGET_S if quick else FULL_BUDGET_S)
    steps = RUNGS[-1][0]
    rows: list[dict[str, Any]] = []
    samples: dict[str, list[float]] = {}
    for mode in _MODES[0]:
        for name in REGIMES:
            _one(mode, name, quick, seed, seeds, budget, rows, samples)
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("mode", "regime", "layout")),
                  ratios=ratios, ci95=ci, seeds=seeds, quick=quick, seed=seed,
                  started=started, notes=f"modes {', '.join(_MODES[0])}, {MODEL}; planner "
                  f"budget {budget:g} s per regime on seeds {SEARCH_SEED_OFFSET + seed}+; "
                  f"exhaustive: every layout of the planner's space at {steps} steps, its "
                  f"best chosen on the planner's seeds and scored on the evaluation seeds")


def _one(mode: str, name: str, quick: bool, seed: int, seeds: list[int], budget: float,
         rows: list[dict[str, Any]], samples: dict[str, list[float]]) -> None:
    """Regime ``name`` in ``mode``: the plan, the sweep and the paper's layout; appends its
    rows and per-seed ratios."""
    steps, warmup = RUNGS[-1]
    tag = "" if mode == "rollart" else f", {mode}"
    sim = regime(name, quick, mode)
    profiles = {d.spec.name: d.spec for d in sim.domains}
    sc = as_scenario(sim)
    t0 = time.perf_counter()
    reds = QUICK_REDUNDANCIES if quick else None
    search_seeds = (SEARCH_SEED_OFFSET + seed, SEARCH_SEED_OFFSET + seed + 1)
    # like with like: the sweep and the paper's layout run static, so the plan does too
    res = plan(sc, budget_s=budget, model=MODEL, profiles=profiles, redundancies=reds,
               seeds=search_seeds, try_online_affinity=False)
    plan_cpu, plan_wall = res.log.cpu_s, res.log.wall_s  # the search's own span
    inputs, chosen = res.inputs, res.best.candidate
    layouts = full_space(inputs)
    paper = paper_candidate(sim)
    if paper not in layouts or res.best.candidate not in layouts:
        raise RuntimeError(f"{name}{tag}: the paper's or the planner's layout is not in the "
                           f"sweep ({paper}, {res.best.candidate})")
    # times on the planner's seeds (to choose the sweep's best) and on the evaluation seeds
    # (to score every choice), each in seed order
    chose_on: dict[Candidate, list[float]] = {}
    times: dict[Candidate, list[float]] = {}
    idle: dict[Candidate, list[float]] = {}
    walls: list[float] = []
    stopped = []
    for c in layouts:
        for sd in (*search_seeds, *seeds):
            cap = max(SWEEP_CAP_MIN_S, SWEEP_CAP_X * statistics.median(walls or [0.0]))
            # CPU seconds, the clock ``run_capped``'s cap counts in
            w0 = cpu_s()
            r = run_capped(sim_of(inputs, c, steps), sd, warmup, cap)
            if r is None:
                stopped.append(c)
                break
            walls.append(cpu_s() - w0)
            if sd in search_seeds:
                chose_on.setdefault(c, []).append(r.step_time_s)
                continue
            times.setdefault(c, []).append(r.step_time_s)
            kept = r.steps[warmup:]
            idle.setdefault(c, []).append(sum(s["trainer_idle_s"] for s in kept)
                                          / sum(s["step_time_s"] for s in kept))
    print(f"plan: {name}{tag}: planner {plan_cpu:.0f} CPU s, {plan_wall:.0f} s wall ({res.log.runs} runs), sweep of "
          f"{len(layouts)} layouts x {len(search_seeds) + len(seeds)} seeds "
          f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    done = [c for c in layouts if c not in stopped]
    if paper in stopped or chosen in stopped:
        raise RuntimeError(f"{name}{tag}: a simulated run of the paper's or the planner's "
                           f"layout did not end within {SWEEP_CAP_X:g}x the median run")
    best = min(done, key=lambda c: statistics.fmean(chose_on[c]))
    in_sample = min(done, key=lambda c: statistics.fmean(times[c]))
    for label, other in (("exhaustive best", best), ("sweep's in-sample minimum", in_sample),
                         ("paper layout", paper)):
        samples[f"plan vs {label}: {name}{tag}"] = [
            b / p for b, p in zip(times[other], times[chosen], strict=True)]
    for role, c in (("plan", chosen), ("exhaustive best", best),
                    ("sweep's in-sample minimum", in_sample), ("paper layout", paper)):
        rows.append({"mode": mode, "regime": name, "layout": role, "what": c.describe(inputs),
                     "step_time_s": statistics.fmean(times[c]),
                     "step_time_s_planner_seeds": statistics.fmean(chose_on[c]),
                     "rollout_gpu_share": c.rollout_share(inputs),
                     "trainer_idle_share": statistics.fmean(idle[c]),
                     "cost_h800_units": c.cost(inputs),
                     "plan_cpu_s": plan_cpu if role == "plan" else "",
                     "plan_wall_s": plan_wall if role == "plan" else "",
                     "plan_runs": res.log.runs if role == "plan" else "",
                     "layouts": len(layouts), "sweep_stopped": len(stopped)})


def _options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"planner budget per regime (default {QUICK_BUDGET_S:g} with --quick, "
                   f"else {FULL_BUDGET_S:g})")
    p.add_argument("--modes", type=_modes, default=("rollart",),
                   help=f"comma-separated modes to plan and sweep, of {', '.join(MODES)} "
                   "(default rollart)")
    return p


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown or [text]}; known: "
                                         f"{', '.join(MODES)}")
    return modes


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = _options().parse_known_args(argv)
    _BUDGET[0] = own.budget_s
    _MODES[0] = own.modes
    return main_for(NAME, __doc__ or "", run, rest, parents=[_options()])


if __name__ == "__main__":
    main()
