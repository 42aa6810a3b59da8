"""Does rollart's GRPO learn as well as a reference implementation nobody here wrote?

    python -m benchmarks.learning --quick --json OUT [--seeds N] [--steps S]
        [--task letters|game] [--env rg:NAME] [--env-options JSON] [--eval-every K]
        [--eval-size N] [--model-dir DIR] [--cache-dir DIR] [--sides rollart trl]
        [--time-to-score]

Both sides train the same warmed-up tiny checkpoint (``WARMUP``) on the same task (default
``rg:letter_counting`` over 3-6 words) with the same prompts (rendered by
``rollart.models.warmup.render_prompt``; step k's env seeds are those rollart's controller
draws for its step k: ``learning_task.training_seeds``), group size, batch, learning rate,
PPO clip, KL coefficient, temperature, max new tokens and scorer (reasoning-gym's own
``score_answer``, the reward service's ``reasoning_gym`` function):

- ``rollart sync``: ``rollart run`` on a generated scenario in ``sync`` mode (real services:
  a vLLM worker, env host, reward service and trainer), checkpointing every ``eval_every`` steps;
- ``trl``: TRL's ``GRPOTrainer`` (transformers generation, CPU), ``learning_trl.TRL_SETTINGS``.

``--task game`` trains GEM's GuessTheNumber-v0-easy instead (4 turns, win rate; the
quickstart's warmed-up policy): TRL plays it through its ``rollout_func`` hook
(``learning_game.trl_rollout``, tokenised as rollart's controller tokenises a trajectory,
observation tokens masked with ``env_mask``), and the held-out evaluator plays each game
greedily and sampled (``learning_game.evaluate_game``).

ONE evaluator (``learning_task.evaluate``: greedy decoding of a fixed held-out set whose env
seeds no training or warm-up episode uses, scored by the same scorer) runs on both sides'
weights at steps 0, K, 2K, ... and the last. Ratio ``final eval: rollart sync vs trl`` is the
per-seed ratio of final held-out accuracies (paired by seed), its ``ci95`` a Student-t interval
over seeds (``benchmarks.common.ci95``). ``majority_baseline`` is the best constant answer's
accuracy on the same held-out set, measured by scoring candidate constants.

``--time-to-score`` also trains rollart in modes ``rollart`` (alpha 1) and ``one_off`` on the
same seeds: ratios ``time to score: rollart vs sync`` / ``vs one_off`` are the other mode's
training seconds over mode rollart's to reach a held-out accuracy every mode reaches
(``time_to_score``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.common import ci95, emit, result
from benchmarks.learning_task import (
    LearningSettings,
    Task,
    evaluate,
    heldout_tasks,
    load_rollart_weights,
    majority_baseline,
    scenario_toml,
)

NAME = "learning"
QUICK = LearningSettings(steps=20, eval_every=5, eval_size=200)
FULL = LearningSettings(steps=60, eval_every=10, eval_size=500)
#: how long one side's training of one seed may take before the benchmark gives up, seconds
RUN_TIMEOUT_S = 3600.0

#: Warm-up of the shared starting checkpoint (``rollart.models.warmup.WarmupRecipe`` fields).
#: The quickstart's recipe (100 episodes, one epoch) on this single domain is 7 SFT steps: its
#: model answers greedily but samples near-uniform bytes at temperature 1 (mean reward 0.03, 69%
#: of replies cut at 16 tokens), leaving RL no signal. 400 episodes, two epochs (50 steps, ~30 s):
#: \\boxed{} replies, sampled reward ~0.28 on 64 held-out tasks, greedy = the majority answer.
WARMUP = {"episodes_per_domain": 400, "epochs": 2, "lr": 3e-3}

#: ``--task game``: GEM's GuessTheNumber-v0-easy (1..10, 4 turns; a won game scores 1, the
#: ``env_success`` reward), a skill the tiny policy partly learns from the solver's bisection
#: demonstrations and that RL can improve (the quickstart's domain).
GAME = {"env": "game:GuessTheNumber-v0-easy", "env_options": {}, "max_turns": 4}
#: the game's starting checkpoint: the quickstart's warmed-up policy (``[model]`` of this
#: scenario; built once and cached, shared with ``rollart run scenarios/quickstart.toml``)
GAME_MODEL_FROM = Path(__file__).resolve().parents[1] / "scenarios" / "quickstart.toml"

#: rollart settings TRL has no counterpart for, and how this benchmark sets them
ROLLART_OFF = {
    "run.mode": "sync (on-policy: alpha 0, no staleness, no rollout / training overlap)",
    "run.redundancy": "1 (no extra rollouts per group)",
    "trainer.num_minibatches": "1 (one optimizer step per batch: PPO ratio 1 at the update)",
    "trainer.clip_eps_high": "unset (symmetric clip, TRL epsilon_high = epsilon)",
    "importance weight w = pi_trainer / pi_vllm (cap 5, truncate)": (
        "not configurable; in sync mode it is the engine-vs-trainer numerical mismatch only "
        "(recorded as iw_max / logprob_mismatch); TRL without vLLM samples from the trained "
        "model itself (w = 1)"),
}

#: known differences that remain (not switchable on either side without code changes)
REMAINING = {
    "advantage std": "rollart: population std (/ n) + 1e-6; TRL: Bessel std (/ (n - 1)) + 1e-4:"
                     " TRL's advantages are sqrt((n-1)/n) = 0.87x rollart's at group 4 (Adam "
                     "normalises a constant gradient scale; gradient clipping may not)",
    "sampler": "rollart: vLLM (CPU); TRL: transformers generate",
}


def _warm_model(s: LearningSettings, cache_dir: Path) -> Path:
    from benchmarks.learning_task import parse
    from rollart.models.sft import SFTConfig
    from rollart.models.warmup import WarmupRecipe, ensure_warm_tiny_model

    if s.is_game:
        from rollart.config import load_scenario
        from rollart.models.warmup import ensure_quickstart_model

        return ensure_quickstart_model(cache_dir, load_scenario(GAME_MODEL_FROM))
    domains = parse(scenario_toml(s, seed=0, model_path="tiny")).domains
    recipe = WarmupRecipe(episodes_per_domain=WARMUP["episodes_per_domain"], sft=SFTConfig(
        epochs=WARMUP["epochs"], lr=WARMUP["lr"], num_threads=1))
    return ensure_warm_tiny_model(cache_dir, domains, model_seed=s.model_seed, max_turns=1,
                                  recipe=recipe)


def warmup_of(s: LearningSettings) -> dict[str, Any] | str:
    """What ``s``'s starting checkpoint is: ``WARMUP``'s recipe, or for a game the scenario
    whose ``[model]`` it is."""
    return str(GAME_MODEL_FROM.relative_to(GAME_MODEL_FROM.parents[1])) if s.is_game \
        else WARMUP


def train_rollart(s: LearningSettings, model_dir: Path, heldout: list[Task], seed: int,
                  run_dir: Path, cache_dir: Path, mode: str = "sync") -> dict[str, Any]:
    """``rollart run`` of ``s`` in ``mode`` from ``model_dir``; held-out evaluation of its
    checkpoints at ``s.eval_steps()`` (step 0 left to the caller). Same return layout as
    ``learning_trl.train_trl`` plus ``iw_max`` and ``logprob_mismatch`` (max over steps).
    Raises RuntimeError when the run fails (its log's tail in the message)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir.mkdir(parents=True, exist_ok=True)
    scenario = run_dir.parent / f"{run_dir.name}.toml"
    scenario.write_text(scenario_toml(s, seed=seed, model_path=str(model_dir), mode=mode))
    log = run_dir.parent / f"{run_dir.name}.log"
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "rollart.cli", "run", str(scenario), "--out", str(run_dir),
             "--cache-dir", str(cache_dir)],
            stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"rollart run (seed {seed}) exited {proc.returncode}:\n{tail}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    evals = {}
    for k in s.eval_steps()[1:]:
        load_rollart_weights(model, run_dir / "checkpoints" / f"step_{k:06d}")
        evals[k] = evaluate(s, model, tokenizer, heldout)
    trained = [json.loads(line) for line in
               (run_dir / "trained_samples.jsonl").read_text().splitlines()]
    # TRL's step k trains groups [k P, (k + 1) P) of the same seed list (shuffle off): say
    # whether rollart's steps trained exactly those groups.
    same_prompts = all(
        {int(sid.split("/")[0].removeprefix("g")) for sid in rec["sample_ids"]}
        == set(range((rec["step"] - 1) * s.prompts_per_step, rec["step"] * s.prompts_per_step))
        for rec in trained)
    train = [st.get("train_metrics", {}) for st in steps]
    elapsed, step_wall = 0.0, []
    for st in steps:
        elapsed += st["step_time_s"]
        step_wall.append(elapsed)
    return {"eval": evals, "train_reward": [st["reward_mean"] for st in steps],
            "step_wall_s": step_wall, "wall_s": wall, "same_prompts_as_trl": same_prompts,
            "iw_max": max((t.get("iw_max", 1.0) for t in train), default=1.0),
            "logprob_mismatch": max((t.get("logprob_mismatch", 0.0) for t in train),
                                    default=0.0)}


#: the other modes ``--time-to-score`` trains (beside ``rollart sync``)
TTS_SIDES = ("rollart rollart", "rollart one_off")
#: the held-out score time to score is measured on: sampled, because the greedy answer of the
#: default task's tiny model stays the majority answer through a short run
#: (docs/performance/learning.md)
TTS_METRIC = "sampled_accuracy"


def time_to_score(runs: dict[str, dict[str, Any]],
                  metric: str = TTS_METRIC) -> dict[str, Any]:
    """Training wall time each run takes to reach a held-out accuracy every run reaches.

    ``runs``: side -> a ``train_rollart`` result (with step 0 in ``eval``). The target is the
    highest ``metric`` that every run reaches at some evaluated step after 0 (the minimum over
    runs of their best); a run's time is the sum of its ``step_time_s`` up to the first
    evaluated step at or above it (services' start and evaluation left out). Returns
    ``{"metric": str, "target": float, "step": {side: int}, "seconds": {side: float}}``."""
    best = {side: max(ev[metric] for k, ev in out["eval"].items() if k > 0)
            for side, out in runs.items()}
    target = min(best.values())
    step, seconds = {}, {}
    for side, out in runs.items():
        k = min(k for k, ev in out["eval"].items() if k > 0 and ev[metric] >= target)
        step[side], seconds[side] = k, out["step_wall_s"][k - 1]
    return {"metric": metric, "target": target, "step": step, "seconds": seconds}


def _ratio(a: float, b: float) -> float:
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def run(s: LearningSettings, seeds: list[int], cache_dir: Path, work: Path,
        sides: tuple[str, ...] = ("rollart sync", "trl"),
        quick: bool = True, started: float | None = None,
        model_dir: Path | None = None) -> dict[str, Any]:
    """Train every side on every seed from ``model_dir`` (``None``: the task's warmed-up tiny
    model), evaluate, and build the benchmark's JSON object."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.learning_trl import TRL_SETTINGS, train_trl

    model_dir = model_dir or _warm_model(s, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    heldout = heldout_tasks(s, tokenizer)
    constant, baseline = majority_baseline(s, heldout)
    start = evaluate(s, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                     tokenizer, heldout)
    rows: list[dict[str, Any]] = []
    per_side: dict[str, dict[int, dict[str, Any]]] = {side: {} for side in sides}
    for seed in seeds:
        for side in sides:
            print(f"[learning] {side}, seed {seed} ...", flush=True)
            if side == "trl":
                out = train_trl(s, model_dir, heldout, seed, work / f"trl-{seed}")
            else:
                mode = side.removeprefix("rollart ")
                out = train_rollart(s, model_dir, heldout, seed,
                                    work / f"rollart-{mode}-{seed}", cache_dir, mode=mode)
            out["eval"] = {0: start, **out["eval"]}
            per_side[side][seed] = out
            for step, ev in sorted(out["eval"].items()):
                rows.append({"side": side, "seed": seed, "step": step, **ev})
            print(f"[learning] {side}, seed {seed}: final accuracy "
                  f"{out['eval'][s.steps]['accuracy']:.3f} in {out['wall_s']:.0f} s", flush=True)
    ratios: dict[str, float] = {}
    intervals: dict[str, list[float]] = {}
    if {"rollart sync", "trl"} <= set(sides):
        ours, ref = per_side["rollart sync"], per_side["trl"]
        for key, of in (
                ("final eval: rollart sync vs trl",
                 lambda out: out["eval"][s.steps]["accuracy"]),
                ("final sampled eval: rollart sync vs trl",
                 lambda out: out["eval"][s.steps]["sampled_accuracy"]),
                ("train reward, last half: rollart sync vs trl",
                 lambda out: statistics.fmean(out["train_reward"][s.steps // 2:]))):
            ratios[key], intervals[key] = ci95([_ratio(of(ours[sd]), of(ref[sd]))
                                                for sd in seeds])
    if {"rollart sync", *TTS_SIDES} <= set(sides):
        tts = {sd: time_to_score({side: per_side[side][sd] for side in
                                  ("rollart sync", *TTS_SIDES)}) for sd in seeds}
        for other in ("sync", "one_off"):
            key = f"time to score: rollart vs {other}"
            ratios[key], intervals[key] = ci95([
                _ratio(tts[sd]["seconds"][f"rollart {other}"], tts[sd]["seconds"]["rollart rollart"])
                for sd in seeds])
    curves = {f"{side} {metric}": {
        str(k): statistics.fmean(per_side[side][sd]["eval"][k][metric] for sd in seeds)
        for k in s.eval_steps()} for side in sides for metric in ("accuracy", "sampled_accuracy")}
    res = result(NAME, simulated=False, rows=rows, ratios=ratios, quick=quick, seed=seeds[0],
                 started=started, ci95=intervals, seeds=seeds,
                 notes="held-out greedy accuracy; ratio per seed, Student-t 95% CI over seeds")
    res["majority_baseline"] = baseline
    res["majority_answer"] = constant
    res["start_eval"] = start
    res["curves"] = curves
    res["train_reward"] = {side: {str(sd): per_side[side][sd]["train_reward"] for sd in seeds}
                           for side in sides}
    res["wall_s"] = {side: {str(sd): round(per_side[side][sd]["wall_s"], 1) for sd in seeds}
                     for side in sides}
    if "rollart sync" in sides:
        res["rollart_importance_weight"] = {
            str(sd): {k: per_side["rollart sync"][sd][k]
                      for k in ("iw_max", "logprob_mismatch", "same_prompts_as_trl")}
            for sd in seeds}
    if {"rollart sync", *TTS_SIDES} <= set(sides):
        res["time_to_score"] = {str(sd): tts[sd] for sd in seeds}
    res["settings"] = {**asdict(s), "batch_size": s.batch_size, "model": str(model_dir),
                       "warmup": warmup_of(s)}
    res["trl_settings"] = {k: {"value": v, "why": why} for k, (v, why) in TRL_SETTINGS.items()}
    res["rollart_turned_off"] = ROLLART_OFF
    res["remaining_differences"] = REMAINING
    res["load_average_at_start"] = _load()
    return res


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__
                                .split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK.steps} steps, held-out set of {QUICK.eval_size} (default: "
                   f"{FULL.steps} steps, {FULL.eval_size} tasks)")
    p.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=3, help="seeds per side (default 3)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    p.add_argument("--eval-every", type=int, default=None, help="steps between evaluations")
    p.add_argument("--eval-size", type=int, default=None, help="held-out tasks")
    p.add_argument("--task", choices=("letters", "game"), default="letters",
                   help="letters: reasoning-gym letter_counting (single turn, default); game: "
                   "GEM GuessTheNumber-v0-easy (4 turns, win rate)")
    p.add_argument("--env", default=None, help="single-turn reasoning-gym task, rg:NAME "
                   "(default rg:letter_counting; with --task letters)")
    p.add_argument("--env-options", type=json.loads, default=None,
                   help='the dataset\'s options as JSON (default {"min_words": 3, '
                   '"max_words": 6} for the default task, else {})')
    p.add_argument("--sides", nargs="+", choices=("rollart", "trl"), default=["rollart", "trl"])
    p.add_argument("--time-to-score", action="store_true",
                   help="also train rollart in modes rollart (alpha 1) and one_off on the same "
                   "seeds: ratios 'time to score: rollart vs sync / one_off'")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="start both sides from this checkpoint (a Hugging Face model directory "
                   "with the tiny model's tokenizer) instead of the task's warmed-up tiny model")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="model cache (default: rollart's per-user cache)")
    return p


def settings_from(args: argparse.Namespace, parser: argparse.ArgumentParser
                  ) -> LearningSettings:
    """The settings ``args`` ask for. Exits with status 2 (parser.error) on bad values."""
    s = QUICK if args.quick else FULL
    if args.task == "game":
        if args.env is not None or args.env_options is not None:
            parser.error("--env / --env-options choose a reasoning-gym task: not with "
                         "--task game")
        s = replace(s, **GAME)
    if args.env is not None:
        if not args.env.startswith("rg:"):
            parser.error(f"--env must be a reasoning-gym task rg:NAME, got {args.env!r}")
        s = replace(s, env=args.env, env_options={})
    if args.env_options is not None:
        if not isinstance(args.env_options, dict):
            parser.error(f"--env-options must be a JSON object, got {args.env_options!r}")
        s = replace(s, env_options=args.env_options)
    for name in ("steps", "eval_every", "eval_size"):
        value = getattr(args, name)
        if value is not None:
            if value < 1:
                parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
            s = replace(s, **{name: value})
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.model_dir is not None and not (args.model_dir / "config.json").is_file():
        parser.error(f"--model-dir {args.model_dir}: no config.json there (a Hugging Face "
                     "model directory)")
    return s


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = _parser()
    args = parser.parse_args(argv)
    s = settings_from(args, parser)
    sides = tuple("rollart sync" if x == "rollart" else x for x in dict.fromkeys(args.sides))
    if args.time_to_score:
        if "rollart sync" not in sides:
            parser.error("--time-to-score compares rollart's modes: keep rollart in --sides")
        sides += TTS_SIDES
    if "trl" in sides:
        from benchmarks.learning_trl import trl_available

        if not trl_available():
            parser.error("trl is not installed: pip install -e .[cpu,dev,learning] "
                         "(or nox -s learning)")
    from rollart.config import ConfigError
    from rollart.launcher.local import default_cache_dir

    started = time.perf_counter()
    cache_dir = args.cache_dir or default_cache_dir()
    seeds = [args.seed + i for i in range(args.seeds)]
    try:
        with tempfile.TemporaryDirectory(prefix="rollart-learning-") as tmp:
            res = run(s, seeds, cache_dir, Path(tmp), sides, quick=args.quick, started=started,
                      model_dir=args.model_dir)
    except ConfigError as exc:  # e.g. unknown dataset or bad options in the scenario
        parser.error(str(exc))
    res["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    emit(res, args.json)
    return res


if __name__ == "__main__":
    main()
