"""Workload profiles measured from a run folder (``rollart plan --profiles-from RUN_DIR``).

A finished (or running) run's folder (``rollart.launcher.rundir``) says what its task domains
cost: this module turns it into one ``rollart.sim.workload.DomainSpec`` per domain of the
scenario being planned, the structure ``rollart.plan(..., profiles=)`` takes.

From the run (MEASURED):

- ``metrics.jsonl`` (required): each step's ``by_domain`` counters, summed over the steps;
  over every trajectory that finished (trained or not, so the staleness policy's selection
  does not bias them): the mean turns per trajectory (``finished_turns / finished``) and the
  mean generated tokens per turn (``finished_tokens / finished_turns``);
- ``transcripts.jsonl`` (when the run wrote one, ``[output] transcripts_per_step``): per
  sampled trajectory the tokens of context the policy was given before each turn (turn 0: the
  templated prompt, later turns: each templated observation; the per-turn ``context_tokens``,
  or for a one-turn trajectory ``num_tokens - num_generated``), its turns and each turn's
  generated tokens: the means of the first two and the spread (standard deviation) of the
  last two.

The run's model (``model.path`` of its ``config.json``) is kept: token counts are in that
model's tokens, while the plan prices every token with its own simulated model profile
(``MeasuredProfiles.model_note`` says so when the two differ).

ASSUMED (as ``rollart.planner.inputs.default_profile`` states them), because a run folder does
not record them per domain: env step, reset and reward latencies, env step failures, the
shape of the distributions (lognormal responses, uniform turns), and, without transcripts,
the prompt and observation lengths and the spreads of response length (0.75 x its mean) and
of turns (a quarter of their mean). Responses the run cut at its ``max_tokens_per_turn`` are
measured cut: a plan for a larger cap sees them as short as the run had them.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollart.config import Scenario
from rollart.planner.inputs import PlanError, default_profile, option, profile_name
from rollart.sim.workload import Dist, DomainSpec, const

#: per-domain counters of a ``metrics.jsonl`` step row (``StepMetrics.by_domain``) read here
_COUNTERS = ("finished", "finished_tokens", "finished_turns")


@dataclass
class MeasuredProfiles:
    """``profiles``: one measured workload per domain (scenario order); ``measured``: per
    domain, the ``DomainSpec`` fields taken from the run (the rest are assumed); ``steps``: the
    metrics rows read; ``trajectories``: finished trajectories per domain behind the means;
    ``transcripts``: transcript records per domain behind the spreads and context lengths;
    ``model_path``: the run's ``model.path`` (its ``config.json``; None when unreadable)."""

    run_dir: Path
    profiles: dict[str, DomainSpec]
    measured: dict[str, tuple[str, ...]]
    steps: int
    trajectories: dict[str, int]
    transcripts: dict[str, int] = field(default_factory=dict)
    model_path: str | None = None

    def model_note(self, planned: str) -> str | None:
        """A warning when the run's model is not ``planned`` (the simulated profile the plan
        prices tokens with), saying what comes from where; None when they agree or the
        run's model is unknown."""
        if self.model_path is None or profile_name(self.model_path) == planned:
            return None
        taken = dict.fromkeys(f for fields in self.measured.values() for f in fields)
        words = ", ".join(_FIELD_WORDS[f] for f in taken)
        return (f"the run folder {self.run_dir} ran model {self.model_path!r} (its "
                f"config.json), the plan is for model {planned!r}: the {words} come from the "
                f"run, counted in its model's tokens; the per-token costs (prefill, decode, "
                f"training) come from the simulated {planned!r} profile")

    def describe(self) -> list[str]:
        """One line per domain: what was measured, from how many trajectories."""
        out = []
        for name, spec in self.profiles.items():
            tag = {f: "" if f in self.measured[name] else " (assumed)"
                   for f in ("prompt_tokens", "obs_tokens")}
            out.append(
                f"{name}: {', '.join(self.measured[name])} measured over {self.trajectories[name]} finished "
                f"trajectories of {self.steps} step(s) ({self.transcripts.get(name, 0)} "
                f"transcripts): {spec.num_turns.mean:.1f} turns, "
                f"{spec.response_tokens.mean:.0f} generated tokens per turn, prompt "
                f"{spec.prompt_tokens.mean:.0f}{tag['prompt_tokens']}, observation "
                f"{spec.obs_tokens.mean:.0f}{tag['obs_tokens']} tokens; env latency assumed")
        return out


def _jsonl(path: Path, arg: str) -> list[dict[str, Any]]:
    """The records of ``path``; PlanError naming it for a file that is not UTF-8 JSON lines or
    holds a record that is not a JSON object (a run writes one object per line)."""
    from rollart.launcher.rundir import read_jsonl

    # read_jsonl names the file for non-UTF-8 text and for a line that is not a JSON object.
    try:
        return read_jsonl(path)
    except (ValueError, OSError) as exc:
        raise PlanError(f"{arg}: {exc}") from None


def _count(path: Path, step: int, name: str, counts: Any, key: str, arg: str) -> int:
    """``by_domain[name][key]`` of the ``step``-th record as a count; PlanError naming the
    file, record and field when it is not a non-negative integer."""
    value = counts.get(key, 0) if isinstance(counts, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        what = (f"by_domain.{name} is {counts!r}" if not isinstance(counts, dict)
                else f"by_domain.{name}.{key} is {value!r}")
        raise PlanError(f"{arg} {path}: record {step}: {what}, "
                        "not a count: not a run's metrics")
    return value


def _dist(kind: str, mean: float, std: float, low: float, high: float = 1e9) -> Dist:
    if std <= 0:
        return const(min(max(mean, low), high))
    return Dist(kind, max(mean, low), std, low, high)  # type: ignore[arg-type]


def _std(xs: list[float]) -> float | None:
    return statistics.pstdev(xs) if len(xs) >= 2 else None


def measure_profiles(run_dir: str | Path, scenario: Scenario,
                     domains: tuple[str, ...] | None = None, *,
                     cli: bool = False) -> MeasuredProfiles:
    """The workload of each domain of ``scenario`` (or of ``domains``, a subset of its names)
    measured from ``run_dir`` (module docstring).

    Raises PlanError: ``run_dir`` is not a folder, has no (or an empty, or an unreadable)
    ``metrics.jsonl``, its steps carry no per-domain counters, a record of it or of
    ``transcripts.jsonl`` is not a run's (not a JSON object, counters that are not counts;
    the message names the file and record), or a domain finished no trajectory there (the
    message names the domains the run has). ``cli``: messages spell the arguments as
    ``rollart plan`` does (``--profiles-from``), else as ``rollart.plan(...)`` takes them."""
    arg = option("profiles_from", cli)
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PlanError(f"{arg} {run_dir}: not a folder")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise PlanError(f"{arg} {run_dir}: no metrics.jsonl (not a run folder, or a "
                        f"run that ended before its first step)")
    rows = _jsonl(metrics, arg)
    if not rows:
        raise PlanError(f"{arg} {run_dir}: metrics.jsonl holds no steps yet")
    totals: dict[str, dict[str, int]] = {}
    for i, row in enumerate(rows, 1):
        by_domain = row.get("by_domain") or {}
        if not isinstance(by_domain, dict):
            raise PlanError(f"{arg} {metrics}: record {i}: by_domain "
                            f"is a JSON {type(by_domain).__name__}, not an object: not a "
                            "run's metrics")
        for name, counts in by_domain.items():
            acc = totals.setdefault(name, dict.fromkeys(_COUNTERS, 0))
            for k in _COUNTERS:
                acc[k] += _count(metrics, i, name, counts, k, arg)
    if not totals:
        raise PlanError(f"{arg} {run_dir}: metrics.jsonl's {len(rows)} step(s) carry "
                        f"no per-domain counters (by_domain): a run of an older rollart")
    wanted = domains if domains is not None else tuple(d.name for d in scenario.domains)
    have = sorted(n for n, t in totals.items() if t["finished"] > 0 and t["finished_turns"] > 0)
    missing = [n for n in wanted if n not in have]
    if missing:
        raise PlanError(f"{arg} {run_dir}: no finished trajectory of domain(s) "
                        f"{missing} in metrics.jsonl ({len(rows)} step(s)); the run has "
                        f"{have or 'none'}: give those domains' profiles otherwise (profiles= in "
                        f"rollart.plan) "
                        f"or plan from a run that trained them")
    samples = _transcripts(run_dir / "transcripts.jsonl", arg)
    run = scenario.run
    by_name = {d.name: d for d in scenario.domains}
    out = MeasuredProfiles(run_dir, {}, {}, len(rows), {}, {}, _model_path(run_dir))
    for name in wanted:
        d, t, tr = by_name[name], totals[name], samples.get(name, _Transcripts())
        base = default_profile(name, d.env, d.max_turns or run.max_turns,
                               run.max_tokens_per_turn,
                               run.max_tokens_per_trajectory)
        turns = t["finished_turns"] / t["finished"]
        per_turn = max(1.0, t["finished_tokens"] / t["finished_turns"])
        got = ["num_turns", "response_tokens"]
        resp_std = _std(tr.generated)
        resp = Dist("lognormal", per_turn,
                    0.75 * per_turn if resp_std is None else resp_std, 1, 1e9)
        turns_std = _std(tr.turns)
        if turns_std is None:
            turns_std = 0.0 if turns <= 1.0 else turns / 4
        spec = dataclasses.replace(base, response_tokens=resp,
                                   num_turns=_dist("uniform", turns, turns_std, 1))
        if tr.prompt:
            spec = dataclasses.replace(spec, prompt_tokens=_dist(
                "normal", statistics.fmean(tr.prompt), _std(tr.prompt) or 0.0, 1))
            got.append("prompt_tokens")
        if tr.obs:
            spec = dataclasses.replace(spec, obs_tokens=_dist(
                "normal", statistics.fmean(tr.obs), _std(tr.obs) or 0.0, 1))
            got.append("obs_tokens")
        out.profiles[name], out.measured[name] = spec, tuple(got)
        out.trajectories[name], out.transcripts[name] = t["finished"], tr.records
    return out


#: what each measured ``DomainSpec`` field is, in words
_FIELD_WORDS = {"num_turns": "turns per trajectory", "response_tokens": "generated tokens per turn",
                "prompt_tokens": "prompt tokens", "obs_tokens": "observation tokens"}


def _model_path(run_dir: Path) -> str | None:
    """``model.path`` of the run's ``config.json`` (the resolved scenario it ran), or None."""
    import json

    try:
        path = json.loads((run_dir / "config.json").read_text())["model"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if isinstance(path, str) else None


@dataclass
class _Transcripts:
    records: int = 0
    prompt: list[float] = field(default_factory=list)
    obs: list[float] = field(default_factory=list)
    generated: list[float] = field(default_factory=list)
    turns: list[float] = field(default_factory=list)


def _transcripts(path: Path, arg: str) -> dict[str, _Transcripts]:
    """Per domain, the context and generated lengths of ``transcripts.jsonl``'s records
    (module docstring); records without the fields (or with fields of other types) are
    skipped, as are turns' token counts that are not integers."""
    out: dict[str, _Transcripts] = {}
    for rec in _jsonl(path, arg):
        name, turns = rec.get("domain"), rec.get("turns")
        if not isinstance(name, str) or not isinstance(turns, list) or not turns \
                or not all(isinstance(t, dict) for t in turns):
            continue
        acc = out.setdefault(name, _Transcripts())
        acc.records += 1
        n = rec.get("num_turns")
        if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
            n = len(turns)
        acc.turns.append(float(n))
        acc.generated += [float(t["num_tokens"]) for t in turns if _is_int(t.get("num_tokens"))]
        context = [t.get("context_tokens") for t in turns]
        if all(isinstance(c, int) for c in context):
            acc.prompt.append(float(context[0]))  # type: ignore[arg-type]
            acc.obs += [float(c) for c in context[1:]]  # type: ignore[arg-type]
        elif len(turns) == 1 and isinstance(rec.get("num_tokens"), int) \
                and isinstance(rec.get("num_generated"), int):
            acc.prompt.append(float(rec["num_tokens"] - rec["num_generated"]))
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
