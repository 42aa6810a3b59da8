"""``weight_transfer``: zmq push vs gloo collective broadcast, real processes (measured, NOT
simulated).

Two real trainer processes and two real vLLM CPU workers on one randomly initialised Qwen2
checkpoint (``--hidden-size`` / ``--num-layers``: ~70M parameters by default, ~2M with
``--quick``): trainer A with ``weight_transfer = "zmq"`` pushing to worker A, trainer B with
``"gloo"`` broadcasting to worker B. Each round (alternating A, B so load drift hits both) trains
one step and moves the new version the way the controller does:

- zmq: the push starts in the background when the step ends (``WaitPublished`` waits for it:
  ``total_s`` = the trainer's own transfer time); the controller then pauses, applies
  (reload from the staged buckets) and resumes: only that is **exposed** to rollout.
- gloo: the controller pauses, asks for the broadcast (vLLM's weight-transfer engine loads the
  tensors into the paused model), applies (relabel only) and resumes: **all** of it is exposed.

Reported per round: bytes, transfer seconds, exposed seconds; ratios: ``gloo exposed / zmq
exposed`` and ``gloo transfer / zmq transfer``. On GPUs NCCL would replace gloo (not measurable
here: no GPU); the CPU numbers say what the choice costs a CPU cluster.

Part ``delta`` (``benchmarks._delta_transfer``): full vs delta versions (``[trainer]
weight_delta``, bf16 wire, float32 masters) over a real GRPO run, per model and learning rate:
bytes on the wire per version, push (``transfer_s``) and exposed seconds. ``ratios``:
``delta_bytes_fraction`` (delta bytes / full bf16 bytes, mean over the versions after the first,
of the first model and lr; ci95 over those versions) and the same per (model, lr), and the
paired ``delta / full`` push and exposed seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._delta_transfer import run_delta, start_pair
from benchmarks.common import ci95, emit, result

NAME = "weight_transfer"
GROUP_NOTE = "8 x 24 tokens, rule reward"


def _samples(n: int) -> list[Any]:
    from rollart.transport import messages as m

    ids = [2, *range(10, 60)]
    return [m.TrainSample.from_lists(token_ids=ids, loss_mask=[0] * 10 + [1] * (len(ids) - 10),
                          behaviour_logprobs=[0.0] * 10 + [-5.0] * (len(ids) - 10),
                          advantage=1.0 if i % 2 else -1.0, sample_id=f"b{i}")
            for i in range(n)]


async def _round(kind: str, trainer: Any, worker: Any, base_version: int) -> dict[str, Any]:
    result_ = await trainer.train(base_version, _samples(4))
    version = result_.version
    t0 = time.perf_counter()
    if kind == "zmq":
        published = await trainer.wait_published(version)  # background push since step end
        t_exposed = time.perf_counter()
        await worker.pause("keep")
    else:
        t_exposed = t0
        await worker.pause("keep")
        published = await trainer.broadcast_version(version)
    await worker.apply_weights(version)
    await worker.resume()
    end = time.perf_counter()
    return {"path": kind, "version": version, "num_bytes": published.num_bytes,
            "transfer_s": published.total_s, "exposed_s": end - t_exposed,
            "train_step_s": result_.train_time_s}


async def _run(args: argparse.Namespace, run_dir: Path) -> list[dict[str, Any]]:
    from rollart.launcher.procs import Supervisor
    from rollart.models.tiny import build_tiny_model
    from rollart.transport.security import create_key_file, load_key_file

    # Authenticated, as in rollart run: CURVE encrypts the zmq path's buckets (gloo's are not).
    key_file = create_key_file(run_dir / "keys")
    auth = load_key_file(key_file)
    model = build_tiny_model(run_dir / "model", hidden_size=args.hidden_size,
                             num_layers=args.num_layers, num_heads=args.hidden_size // 64,
                             intermediate_size=4 * args.hidden_size)
    sup = Supervisor(run_dir)
    clients: list[Any] = []
    try:
        pairs = {}
        for kind in ("zmq", "gloo"):
            t, w = await start_pair(sup, kind, model, key_file, auth, ["--weight-transfer", kind],
                                    {"lr": 1e-4, "bucket_bytes": args.bucket_bytes,
                                     "weight_transfer": kind})
            clients += [w, t]
            pairs[kind] = (t, w)
        rows = []
        for r in range(args.rounds + 1):  # round 0 warms up (group formation, first reload)
            for kind in ("zmq", "gloo"):
                row = await _round(kind, *pairs[kind], base_version=r)
                row["round"] = r
                rows.append(row)
                print(f"[{NAME}] round {r} {kind}: transfer {row['transfer_s']:.3f} s, "
                      f"exposed {row['exposed_s']:.3f} s", file=sys.stderr, flush=True)
        return rows
    finally:
        for c in clients:
            await c.close()
        await sup.stop_all()


def delta_ratios(rows: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, list]]:
    """Per (model, lr): delta bytes fraction over versions after the first, and paired
    delta / full push and exposed seconds; the first (model, lr) also as
    ``delta_bytes_fraction``."""
    ratios: dict[str, float] = {}
    intervals: dict[str, list] = {}
    configs = list(dict.fromkeys((r["model"], r["lr"]) for r in rows))
    for n, (model, lr) in enumerate(configs):
        mine = [r for r in rows if (r["model"], r["lr"]) == (model, lr)]
        full = {r["version"]: r for r in mine if r["path"] == "full"}
        deltas = [r for r in mine if r["path"] == "delta" and r["version"] > 1]
        tag = f"{model} lr={lr}"
        series = {
            f"delta_bytes_fraction {tag}": [r["wire_bytes"] / r["num_bytes"] for r in deltas],
            f"delta / full transfer_s {tag}": [
                r["transfer_s"] / full[r["version"]]["transfer_s"] for r in deltas],
            f"delta / full exposed_s {tag}": [
                r["exposed_s"] / full[r["version"]]["exposed_s"] for r in deltas],
        }
        if n == 0:
            series["delta_bytes_fraction"] = series[f"delta_bytes_fraction {tag}"]
        for key, vals in series.items():
            ratios[key], intervals[key] = ci95(vals)
        ratios[f"max logprob diff full vs delta {tag}"] = max(
            r["logprob_diff_full_vs_delta"] for r in mine)
    return ratios, intervals


def ratios_of(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Means over the timed rounds (round 0 excluded) and the gloo / zmq ratios."""
    def mean(kind: str, key: str) -> float:
        return statistics.fmean(r[key] for r in rows if r["path"] == kind and r["round"] > 0)

    out = {f"{k} {key}": mean(k, key) for k in ("zmq", "gloo")
           for key in ("transfer_s", "exposed_s")}
    out["gloo / zmq exposed"] = out["gloo exposed_s"] / out["zmq exposed_s"]
    out["gloo / zmq transfer"] = out["gloo transfer_s"] / out["zmq transfer_s"]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__)
    p.add_argument("--quick", action="store_true", help="smaller model and fewer rounds")
    p.add_argument("--json", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--seed", type=int, default=0, help="unused (kept for run_all)")
    p.add_argument("--hidden-size", type=int, default=None, help="multiple of 64")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per path")
    p.add_argument("--bucket-bytes", type=int, default=64 << 20, help="zmq bucket size")
    p.add_argument("--parts", default="collective,delta",
                   help="comma-separated: collective (zmq vs gloo), delta (full vs delta)")
    p.add_argument("--lrs", default=None, help="delta part: learning rates, comma-separated")
    p.add_argument("--delta-rounds", type=int, default=None,
                   help="delta part: GRPO steps (versions) per model and lr")
    p.add_argument("--delta-models", default=None,
                   help="delta part: tiny (the project's tiny model) and/or large (built at "
                   "--hidden-size x --num-layers), comma-separated")
    args = p.parse_args(argv)
    defaults = {"hidden_size": 256 if args.quick else 1024,
                "num_layers": 2 if args.quick else 6, "rounds": 2 if args.quick else 3,
                "lrs": "1e-6" if args.quick else "1e-6,1e-5",
                "delta_rounds": 4 if args.quick else 8,
                "delta_models": "tiny" if args.quick else "tiny,large"}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.hidden_size % 64 or args.hidden_size < 64:
        p.error(f"--hidden-size must be a positive multiple of 64, got {args.hidden_size}")
    if args.num_layers < 1 or args.rounds < 1 or args.delta_rounds < 3:
        p.error("--num-layers and --rounds must be >= 1, --delta-rounds >= 3")
    args.parts = args.parts.split(",")
    try:
        args.lrs = [float(x) for x in args.lrs.split(",")]
    except ValueError:
        p.error(f"--lrs must be comma-separated numbers, got {args.lrs!r}")
    if not all(0 < lr < float("inf") for lr in args.lrs):
        p.error(f"--lrs must be positive and finite, got {args.lrs}")
    args.delta_models = args.delta_models.split(",")
    if set(args.parts) - {"collective", "delta"} or set(args.delta_models) - {"tiny", "large"}:
        p.error(f"unknown --parts {args.parts} or --delta-models {args.delta_models}")
    return args


async def _delta_part(args: argparse.Namespace, run_dir: Path) -> list[dict[str, Any]]:
    from rollart.models.tiny import build_tiny_model, ensure_tiny_model

    rows = []
    for label in args.delta_models:
        if label == "tiny":
            model = ensure_tiny_model(run_dir / "tiny")
        else:
            model = build_tiny_model(run_dir / "large", hidden_size=args.hidden_size,
                                     num_layers=args.num_layers,
                                     num_heads=args.hidden_size // 64,
                                     intermediate_size=4 * args.hidden_size)
            label = f"h{args.hidden_size}x{args.num_layers}"
        for i, lr in enumerate(args.lrs):
            rows += await run_delta(args, run_dir / f"delta-{label}-{i}", model, label, lr,
                                    args.delta_rounds)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    intervals: dict[str, list] = {}
    notes = "measured wall clock, real processes, one CPU worker per path"
    with tempfile.TemporaryDirectory(prefix="rollart-weight-transfer-") as tmp:
        if "delta" in args.parts:
            delta_rows = asyncio.run(_delta_part(args, Path(tmp)))
            rows += delta_rows
            ratios, intervals = delta_ratios(delta_rows)
            notes += (f"; delta: GRPO group {GROUP_NOTE}, lrs {args.lrs}, "
                      f"{args.delta_rounds} versions per (model, lr), bf16 wire, xor + zstd, "
                      "float32 masters, AdamW")
        if "collective" in args.parts:
            coll = asyncio.run(_run(args, Path(tmp)))
            rows += coll
            ratios.update(ratios_of(coll))
            notes += (f"; collective: Qwen2 hidden {args.hidden_size} x {args.num_layers} "
                      f"layers float32 ({coll[0]['num_bytes'] / 1e6:.1f} MB), {args.rounds} "
                      "timed rounds after one warm-up, alternating zmq / gloo")
    res = result(NAME, simulated=False, rows=rows, ratios=ratios, ci95=intervals,
                 quick=args.quick, seed=args.seed, notes=notes, started=started)
    emit(res, args.json)
    return res


if __name__ == "__main__":
    # The guard matters: vLLM spawns its engine core, which re-imports the main module.
    main()
