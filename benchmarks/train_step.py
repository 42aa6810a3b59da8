"""``train_step``: the real trainer's step, lean vs recompute (measured, NOT simulated; CPU).

With one optimizer step per batch (``num_minibatches = 1``, the default) the trainer takes the
proximal logprobs of decoupled PPO from its training forward, detached, instead of a separate
no-grad forward (``rollart.trainer.step``): "lean". "recompute" is the same call with
``recompute_proximal=True`` (the pass every step ran before). Forward + backward costs ~6
FLOPs per parameter per token and a forward ~2 (Kaplan et al. 2020, Sec. 2.1), so a
compute-bound step should take ~6/8 = 0.75 of the time; fixed costs (collate, optimizer step,
clipping) raise the ratio on small models.

Models, built locally with random weights (``rollart.models.tiny``; the vocabulary is the
byte-level tokenizer's 261): ``tiny``, the default ``TinyModelSpec`` (hidden 128, 2 layers),
and ``larger`` (hidden 512, 4 layers, 8 heads, MLP 2048). Each model trains on a fixed batch
of random token sequences (half prompt, half generated; behaviour logprobs near the model's
own), ``repeats`` pairs of steps after one warm-up pair per path. Within a pair the two paths
run back to back, their order alternating between pairs, each path on its own copy of the
model and its own AdamW, so load drift on a shared machine hits both. The ratio is computed
per pair and reported as the geometric mean with a Student-t 95% interval of the log ratio;
``train step s: lean vs recompute`` pools the pairs of both models. Torch runs on one thread
and a step's time is the CPU seconds of that thread (``time.thread_time``: on an idle machine
its wall time; on a shared one it leaves out the time other processes held the core); the
same ratios over wall-clock seconds are reported too (``... (wall)``).
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from typing import Any

from benchmarks.common import main_for, result, t975

NAME = "train_step"
#: the ratio the acceptance reads
HEADLINE = "train step s: lean vs recompute"


def _models(quick: bool) -> list[tuple[str, Any, int, int]]:
    """(name, TinyModelSpec, samples per batch, tokens per sample)."""
    from rollart.models.tiny import TinyModelSpec

    tiny = TinyModelSpec(seed=0)
    larger = TinyModelSpec(seed=0, hidden_size=512, num_layers=4, num_heads=8,
                           intermediate_size=2048)
    if quick:
        return [("tiny", tiny, 16, 256), ("larger", larger, 8, 128)]
    return [("tiny", tiny, 32, 512), ("larger", larger, 16, 256)]


def _batch(model: Any, num_samples: int, num_tokens: int, seed: int) -> list:
    import torch

    from rollart.trainer.step import TrainSample, token_logprobs

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num_samples):
        ids = torch.randint(5, 256, (num_tokens,), generator=g)
        mask = [0] * (num_tokens // 2) + [1] * (num_tokens - num_tokens // 2)
        with torch.no_grad():
            lp = token_logprobs(model, ids[None], torch.ones_like(ids[None]))[0]
        jitter = 0.05 * torch.randn(num_tokens, generator=g)
        blp = [min(float(v + j), 0.0) if m else 0.0
               for v, j, m in zip(lp, jitter, mask, strict=True)]
        out.append(TrainSample.from_lists(token_ids=ids.tolist(), loss_mask=mask,
                                          behaviour_logprobs=blp,
                                          advantage=1.0 if i % 2 else -1.0,
                                          sample_id=f"s{i}", domain="bench"))
    return out


def _log_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of ``ratios`` and the Student-t 95% interval of the mean log ratio."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.nan, math.nan
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def _measure(spec: Any, num_samples: int, num_tokens: int, repeats: int,
             seed: int) -> tuple[dict[str, Any], list[float], list[float]]:
    import torch

    from rollart.models.tiny import init_tiny_model
    from rollart.trainer.step import TrainStepConfig, train_step

    base = init_tiny_model(spec)
    batch = _batch(base, num_samples, num_tokens, seed)
    cfg = TrainStepConfig(max_tokens_per_microbatch=max(4096, num_tokens))
    paths = {}
    for name, recompute in (("lean", None), ("recompute", True)):
        model = copy.deepcopy(base)
        paths[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-5), recompute)
    times: dict[str, list[float]] = {"lean": [], "recompute": []}
    walls: dict[str, list[float]] = {"lean": [], "recompute": []}
    metrics: dict[str, dict[str, float]] = {}
    for r in range(repeats + 1):  # pair 0 warms up both paths and is not counted
        order = ("lean", "recompute") if r % 2 == 0 else ("recompute", "lean")
        for name in order:
            model, opt, recompute = paths[name]
            t0, w0 = time.thread_time(), time.perf_counter()
            metrics[name] = train_step(model, opt, batch, cfg, recompute_proximal=recompute)
            if r:
                times[name].append(time.thread_time() - t0)
                walls[name].append(time.perf_counter() - w0)
    ratios = [a / b for a, b in zip(times["lean"], times["recompute"], strict=True)]
    wall_ratios = [a / b for a, b in zip(walls["lean"], walls["recompute"], strict=True)]
    mean, lo, hi = _log_interval(ratios)
    wall_mean, _, _ = _log_interval(wall_ratios)
    row = {
        "name": "",
        "params_m": round(sum(p.numel() for p in base.parameters()) / 1e6, 2),
        "samples": num_samples,
        "tokens_per_step": num_samples * num_tokens,
        "microbatches": metrics["lean"]["num_microbatches"],
        "lean_cpu_s": statistics.median(times["lean"]),
        "recompute_cpu_s": statistics.median(times["recompute"]),
        "lean/recompute": round(mean, 4),
        "ci95": f"[{lo:.3f}, {hi:.3f}]",
        "lean_wall_s": statistics.median(walls["lean"]),
        "recompute_wall_s": statistics.median(walls["recompute"]),
        "lean/recompute (wall)": round(wall_mean, 4),
        # Both paths train the same: their last losses agree (same updates on copies).
        "loss_lean": metrics["lean"]["loss"],
        "loss_recompute": metrics["recompute"]["loss"],
    }
    return row, ratios, wall_ratios


def run(quick: bool, seed: int) -> dict[str, Any]:
    import torch

    started = time.perf_counter()
    torch.set_num_threads(1)
    repeats = 8 if quick else 16
    rows, pooled, pooled_wall = [], [], []
    ratios: dict[str, float] = {}
    ci95: dict[str, list[float]] = {}

    def add(key: str, per_pair: list[float]) -> None:
        ratios[key], lo, hi = _log_interval(per_pair)
        ci95[key] = [lo, hi]

    for name, spec, num_samples, num_tokens in _models(quick):
        row, per_pair, per_pair_wall = _measure(spec, num_samples, num_tokens, repeats, seed)
        rows.append({**row, "name": name})
        pooled += per_pair
        pooled_wall += per_pair_wall
        add(f"{name}: {HEADLINE}", per_pair)
        add(f"{name}: {HEADLINE} (wall)", per_pair_wall)
    add(HEADLINE, pooled)
    add(f"{HEADLINE} (wall)", pooled_wall)
    notes = (f"{repeats} interleaved pairs per model after a warm-up pair; torch "
             f"{torch.__version__}, 1 thread, CPU seconds of the step (wall: '(wall)'); "
             f"FLOP model 6/8 = 0.75 for a compute-bound step")
    return result(NAME, simulated=False, rows=rows, ratios=ratios, ci95=ci95, quick=quick,
                  seed=seed, notes=notes, started=started)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return main_for(NAME, "the real trainer's step: lean (no proximal recompute) vs "
                    "recompute, side by side", run, argv)


if __name__ == "__main__":
    main()
