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

A sixth simulated row, ``rollart_new_policy``, is rollart with the new staleness policy
(``staleness_waste.POLICIES["new"]``; not rollart's default, see
docs/performance/staleness-policy.md), with its own ``rollart_new_policy vs <baseline>``
ratios.

Real nodes: ``--scenario FILE`` runs every mode on that scenario instead (its pools, envs and
rewards as real processes through ``rollart.launcher.local.open_cluster``, or the addresses of
running workers it names), same table and JSON (``simulated: false``). Each mode starts a
cluster, so ``--seeds`` defaults to 1 there (no interval; pass 3 or more for one); ``--quick``
trains 3 steps per mode (the first is a warm-up), otherwise the scenario's own steps. The real
``areal`` row changes the mode and turns on re-prefill; pools stay as the scenario declares.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.common import SIZE, main_for, mean_rows, result, seeds_for, small, summarize
from benchmarks.on_scenario import mean_after_first, scenario_main, steps_for, train
from benchmarks.staleness_waste import POLICIES
from benchmarks.workloads import paper_cluster
from rollart.sim.harness import MODE_ALPHA, SimScenario, run_simulated

MODES = ("sync", "sync_plus", "one_off", "areal", "rollart")
#: simulated rows: every mode, plus rollart with the new staleness policy (eager staggered
#: apply, fresh_start, capacity admission, yield domain mix: ``staleness_waste.POLICIES["new"]``),
#: which is not rollart's default (it is 6.7% slower in staleness_waste's rollout-bound regime)
#: and so is reported beside the default rather than instead of it
ROLLART_NEW_POLICY = "rollart_new_policy"
NAME = "modes"


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows, samples = [], {}
    models = SIZE.models or (("qwen3-32b",) if quick else ("qwen3-8b", "qwen3-14b", "qwen3-32b"))
    for model in models:
        for sd in seeds:
            times = {}
            for mode in (*MODES, ROLLART_NEW_POLICY):
                res = run_simulated(sim_for(model, mode, quick), sd)
                times[mode] = res.step_time_s
                rows.append({"model": model, "mode": mode, "step_time_s": res.step_time_s,
                             "trainer_idle_s": _mean(res.steps, "trainer_idle_s"),
                             "staleness_mean": _mean(res.steps, "staleness_mean"),
                             "staleness_max": max(s["staleness_max"] for s in res.steps),
                             "stale_waste_share": res.buffer["wasted_tokens"].get("stale", 0)
                             / max(1, res.buffer["generated_tokens"]),
                             "wall_s": res.wall_s})
            _add_ratios(samples, model, times)
    ratios, ci = summarize(samples)
    return result(NAME, simulated=True, rows=mean_rows(rows, ("model", "mode")),
                  ratios=ratios, ci95=ci, seeds=seeds, quick=quick, seed=seed,
                  started=started, notes="paper (32B): 2.05x vs sync_plus, 1.35x vs one_off, "
                  "1.31x vs areal; step time = mean over steps after the first")


def sim_for(model: str, row: str, quick: bool) -> SimScenario:
    """The simulated cluster of one row (a mode of ``MODES`` or ``ROLLART_NEW_POLICY``)."""
    # AReaL as the paper ran it: no hardware affinity (one homogeneous pool), interrupt +
    # re-prefill of running requests on every weight update.
    areal = row == "areal"
    sim = paper_cluster(model, quick=small(quick),
                        mode="rollart" if row == ROLLART_NEW_POLICY else row,
                        steps=3 if quick else 11, affinity=not areal, reprefill=areal)
    return sim.replace(**POLICIES["new"]) if row == ROLLART_NEW_POLICY else sim


def _add_ratios(samples: dict[str, list[float]], label: str, times: dict[str, float]) -> None:
    """Append one seed's ``rollart vs <baseline>`` step-time ratios under ``label`` (and
    ``rollart_new_policy vs <baseline>`` where that row ran)."""
    for ours in ("rollart", ROLLART_NEW_POLICY):
        if ours not in times:
            continue
        for base in ("sync", "sync_plus", "one_off", "areal"):
            samples.setdefault(f"{label}: {ours} vs {base}", []).append(
                times[base] / times[ours])


def _mean(steps: list[dict], key: str) -> float:
    vals = [s[key] for s in steps[1:]]
    return sum(vals) / len(vals)


#: rollart's own staleness policy fields; the baselines run as their papers describe
#: them, so they get RunConfig's defaults for these fields whatever the scenario sets.
ROLLART_POLICY_FIELDS = ("weight_apply", "apply_waves", "fresh_start", "abort_stale",
                         "admission", "domain_mix")


def scenario_for_mode(base: Any, mode: str, *, seed: int, steps: int | None) -> Any:
    """``base`` (a ``rollart.config.Scenario``) switched to ``mode`` with that mode's alpha
    (the scenario's own alpha, at least 1, where the mode allows any), validated. Modes other
    than ``rollart`` drop the scenario's rollart staleness policy (``ROLLART_POLICY_FIELDS``
    back to their defaults)."""
    from rollart.config import RunConfig, validate_scenario

    fixed = MODE_ALPHA[mode]
    defaults = RunConfig()
    policy = {} if mode == "rollart" else {
        f: getattr(defaults, f) for f in ROLLART_POLICY_FIELDS}
    run = msgspec.structs.replace(
        base.run, mode=mode, alpha=max(1, base.run.alpha) if fixed is None else fixed,
        seed=seed, steps=steps or base.run.steps,
        reprefill=True if mode == "areal" else base.run.reprefill, **policy)
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
    return scenario_main(NAME, argv, lambda rest: main_for(NAME, __doc__ or "", run, rest),
                         run_on_scenario)


if __name__ == "__main__":
    main()
