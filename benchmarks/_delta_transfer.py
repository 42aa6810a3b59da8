"""The delta half of ``benchmarks.weight_transfer``: full vs delta versions over a real RL run.

Per (model, lr): two real vLLM CPU workers and two real trainer processes, both trainers with a
bf16 wire and float32 master weights; trainer ``full`` sends every version in full, trainer
``delta`` sends it as an ``xor`` delta (``weight_full_every`` = 1000: every version after the
first is a delta, so the mean is over deltas only). Each round is one GRPO step of a real run:
the delta worker samples ``GROUP`` completions of one prompt (temperature 1, its behaviour
logprobs kept), a rule reward scores them (the share of generated tokens in the lower half of
the vocabulary: learnable, cheap), group-normalised advantages (GRPO); both trainers train on
the same samples, so their float32 masters and bf16 versions stay identical and the rows compare
like with like. Then each path moves the version as the controller does (``WaitPublished``,
pause, apply, resume; order alternating per round), and the two workers' prompt logprobs are
compared (they must agree: both serve the same bf16 weights).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

GROUP = 8
PROMPT = [2, 40, 41, 42, 5, 60, 61, 62, 63, 3, 7, 8]
MAX_TOKENS = 24


async def _rollout(worker: Any, rnd: int, vocab: int) -> tuple[list[Any], float]:
    from rollart.transport import messages as m
    from rollart.transport import tokenbytes as tb

    outs = []
    for i in range(GROUP):
        r = await worker.generate(m.Generate(
            request_id=f"roll-{rnd}-{i}", new_token_ids=tb.pack_i32(PROMPT),
            sampling=m.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, seed=1000 * rnd + i,
                                      temperature=1.0)))
        outs.append((tb.view_i32(r.token_ids).tolist(), tb.view_f32(r.logprobs).tolist()))
    rewards = [sum(t < vocab // 2 for t in ids) / len(ids) for ids, _ in outs]
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
    samples = [m.TrainSample.from_lists(
        token_ids=PROMPT + ids, loss_mask=[0] * len(PROMPT) + [1] * len(ids),
        behaviour_logprobs=[0.0] * len(PROMPT) + lps,
        advantage=(r - mean) / (std + 1e-6), sample_id=f"r{rnd}-{i}")
        for i, ((ids, lps), r) in enumerate(zip(outs, rewards, strict=True))]
    return samples, mean


async def _prompt_logprobs(worker: Any, ids: list[int]) -> list[float]:
    from rollart.transport import messages as m
    from rollart.transport import tokenbytes as tb

    r = await worker.generate(m.Generate(
        request_id=f"score-{time.monotonic_ns()}", new_token_ids=tb.pack_i32(ids),
        sampling=m.SamplingParams(max_tokens=1, prompt_logprobs=True)))
    return [float(x) for x in r.prompt_logprobs[1:]]


async def _move(kind: str, trainer: Any, worker: Any, version: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    published = await trainer.wait_published(version)
    t1 = time.perf_counter()
    if published.failed:
        raise RuntimeError(f"{kind}: the push of version {version} failed: {published.failed}")
    await worker.pause("keep")
    await worker.apply_weights(version)
    await worker.resume()
    return {"path": kind, "version": version, "num_bytes": published.num_bytes,
            "wire_bytes": published.wire_bytes, "is_delta": bool(published.delta_workers),
            "transfer_s": published.total_s, "wait_s": t1 - t0,
            "exposed_s": time.perf_counter() - t1}


async def start_pair(sup: Any, kind: str, model: Path, key_file: Path, auth: Any,
                     worker_flags: list[str], options: dict[str, Any]) -> tuple[Any, Any]:
    """Start one vLLM CPU worker (eager, float32, 256 MiB KV) and one trainer named ``kind``
    under ``sup``; returns ``(TrainerClient, InferenceClient)`` with the worker registered."""
    from rollart.inference.client import InferenceClient
    from rollart.launcher.procs import python_module
    from rollart.trainer.client import TrainerClient

    keyed = ["--key-file", str(key_file)]
    worker = await sup.start(f"worker-{kind}", python_module(
        "rollart.inference.worker", "--model", str(model), "--name", kind,
        "--dtype", "float32", "--enforce-eager", "--kv-cache-bytes", str(256 << 20),
        "--max-model-len", "256", *worker_flags, *keyed),
        env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, ready_timeout_s=600)
    trainer = await sup.start(f"trainer-{kind}", python_module(
        "rollart.trainer.service", "--model", str(model), "--options", json.dumps(options),
        *keyed), ready_timeout_s=600)
    w = InferenceClient(worker, auth=auth, name=kind, liveness_timeout_s=120)
    t = TrainerClient(trainer, auth=auth)
    try:
        await t.register_workers([worker])
    except BaseException:
        await w.close()
        await t.close()
        raise
    return t, w


async def run_delta(args: Any, run_dir: Path, model: Path, label: str, lr: float,
                    rounds: int) -> list[dict[str, Any]]:
    """Rows of one (model, lr): per path and version, bytes and seconds."""
    from rollart.launcher.procs import Supervisor
    from rollart.models.tokenizer import VOCAB_SIZE
    from rollart.transport.security import create_key_file, load_key_file

    key_file = create_key_file(run_dir / "keys")
    auth = load_key_file(key_file)
    sup = Supervisor(run_dir)
    clients: list[Any] = []
    try:
        pairs = {}
        for kind, delta in (("full", "off"), ("delta", "xor")):
            t, w = await start_pair(sup, kind, model, key_file, auth, [], {
                "lr": lr, "bucket_bytes": args.bucket_bytes, "weight_wire_dtype": "bf16",
                "weight_delta": delta, "weight_full_every": 1000})
            clients += [w, t]
            pairs[kind] = (t, w)
        rows = []
        for rnd in range(rounds):
            samples, reward = await _rollout(pairs["delta"][1], rnd, VOCAB_SIZE)
            order = ("full", "delta") if rnd % 2 == 0 else ("delta", "full")
            for kind in order:
                trainer, worker = pairs[kind]
                result = await trainer.train(rnd, samples)
                row = await _move(kind, trainer, worker, result.version)
                row.update(model=label, lr=f"{lr:g}", round=rnd, reward=reward,
                           train_step_s=result.train_time_s)
                rows.append(row)
            full_lp = await _prompt_logprobs(pairs["full"][1], PROMPT)
            delta_lp = await _prompt_logprobs(pairs["delta"][1], PROMPT)
            diff = max(abs(a - b) for a, b in zip(full_lp, delta_lp, strict=True))
            for row in rows[-2:]:
                row["logprob_diff_full_vs_delta"] = diff
            d = rows[-1] if rows[-1]["path"] == "delta" else rows[-2]
            print(f"[weight_transfer] {label} lr={lr:g} v{d['version']}: delta "
                  f"{d['wire_bytes'] / d['num_bytes']:.4f} of full, reward {reward:.3f}, "
                  f"logprob diff {diff:.2e}", file=sys.stderr, flush=True)
        return rows
    finally:
        for c in clients:
            await c.close()
        await sup.stop_all()
