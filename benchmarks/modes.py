"""``modes``: step time of sync, sync_plus, one_off, areal, rollart (alpha = 1) for Qwen3-8B /
14B / 32B profiles on a SIMULATED 96 x H800 + 32 x H20 cluster, GRPO batch 512, group 8.

Paper (Qwen3-32B, Fig. 10): rollart 2.05x vs Sync+, 1.35x vs One-off, 1.31x vs AReaL.
The real controller runs every mode on the same workload and seed, side by side; each ratio
over 3 (quick) / 5 seeds, 2 (quick) / 10 measured steps; ``--quick`` runs Qwen3-32B only.

``areal`` is AReaL as the paper ran it: staleness bounded only by AReaL's admission capacity
``(eta + v + 1) B - (accepted + running)`` with eta = alpha (``ModeSpec.staleness_control =
"areal"``): no check at a turn, at completion or at batch assembly, so samples that finish
stale are trained, and the ``staleness_max`` column shows how stale; no hardware affinity (both
domains spread over every engine in proportion to pool size) and interrupt + re-prefill of
running requests on each weight update. ``C - running`` (engine concurrency) is left to the
engines' queues.

Like for like, per mode (simulated rows; the real rows share the scenario's pools):

==========  ======================  ===========================  ==============================
mode        reward                  hardware affinity            re-prefill after an update
==========  ======================  ===========================  ==============================
sync        serverless, same cost   yes (domain -> pool)         no (no update mid-trajectory)
sync_plus   serverless, same cost   yes (domain -> pool)         no (no update mid-trajectory)
one_off     serverless, same cost   yes (domain -> pool)         yes (in-flight KV recomputed)
areal       serverless, same cost   no (every engine, by size)   yes (in-flight KV recomputed)
rollart     serverless, same cost   yes (domain -> pool)         yes (in-flight KV recomputed)
==========  ======================  ===========================  ==============================

Reward: every mode scores through the same simulated reward service (``SimScenario``'s
``reward_latency_s``, no dedicated reward GPUs), so reward placement costs every mode the same.
Re-prefill: every overlapping mode (``REPREFILL_MODES``) applies new weights while trajectories
are in flight, so each one recomputes the KV of its running requests after an update, as the
paper's weight sync does (§6.2, "recompute KV of in-flight requests"); ``sync`` and
``sync_plus`` pause generation before training and start every batch on the new weights.

Staleness policy: ``rollart`` runs ``RunConfig``'s default (nothing set: eager staggered
apply, fresh_start, capacity admission, yield domain mix, batches held for groups; see
docs/staleness.md); the baselines run as their papers describe them, with the previous
default spelled out (``staleness_waste.POLICIES["lazy"]``: weights applied at the next step's
pause, greedy admission, domains by weight). A sixth simulated row, ``rollart_lazy``, is
rollart with that lazy policy too, with its own ``rollart_lazy vs <baseline>`` ratios.

Every row reports its regime (``regime_of``): rollout share of a step (Sync+'s is the
paper's "rollout share"), trainer idle share, engine utilisation per pool, prefix-hit share
and stale share; ``ratios`` add ``<model>: sync_plus rollout share``, ``<model>: rollart stale
share`` and every ratio per trained token.

``--regime``: rollart vs each baseline across regimes, trainer throughput x1/x2/x4, load
x1/x2/x8 and prefix cache on/off (``run_regime``: the whole grid, or one factor at a time with
``--quick`` or ``--grid axes``), a table row per regime with 95% intervals, per step and per
trained token. The trajectory and group timeouts scale with the load (``regime_sim``).

Real nodes: ``--scenario FILE`` runs every mode on that scenario instead (its pools, envs and
rewards as real processes through ``rollart.launcher.local.open_cluster``, or the addresses of
running workers it names), same table and JSON (``simulated: false``). Each mode starts a
cluster, so ``--seeds`` defaults to 1 there (no interval; pass 3 or more for one); ``--quick``
trains 3 steps per mode (the first is a warm-up), otherwise the scenario's own steps. The real
rows change the mode and turn on re-prefill in every overlapping mode (``REPREFILL_MODES``);
pools stay as the scenario declares.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.common import SIZE, main_for, mean_rows, result, seeds_for, small, summarize
from benchmarks.on_scenario import mean_after_first, scenario_main, steps_for, train
from benchmarks.staleness_waste import POLICIES
from benchmarks.workloads import paper_cluster
from rollart.config import RunConfig
from rollart.controller.modes import MODES as CONTROLLER_MODES
from rollart.sim.harness import MODE_ALPHA, SimScenario, run_simulated

MODES = ("sync", "sync_plus", "one_off", "areal", "rollart")
#: the modes that apply weights while trajectories are in flight (``ModeSpec.overlap``): each
#: recomputes its running requests' KV after an update (paper §6.2), rollart included
REPREFILL_MODES = tuple(m for m in MODES if CONTROLLER_MODES[m].overlap)
#: simulated rows: every mode, plus rollart with the previous default staleness policy spelled
#: out (``staleness_waste.POLICIES["lazy"]``), the policy the baselines run with, so rollart's
#: gain splits into what its design and what its default policy bring
ROLLART_LAZY = "rollart_lazy"
NAME = "modes"


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, samples = [], {}
    models = SIZE.models or (("qwen3-32b",) if quick else ("qwen3-8b", "qwen3-14b", "qwen3-32b"))
    for model in models:
        for sd in seeds:
            times, regime = {}, {}
            for mode in (*MODES, ROLLART_LAZY):
                sim = sim_for(model, mode, quick)
                res = run_simulated(sim, sd)
                times[mode], regime[mode] = res.step_time_s, regime_of(sim, res)
                rows.append({"model": model, "mode": mode, "step_time_s": res.step_time_s,
                             "trainer_idle_s": _mean(res.steps, "trainer_idle_s"),
                             "staleness_mean": _mean(res.steps, "staleness_mean"),
                             "staleness_max": max(s["staleness_max"] for s in res.steps),
                             **regime[mode], "wall_s": res.wall_s})
            _add_ratios(samples, model, times)
            _add_regime(samples, model, regime, times)
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("model", "mode")),
                  ratios=ratios, ci95=ci, seeds=seeds, quick=quick, seed=seed,
                  started=started, notes="paper (32B): 2.05x vs sync_plus, 1.35x vs one_off, "
                  "1.31x vs areal; step time = mean over steps after the first")


def regime_of(sim: SimScenario, res: Any) -> dict[str, float]:
    """The regime one run ran in, over the steps after the first: ``rollout_share``
    (rollout seconds / step seconds; in ``sync_plus``, which does not overlap them, the share
    of a step spent rolling out), ``trainer_idle_share`` (trainer idle / step seconds),
    ``util_<pool>`` (engine busy seconds / (run seconds x engines) per pool),
    ``prefix_hit_share`` (prompt tokens served from the prefix cache / prompt tokens),
    ``stale_waste_share`` (generated tokens wasted as stale / generated tokens) and
    ``trained_tokens`` (per step)."""
    step = _mean(res.steps, "step_time_s") or float("nan")
    out = {"rollout_share": _mean(res.steps, "rollout_time_s") / step,
           "trainer_idle_share": _mean(res.steps, "trainer_idle_s") / step}
    for pool in sim.pools:
        busy = [w for name, w in res.workers.items() if name.startswith(f"{pool.name}-")]
        out[f"util_{pool.name}"] = (sum(w["busy_s"] for w in busy)
                                    / max(res.total_time_s * len(busy), 1e-9))
    hits = sum(w["prefix_hit_tokens"] for w in res.workers.values())
    prompt = hits + sum(w["prefill_tokens"] for w in res.workers.values())
    out["prefix_hit_share"] = hits / prompt if prompt else 0.0
    out["stale_waste_share"] = (res.buffer["wasted_tokens"].get("stale", 0)
                                / max(1, res.buffer["generated_tokens"]))
    out["trained_tokens"] = _mean(res.steps, "trained_tokens")
    return out


def _add_regime(samples: dict[str, list[float]], label: str,
                regime: dict[str, dict[str, float]], times: dict[str, float]) -> None:
    """Append one seed's regime figures (``<label>: sync_plus rollout share``, ``<label>:
    rollart stale share``, and ``rollart_lazy``'s where it ran) and its
    per-trained-token ratios (``<label>: rollart vs <baseline>
    per trained token``: the baseline's seconds per trained token over rollart's)."""
    if "sync_plus" in regime:
        samples.setdefault(f"{label}: sync_plus rollout share", []).append(
            regime["sync_plus"]["rollout_share"])
    for ours in ("rollart", ROLLART_LAZY):
        if ours in regime:
            samples.setdefault(f"{label}: {ours} stale share", []).append(
                regime[ours]["stale_waste_share"])
    if "rollart" in regime:
        ours = regime["rollart"]
        for base in ("sync", "sync_plus", "one_off", "areal"):
            if base in regime:
                samples.setdefault(f"{label}: rollart vs {base} per trained token", []).append(
                    (times[base] / max(regime[base]["trained_tokens"], 1.0))
                    / (times["rollart"] / max(ours["trained_tokens"], 1.0)))


def sim_for(model: str, row: str, quick: bool) -> SimScenario:
    """The simulated cluster of one row (a mode of ``MODES`` or ``ROLLART_LAZY``): rollart
    with the default staleness policy, every other row with the lazy one."""
    # AReaL as the paper ran it: no hardware affinity (one homogeneous pool). Every mode that
    # updates weights under in-flight trajectories re-prefills them (module table).
    mode = "rollart" if row == ROLLART_LAZY else row
    sim = paper_cluster(model, quick=small(quick), mode=mode, steps=3 if quick else 11,
                        affinity=row != "areal", reprefill=mode in REPREFILL_MODES)
    return sim if row == "rollart" else sim.replace(**POLICIES["lazy"])


def _add_ratios(samples: dict[str, list[float]], label: str, times: dict[str, float]) -> None:
    """Append one seed's ``rollart vs <baseline>`` step-time ratios under ``label`` (and
    ``rollart_lazy vs <baseline>`` where that row ran)."""
    for ours in ("rollart", ROLLART_LAZY):
        if ours not in times:
            continue
        for base in ("sync", "sync_plus", "one_off", "areal"):
            samples.setdefault(f"{label}: {ours} vs {base}", []).append(
                times[base] / times[ours])


#: ``--regime`` sweep: trainer throughput (x trainer GPUs; the push keeps its NICs), load
#: (x trajectories per step: x batch size) and the engines' prefix cache
TRAINER_X = (1, 2, 4)
LOAD_X = (1, 2, 8)
#: the regime ratios: rollart against each baseline, per step and per trained token
REGIME_BASES = ("sync", "sync_plus", "one_off", "areal")


#: ``--grid``: the whole grid (``full``) or one factor at a time from (1, 1, on) (``axes``)
GRIDS = ("axes", "full")


def regime_grid(quick: bool, grid: str | None = None) -> list[tuple[int, int, bool]]:
    """(trainer x, load x, prefix cache) of the sweep: ``grid`` ``"full"``, the whole grid
    (18 regimes), or ``"axes"``, one factor at a time from (1, 1, on) (6 regimes); ``None``:
    ``axes`` with ``quick``, else ``full``. Raises ``ValueError`` for another ``grid``."""
    if grid is not None and grid not in GRIDS:
        raise ValueError(f"grid must be one of {GRIDS}, got {grid!r}")
    if (grid or ("axes" if quick else "full")) == "full":
        return [(t, k, c) for c in (True, False) for t in TRAINER_X for k in LOAD_X]
    return [(1, 1, True), *((t, 1, True) for t in TRAINER_X[1:]),
            *((1, k, True) for k in LOAD_X[1:]), (1, 1, False)]


def regime_label(trainer_x: int, load_x: int, cache: bool) -> str:
    return f"trainer x{trainer_x}, load x{load_x}, cache {'on' if cache else 'off'}"


def regime_sim(sim: SimScenario, trainer_x: int, load_x: int, cache: bool) -> SimScenario:
    """``sim`` in one regime of the sweep. The trainer's GPUs are multiplied with its GPUs
    per node, so the weight push keeps the same NICs (only training gets faster).

    The trajectory and group timeouts are multiplied by ``load_x``: on saturated engines
    ``load_x`` times the trajectories share the same throughput, so a trajectory takes up to
    ``load_x`` times as long while merely queued, not hung. Unscaled, the run's one-hour
    trajectory limit failed the queued trajectories of a loaded regime one after another
    until the run stopped (``ControllerStalledError``) instead of being measured; scaled, the
    limits keep the margin over a trajectory's time they have at load x1."""
    return sim.replace(trainer_gpus=sim.trainer_gpus * trainer_x,
                       gpus_per_node=sim.gpus_per_node * trainer_x,
                       batch_size=sim.batch_size * load_x, prefix_cache=cache,
                       trajectory_timeout_s=_scaled(sim.trajectory_timeout_s, load_x),
                       group_timeout_s=_scaled(sim.group_timeout_s, load_x))


def _scaled(limit_s: float | None, factor: int) -> float | None:
    return None if limit_s is None else limit_s * factor


def regime_base(model: str, mode: str, quick: bool) -> SimScenario:
    """The sweep's x1 cluster of ``mode``: the ``--quick`` cluster (an eighth of the paper's)
    with the full size's 11 steps, or with ``quick`` its 3 steps and half of it (engines,
    trainer GPUs and batch: 32 samples)."""
    sim = sim_for(model, mode, True)
    if not quick:
        return sim.replace(steps=11)
    return sim.replace(pools=tuple(dataclasses.replace(p, num_workers=max(1, p.num_workers // 2))
                                   for p in sim.pools),
                       batch_size=sim.batch_size // 2, trainer_gpus=max(1, sim.trainer_gpus // 2))


def run_regime(quick: bool, seed: int, grid: str | None = None) -> dict:
    """``--regime``: every mode in every regime of ``regime_grid(quick, grid)``; one row per
    regime with its figures (``regime_of``: Sync+ rollout share, rollart's trainer idle
    share, engine utilisation, prefix hits, stale share) and rollart's ratios against each
    baseline with their 95% intervals, per step and per trained token. ``--quick`` runs
    Qwen3-8B on the halved quick cluster, one factor at a time; otherwise Qwen3-32B on the
    quick cluster, the whole grid (``--models`` picks the profile; ``--grid`` the regimes)."""
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    model = SIZE.models[0] if SIZE.models else ("qwen3-8b" if quick else "qwen3-32b")
    rows, samples = [], {}
    for trainer_x, load_x, cache in regime_grid(quick, grid):
        label = regime_label(trainer_x, load_x, cache)
        figures: dict[str, list[dict[str, float]]] = {}
        for sd in seeds:
            times, regime = {}, {}
            for mode in MODES:
                sim = regime_sim(regime_base(model, mode, quick), trainer_x, load_x, cache)
                res = run_simulated(sim, sd)
                times[mode], regime[mode] = res.step_time_s, regime_of(sim, res)
                figures.setdefault(mode, []).append(regime[mode])
            _add_ratios(samples, label, times)
            _add_regime(samples, label, regime, times)
        ratios, ci = summarize({k: v for k, v in samples.items() if k.startswith(label + ":")})
        row: dict[str, Any] = {"name": label}
        for key, mode in (("rollout_share", "sync_plus"), ("trainer_idle_share", "rollart"),
                          ("prefix_hit_share", "rollart"), ("stale_waste_share", "rollart")):
            row[f"{mode} {key}"] = statistics.fmean(f[key] for f in figures[mode])
        for pool in {k for f in figures["rollart"] for k in f if k.startswith("util_")}:
            row[f"rollart {pool}"] = statistics.fmean(f[pool] for f in figures["rollart"])
        for base in ("sync_plus", "one_off", "areal"):
            for per in ("", " per trained token"):
                key = f"{label}: rollart vs {base}{per}"
                low, high = ci[key]
                row[f"vs {base}{per}"] = f"{ratios[key]:.2f} [{low:.2f}, {high:.2f}]"
        rows.append(row)
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=rows, ratios=ratios, ci95=ci, seeds=seeds,
                  quick=quick, seed=seed, started=started,
                  notes=f"--regime ({grid or ('axes' if quick else 'full')} grid), {model}: "
                  "rollart vs each baseline per regime (step time ratio; 'per trained token': "
                  "seconds per trained token); > 1: rollart faster")


def _mean(steps: list[dict], key: str) -> float:
    vals = [s[key] for s in steps[1:]]
    return sum(vals) / len(vals)


#: rollart's own staleness policy; the baselines run as their papers describe them, so they
#: get the previous default spelled out (``staleness_waste.POLICIES["lazy"]``) for these
#: ``RunConfig`` fields whatever the scenario sets.
BASELINE_POLICY: dict[str, Any] = dict(
    POLICIES["lazy"], abort_stale=False, apply_waves=RunConfig().apply_waves,
    hold_batch_max_s=RunConfig().hold_batch_max_s)


def scenario_for_mode(base: Any, mode: str, *, seed: int, steps: int | None) -> Any:
    """``base`` (a ``rollart.config.Scenario``) switched to ``mode`` with that mode's alpha
    (the scenario's own alpha, at least 1, where the mode allows any), validated. Modes other
    than ``rollart`` run the lazy staleness policy (``BASELINE_POLICY``) whatever the scenario
    sets."""
    from rollart.config import validate_scenario

    fixed = MODE_ALPHA[mode]
    policy = {} if mode == "rollart" else BASELINE_POLICY
    run = msgspec.structs.replace(
        base.run, mode=mode, alpha=max(1, base.run.alpha) if fixed is None else fixed,
        seed=seed, steps=steps or base.run.steps,
        reprefill=True if mode in REPREFILL_MODES else base.run.reprefill, **policy)
    return validate_scenario(msgspec.structs.replace(base, run=run), f"<modes {mode}>")


def run_on_scenario(path: Path, quick: bool, seed: int, *, num_seeds: int, cache_dir: Path,
                    run_dir: Path, args: Any = None) -> dict:
    """Every mode on the REAL scenario at ``path``; step time = mean over steps after the
    first. Raises what ``open_cluster`` raises (ConfigError, ProcessFailedError, ...)."""
    from rollart.config import load_scenario

    started = time.perf_counter()
    base = load_scenario(path)
    seeds = [seed + i for i in range(num_seeds)]
    rows, samples = [], {}
    for sd in seeds:
        times = {}
        for mode in MODES:
            sc = scenario_for_mode(base, mode, seed=sd, steps=steps_for(quick, base, args))
            steps = train(sc, run_dir / f"{mode}-{sd}", cache_dir, str(path))
            times[mode] = mean_after_first(steps, "step_time_s")
            rows.append({"scenario": path.name, "mode": mode, "step_time_s": times[mode],
                         "rollout_time_s": mean_after_first(steps, "rollout_time_s")})
        _add_ratios(samples, path.stem, times)
    ratios, ci = summarize(samples)
    return result(NAME, simulated=False, rows=mean_rows(rows, ("scenario", "mode")),
                  ratios=ratios, ci95=ci, seeds=seeds, quick=quick, seed=seed,
                  started=started, notes=f"measured wall clock, real services of {path}")


def main(argv: list[str] | None = None) -> dict:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--regime" in args:
        args.remove("--regime")
        if "--scenario" in args:
            print("benchmarks.modes: --regime runs the simulated cluster; it takes no "
                  "--scenario", file=sys.stderr)
            raise SystemExit(2)
        grid = argparse.ArgumentParser(add_help=False)
        grid.add_argument("--grid", choices=GRIDS, default=None,
                          help="--regime: the whole grid (18 regimes) or one factor at a time "
                               "(6); default axes with --quick, else full")
        chosen = grid.parse_known_args(args)[0].grid
        return main_for(NAME, __doc__ or "", lambda quick, seed: run_regime(quick, seed, chosen),
                        args, parents=[grid])
    if any(a == "--grid" or a.startswith("--grid=") for a in args):
        print("benchmarks.modes: --grid picks the regimes of --regime", file=sys.stderr)
        raise SystemExit(2)
    return scenario_main(NAME, argv, lambda rest: main_for(NAME, __doc__ or "", run, rest),
                         run_on_scenario)


if __name__ == "__main__":
    main()
