"""``staleness_waste``: wasted tokens, step time and selection bias at alpha = 1, the previous
staleness policy (``lazy``) vs the default, side by side (SIMULATED cluster, REAL controller).

Policies (``rollart.config.RunConfig``; all strict: no trained token older than its bound):

- ``lazy``: the previous default, spelled out: weights applied at the next step's pause
  (``weight_apply = "at_batch"``), greedy admission, domains drawn by weight, no
  ``fresh_start``, no hold, one bound (run.alpha) for every domain;
- ``default``: ``RunConfig``'s default (nothing set): eager staggered apply (``weight_apply =
  "eager"``, 2 waves), ``fresh_start``, version-aware admission (``admission = "capacity"``: a
  group starts only while fewer still-admissible groups are in flight than the batches it
  could join can take), yield-corrected domain mix (``domain_mix = "yield"``) and
  ``hold_batch_for_groups`` (a ready batch waits, at most ``hold_batch_max_s``, for an open
  group it would make stale instead of that group being thrown away); in the long-horizon
  workload only, the scenario also gives the long-horizon domain its own bound
  (``DomainConfig.alpha``) one above the number of steps its trajectories are built to span
  (3), i.e. 4: under alpha = 1 such a trajectory can never be trained, by the rule itself.
  (``abort_stale`` and ``admission = "paced"`` are selectable too; in side runs they changed
  neither waste nor step time beyond seed noise, so the default leaves them off: see
  docs/performance/staleness-policy.md.)
- ``no_hold``: the default with ``hold_batch_for_groups = false`` (what the hold adds).

Regimes (pools and domains of ``benchmarks.workloads.paper_cluster``; ``--quick`` halves its
quick cluster: 6 H800 + 2 H20 roll out, 2 H800 train, batch 32, group 8):
``rollout_bound`` (decode-heavy reasoning on H20 + prefill-heavy agentic on H800; the trainer
waits for batches), ``trainer_bound`` (the same with H20 trainer GPUs, ~6.7x less compute, so
rollout waits for the trainer) and ``long_horizon`` (reasoning, weight 3, plus an agentic
domain of 16 turns x 25 s env latency, weight 1, whose trajectories span >= 3 training steps;
``long_span_steps`` reports the measured lower bound: env seconds per long trajectory / step
time).

Seeds: 3 with ``--quick``, else 5; ``--seeds N`` sets N (a tighter interval for the
"no slower than the previous default" check). Reported per regime and policy (mean and 95%
interval over seeds; measured over the steps after
the first 2, or the first ``LONG_ALPHA + 1`` in ``long_horizon``): step time; wasted share of
generated tokens by reason (every generated token is trained, wasted for exactly one reason, or
still in flight at the end); per domain the share of trained samples relative to its configured
share, and the length bias ``|trained mean generated tokens / finished mean - 1|``.
``ratios`` hold, for the default policy, the worst case over regimes of ``stale_waste_share``,
``long_horizon_trained_share`` (long-horizon trained share / configured share),
``length_bias`` and ``step_time_vs_before`` (default / lazy step time, paired by seed), and
``ci95`` the half-width of each at that regime; ``no_hold_*`` the same for ``no_hold``; and per
regime ``<regime>: stale share lazy`` / ``default``, ``<regime>: step time default vs
lazy`` and ``<regime>: step time per trained token default vs lazy`` (seconds per generated
token trained: the policies' batches differ in length and domain mix, so their steps do not
train the same work). Every simulated constant comes from
``rollart.sim`` (see its docstrings for sources); the workload shapes are
``benchmarks.workloads``.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from benchmarks.common import main_for, result, seeds_for, t975
from benchmarks.workloads import agentic, paper_cluster, reasoning
from rollart.sim.harness import SimDomain, SimScenario, run_simulated

NAME = "staleness_waste"
LONG = "long_agentic"
#: steps the long-horizon domain's trajectories are built to span (16 turns x 25 s env latency
#: + generation, against a ~60 s step), and the per-domain bound the scenario gives it (every
#: policy but ``lazy``)
LONG_SPAN_STEPS = 3
LONG_ALPHA = LONG_SPAN_STEPS + 1

#: ``SimScenario`` fields of each policy: ``default`` sets none (``RunConfig``'s default)
POLICIES: dict[str, dict[str, Any]] = {
    "lazy": dict(weight_apply="at_batch", fresh_start=False, admission="greedy",
                 domain_mix="weight", hold_batch_for_groups=False),
    "default": {},
    "no_hold": dict(hold_batch_for_groups=False),
}


def regimes(quick: bool) -> dict[str, SimScenario]:
    base = paper_cluster("qwen3-8b", quick=True, steps=6 if quick else 12)
    if quick:
        base = base.replace(pools=tuple(p.__class__(p.name, p.hardware, p.num_workers // 2,
                                                     tp=p.tp, max_batch=p.max_batch)
                                        for p in base.pools),
                            batch_size=base.batch_size // 2, trainer_gpus=base.trainer_gpus // 2)
    long_domains = (SimDomain(reasoning(), "h20", weight=3.0),
                    SimDomain(agentic(LONG, turns=16, latency_mean_s=25.0, latency_std_s=5.0,
                                      prompt=2000, obs=300), "h800", weight=1.0))
    return {
        "rollout_bound": base,
        "trainer_bound": base.replace(trainer_hardware="h20"),
        # measured after LONG_ALPHA + 1 steps: before that no long trajectory can have finished
        "long_horizon": base.replace(domains=long_domains, max_turns=16,
                                     steps=base.steps + LONG_ALPHA),
    }


def apply_policy(sim: SimScenario, policy: str) -> SimScenario:
    sim = sim.replace(**POLICIES[policy])
    if policy != "lazy":
        sim = sim.replace(domains=tuple(
            d if d.spec.name != LONG else SimDomain(d.spec, d.pool, d.weight, alpha=LONG_ALPHA)
            for d in sim.domains))
    return sim


def measure(sim: SimScenario, seed: int, warmup: int) -> dict[str, Any]:
    """One run, measured over the steps after ``warmup``: step time, waste shares by reason,
    per-domain trained share and length bias (summed ``StepMetrics.by_domain`` of those
    steps, so the start-up, before any long trajectory can finish, is left out)."""
    res = run_simulated(sim, seed, warmup=warmup)
    steps = res.steps[warmup:]
    gen = max(sum(s["buffer_generated_tokens"] for s in steps), 1)
    reasons: dict[str, int] = {}
    dom: dict[str, dict[str, int]] = {}
    for s in steps:
        for k, v in s["wasted_tokens_by_reason"].items():
            reasons[k] = reasons.get(k, 0) + v
        for name, d in s["by_domain"].items():
            acc = dom.setdefault(name, {})
            for k in ("trained", "finished", "trained_tokens", "finished_tokens"):
                acc[k] = acc.get(k, 0) + d[k]
    weights = {d.spec.name: d.weight for d in sim.domains}
    total_w = sum(weights.values())
    trained = sum(c.get("trained", 0) for c in dom.values()) or 1
    b = res.buffer
    out: dict[str, Any] = {
        "step_time_s": res.step_time_s,
        # generated tokens trained per step (the policies' batches differ in length and mix)
        "trained_tokens": statistics.fmean(s["trained_tokens"] for s in steps),
        "stale_waste_share": reasons.get("stale", 0) / gen,
        "waste_share": sum(reasons.values()) / gen,
        "waste_by_reason": {k: v / gen for k, v in reasons.items()},
        # whole run: every generated token trained, wasted for one reason, or in flight
        "accounted": (b["trained_tokens"] + sum(b["wasted_tokens"].values())
                      + b["in_flight_tokens"]) / max(b["generated_tokens"], 1),
        "share_vs_configured": {}, "length_bias": {}, "trained_len": {}, "finished_len": {},
    }
    # Multi-turn sessions' env seconds (only the long-horizon domain has more than one turn
    # there) against the step time: a lower bound of the steps one trajectory spans.
    long_env_s = [sum(lat) for _, lat in res.session_latencies if len(lat) > 1]
    out["long_span_steps"] = (statistics.median(long_env_s) / res.step_time_s
                              if long_env_s and LONG in weights else float("nan"))
    for name in weights:
        c = dom.get(name, {})
        nt, nf = c.get("trained", 0), c.get("finished", 0)
        out["share_vs_configured"][name] = (nt / trained) / (weights[name] / total_w)
        t_len = c["trained_tokens"] / nt if nt else float("nan")
        f_len = c["finished_tokens"] / nf if nf else float("nan")
        out["trained_len"][name], out["finished_len"][name] = t_len, f_len
        # A domain with no trained sample has no trained length: bias undefined (nan), and its
        # starvation shows in share_vs_configured instead.
        out["length_bias"][name] = abs(t_len / f_len - 1) if nt and nf else float("nan")
    return out


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (nan for fewer than 2 finite values)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return float("nan"), float("nan")
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, t975(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs))


def run(quick: bool, seed: int) -> dict:
    started = time.perf_counter()
    seeds = seeds_for(quick, seed)
    rows: list[dict[str, Any]] = []
    per: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for regime, sim in regimes(quick).items():
        for policy in POLICIES:
            warmup = LONG_ALPHA + 1 if regime == "long_horizon" else 2
            per[(regime, policy)] = [measure(apply_policy(sim, policy), s, warmup)
                                     for s in seeds]
    worst: dict[str, tuple[float, float, str]] = {}
    per_regime: dict[str, tuple[float, float]] = {}

    def note_worst(key: str, value: float, ci: float, regime: str, higher_is_worse: bool) -> None:
        if math.isnan(value):
            return
        cur = worst.get(key)
        if cur is None or (value > cur[0] if higher_is_worse else value < cur[0]):
            worst[key] = (value, ci, regime)

    for (regime, policy), runs in per.items():
        step, step_ci = mean_ci([r["step_time_s"] for r in runs])
        stale, stale_ci = mean_ci([r["stale_waste_share"] for r in runs])
        waste, waste_ci = mean_ci([r["waste_share"] for r in runs])
        row: dict[str, Any] = {
            "regime": regime, "policy": policy, "step_time_s": step, "step_ci95": step_ci,
            "stale_waste": stale, "stale_ci95": stale_ci, "waste": waste, "waste_ci95": waste_ci,
        }
        reasons = sorted({k for r in runs for k in r["waste_by_reason"]})
        row["waste_by_reason"] = " ".join(
            f"{k}={mean_ci([r['waste_by_reason'].get(k, 0.0) for r in runs])[0]:.3f}"
            for k in reasons)
        row["accounted"] = mean_ci([r["accounted"] for r in runs])[0]
        row["long_span_steps"] = mean_ci([r["long_span_steps"] for r in runs])[0]
        domains = sorted(runs[0]["share_vs_configured"])
        shares = {d: mean_ci([r["share_vs_configured"][d] for r in runs]) for d in domains}
        biases = {d: mean_ci([r["length_bias"][d] for r in runs]) for d in domains}
        row["share_vs_configured"] = " ".join(f"{d}={m:.2f}" for d, (m, _) in shares.items())
        row["length_bias"] = " ".join(f"{d}={m:.3f}" for d, (m, _) in biases.items())
        row["trained/finished len"] = " ".join(
            f"{d}={mean_ci([r['trained_len'][d] for r in runs])[0]:.0f}/"
            f"{mean_ci([r['finished_len'][d] for r in runs])[0]:.0f}" for d in domains)
        per_regime[f"{regime}: stale share {policy}"] = (stale, stale_ci)
        if policy != "lazy":
            lazy = per[(regime, "lazy")]
            vs, vs_ci = mean_ci([n["step_time_s"] / t["step_time_s"]
                                 for n, t in zip(runs, lazy, strict=True)])
            row["step_time_vs_lazy"], row["vs_ci95"] = vs, vs_ci
            per_regime[f"{regime}: step time {policy} vs lazy"] = (vs, vs_ci)
            per_tok = mean_ci([(n["step_time_s"] / max(n["trained_tokens"], 1.0))
                               / (t["step_time_s"] / max(t["trained_tokens"], 1.0))
                               for n, t in zip(runs, lazy, strict=True)])
            row["per_token_vs_lazy"], row["per_token_ci95"] = per_tok
            per_regime[f"{regime}: step time per trained token {policy} vs lazy"] = per_tok
        if policy == "no_hold":
            note_worst("no_hold_stale_waste_share", stale, stale_ci, regime, True)
            note_worst("no_hold_step_time_vs_before", vs, vs_ci, regime, True)
        if policy == "default":
            note_worst("stale_waste_share", stale, stale_ci, regime, True)
            note_worst("step_time_vs_before", vs, vs_ci, regime, True)
            for d in domains:
                note_worst("length_bias", *biases[d], regime, True)
            if LONG in shares:
                note_worst("long_horizon_trained_share", *shares[LONG], regime, False)
        rows.append(row)
    ratios: dict[str, Any] = {k: v[0] for k, v in (*worst.items(), *per_regime.items())}
    ratios["ci95"] = {k: round(v[1], 4) for k, v in (*worst.items(), *per_regime.items())}
    ratios["worst_regime"] = {k: v[2] for k, v in worst.items()}
    return result(NAME, simulated=True, rows=rows, ratios=ratios, quick=quick, seed=seed,
                  seeds=seeds, started=started, notes=(
                      f"alpha 1, seeds {seeds}; ratios: default policy (no_hold_*: no_hold), "
                      "worst regime, and per regime; goals: "
                      "stale_waste_share <= 0.05, long_horizon_trained_share >= 0.90, "
                      "length_bias <= 0.03, step_time_vs_before <= 1 (within ci95)"))


if __name__ == "__main__":
    main_for(NAME, __doc__ or "", run)
