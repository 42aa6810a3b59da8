"""``rollart run SCENARIO.toml [--out DIR] [--steps N] [--resume DIR]``: a whole run, locally.

Starts every process the scenario needs (reward service, env hosts, inference workers, trainer)
with logs under ``DIR/logs``, drives them with the controller in this process, and stops them
all at the end, on Ctrl-C, or as soon as one dies (naming it and showing its log tail).
Rewards and envs of your own Python file (``run.local_module``: its ``REWARDS`` / ``ENVS``
dicts, ``rollart.launcher.localmodule``) run in this process, as a driver script's would.

Outputs: ``DIR/config.json`` (resolved scenario), ``DIR/metrics.jsonl`` (one object per step),
``DIR/trained_samples.jsonl`` (sample ids per step: exactly-once evidence across resumes),
``DIR/transcripts.jsonl`` (decoded trajectories), ``DIR/tensorboard/``, ``DIR/summary.json``
and ``DIR/checkpoints/step_NNNNNN`` (every ``trainer.checkpoint_every`` steps and at the end):
the run folder of ``rollart.launcher.rundir``, written the same way for a driver script.
``--resume DIR`` continues a run directory from its newest checkpoint. What it would refuse (the
scenario's services, this machine: ``rollart.launcher.machine``) is refused before any process
starts; the run ends with a summary block (``progress.summary_block``).

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
import gc
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rollart.config import Scenario, in_file, load_scenario
from rollart.controller.evaluation.stats import eval_line
from rollart.controller.observe.loophealth import freeze_startup_objects, tune_gc
from rollart.filemodes import apply_umask
from rollart.launcher.cliargs import path_arg
from rollart.launcher.procs import ProcessFailedError
from rollart.launcher.progress import Progress, plural, print_summary_block, summary_block
from rollart.launcher.rundir import (
    earlier_wall_time_s,
    resume_mismatch,
    resume_point,
    write_summary,
)
from rollart.launcher.sigterm import Terminated, sigterm_cancels
from rollart.transport.errors import ConfigError, RollartError

log = logging.getLogger("rollart.run")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rollart run", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("scenario", type=path_arg, help="scenario TOML file")
    p.add_argument("--out", type=path_arg, help="run directory (default runs/<scenario>-<time>)")
    p.add_argument("--steps", type=int, help="total training steps (overrides run.steps)")
    p.add_argument("--resume", type=path_arg, help="run directory to continue from its checkpoint")
    p.add_argument("--cache-dir", type=path_arg, default=None,
                   help="where the embedded tiny model is built and cached (default "
                        "$ROLLART_CACHE_DIR, else $XDG_CACHE_HOME/rollart, else "
                        "~/.cache/rollart)")
    p.add_argument("--insecure", action="store_true",
                   help="run the ZeroMQ services without authentication (loopback only, unless "
                        "the scenario also sets run.insecure = true); default: a CURVE key per "
                        "run in DIR/keys")
    p.add_argument("--key-file", type=path_arg,
                   help="the run's key (.key_secret) when the scenario names services started "
                        "by hand with it (overrides run.key_file)")
    p.add_argument("--cluster", default="local", metavar="local|ray|ray://HOST:PORT",
                   help="where the services run: this machine (default), or placed on a running "
                        "Ray cluster by their hardware labels (needs rollart[ray]; the "
                        "controller stays here)")
    p.add_argument("--checkpoint-on-interrupt", action="store_true",
                   help="on the first Ctrl-C / SIGTERM finish the current step, write a "
                        "checkpoint and stop (a second signal stops at once)")
    return p.parse_args(argv)


def resume_command(args: argparse.Namespace, run_dir: Path) -> str:
    """The ``rollart run`` command line that continues ``run_dir`` with this run's options
    (``--steps``, ``--cache-dir``, the key, the cluster, ...; not ``--out``: the folder is
    ``--resume``'s), shell-quoted."""
    argv = ["rollart", "run", str(args.scenario), "--resume", str(run_dir)]
    for flag, value in (("--steps", args.steps), ("--cache-dir", args.cache_dir),
                        ("--key-file", args.key_file)):
        if value is not None:
            argv += [flag, str(value)]
    if args.cluster != "local":
        argv += ["--cluster", args.cluster]
    argv += [flag for flag, on in (("--insecure", args.insecure),
                                   ("--checkpoint-on-interrupt", args.checkpoint_on_interrupt))
             if on]
    return shlex.join(argv)


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


async def _drive(scenario: Scenario, run_dir: Path, cache_dir: Path | None, planned: int,
                 start_step: int, resume: bool, started: float, *,
                 scenario_dir: Path | None = None, insecure: bool = False,
                 key_file: Path | None = None, checkpoint_on_interrupt: bool = False,
                 cluster: str | None = None, source: str = "<scenario>") -> int:
    from rollart.launcher.local import open_cluster

    progress = Progress(scenario, planned)
    stop = StopRequest()
    main_task = asyncio.current_task()
    assert main_task is not None

    def checkpoint_first(signum: int, name: str) -> bool:
        """Under --checkpoint-on-interrupt the first signal finishes the step (True: handled)."""
        if stop.signum is not None:
            return False
        stop.signum = signum
        progress.note(f"{name}: finishing this step, then a checkpoint (again: stop now)")
        return True

    def on_sigint() -> None:
        if not checkpoint_first(signal.SIGINT, "Ctrl-C"):
            main_task.cancel()

    loop = asyncio.get_running_loop()
    if checkpoint_on_interrupt:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    # SIGTERM (e.g. `timeout`, a scheduler) stops the run as Ctrl-C does: every service's whole
    # process group is stopped, vLLM's engine-core children included (rollart.launcher.sigterm).
    intercept = ((lambda: checkpoint_first(signal.SIGTERM, "SIGTERM"))
                 if checkpoint_on_interrupt else None)
    try:
        with sigterm_cancels(intercept):
            async with open_cluster(
                scenario, run_dir=run_dir, cache_dir=cache_dir, resume=resume, steps=planned,
                on_note=progress.note, started=started, insecure=insecure, key_file=key_file,
                scenario_dir=scenario_dir, source=source, cluster=cluster,
            ) as opened:
                return await _train(opened, start_step, planned, progress, stop)
    except asyncio.CancelledError:
        if stop.signum == signal.SIGINT:  # the second Ctrl-C
            raise KeyboardInterrupt from None
        raise
    finally:
        progress.close()


async def _train(cluster: Any, start_step: int, planned: int, progress: Progress,
                 stop: StopRequest | None = None) -> int:
    # The run folder (metrics, transcripts, TensorBoard, checkpoints) is written by
    # open_cluster's step hook (rollart.launcher.rundir), as for a driver script.
    folder = cluster.run_folder
    # The run folder's step hook checkpoints a step before `train` yields it: its "checkpoint
    # saved" line waits for the step's row, so the row of the step it saved comes first.
    after_row: list[str] = []
    if cluster.run_folder is not None:  # (test fakes have none)
        cluster.run_folder.on_note = after_row.append

    def flush_after_row() -> None:
        for text in after_row:
            progress.note(text)
        after_row.clear()

    async with cluster:
        # Started: modules, config, clients and the controller exist; later collections need
        # not traverse them again (rollart.controller.observe.loophealth).
        freeze_startup_objects()
        try:
            async for out in cluster.train(steps=planned - start_step):
                # In the order things happened: an evaluation that started before this step
                # ended (the one before step 1: before it began) is printed before its row,
                # the one after the last step after it.
                for record in out.metrics.eval:
                    if record.at_step < out.step:
                        progress.note(eval_line(record))
                progress.step(out.step, out.metrics)
                flush_after_row()
                for record in out.metrics.eval:
                    if record.at_step >= out.step:
                        progress.note(eval_line(record))
                if stop is not None and stop.signum is not None and out.step < planned:
                    path = folder.last_checkpoint
                    if folder.last_checkpoint_step != out.step:  # not due by checkpoint_every
                        path = await folder.checkpoint(cluster, out.step,
                                                       out.metrics.policy_version)
                    raise Interrupted(stop.signum, out.step, path)
        finally:
            flush_after_row()  # the checkpoint an interrupt wrote after its step's row
            # Frozen objects outlive the interpreter's last collection: nanobind (triton's
            # bindings, imported with torch by transformers) would report each one as leaked
            # on stderr at exit, ~30 lines that read like a crash.
            gc.unfreeze()
    return 0


def main(argv: list[str] | None = None) -> int:
    # transformers' per-file progress bars would interleave with the step table.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    tune_gc()
    args = _parse(argv)
    started = time.time()
    try:
        from rollart.launcher.placement import parse_cluster

        parse_cluster(args.cluster)  # a usage error: said before anything about the scenario
        if args.out is not None and args.out.exists() and not args.out.is_dir():
            raise ConfigError(f"--out {args.out}: exists and is not a directory (the run "
                              "folder is a directory)")
        scenario = load_scenario(args.scenario)
        # Everything this process writes (the run folder, summary.json after the cluster has
        # closed) is private, or group-readable with output.share_with_group.
        apply_umask(scenario.output.share_with_group)
        from rollart.launcher import localmodule
        from rollart.launcher.local import check_warmup_domains, preflight

        # The scenario's own module registers local rewards / envs (imported once, here, so
        # a missing name fails before any process starts; open_cluster reuses the import).
        regs = localmodule.load(scenario, args.scenario.parent, str(args.scenario))
        preflight(scenario, str(args.scenario), local_rewards=regs.rewards,
                  local_envs=regs.envs)
        try:  # the model phase's check, before the banner (as `rollart validate` does);
            # its note is said once, by open_cluster's preflight
            check_warmup_domains(scenario, note=lambda _text: None)
        except ConfigError as exc:
            raise in_file(str(args.scenario), exc) from None
        from rollart.launcher.machine import refusals

        # What this machine must give (reward names the service serves, CUDA, wandb, Ray,
        # the model): refused now, not minutes into the start-up. The same as `validate`.
        refused = [str(in_file(str(args.scenario), ConfigError(text)))
                   for text in refusals(scenario, args.cluster)]
        if refused:
            raise ConfigError("\n  ".join(refused))
        from rollart.launcher.validate import cost_notes

        # What `rollart validate` notes would cost this run: said here too, for whoever
        # did not validate first.
        for note in cost_notes(scenario):
            print(f"rollart run: note: {args.scenario}: {note}", file=sys.stderr)
        if args.steps is not None and args.steps < 1:
            raise ConfigError(f"--steps: must be >= 1, got {args.steps}")
    except ConfigError as exc:
        print(f"rollart run: config error: {exc}", file=sys.stderr)
        return 2
    planned = args.steps or scenario.run.steps
    start_step = 0
    if args.resume is not None:
        if args.out is not None and args.out != args.resume:
            print(f"rollart run: --resume {args.resume} continues that folder; --out "
                  f"{args.out} names another", file=sys.stderr)
            return 2
        try:
            ckpt, state = resume_point(args.resume)
            changed = resume_mismatch(args.resume, scenario)
        except ConfigError as exc:
            print(f"rollart run: --resume: {exc}", file=sys.stderr)
            return 2
        if changed:
            # Refused before the warm-up and the services: the run folder stays as it was.
            print(f"rollart run: --resume {args.resume}: {args.scenario} differs from the "
                  f"scenario that run was started with ({args.resume / 'config.json'}) in "
                  f"{'; '.join(changed)}; resume with that scenario", file=sys.stderr)
            return 2
        if state.step >= planned:
            print(f"rollart run: checkpoint {ckpt} is at step {state.step}, the planned "
                  f"{plural(planned, 'step')} {'is' if planned == 1 else 'are'} done; "
                  "nothing to run")
            return 0
        start_step = state.step
        run_dir = args.resume
        # summary.json's wall_time_s then counts every invocation of the run, not the last
        started -= earlier_wall_time_s(run_dir)
    else:
        run_dir = args.out or Path("runs") / f"{args.scenario.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    import uvloop

    try:
        rc = uvloop.run(_drive(scenario, run_dir, args.cache_dir, planned, start_step,
                               args.resume is not None, started,
                               scenario_dir=args.scenario.parent,
                               insecure=args.insecure, key_file=args.key_file,
                               checkpoint_on_interrupt=args.checkpoint_on_interrupt,
                               cluster=args.cluster, source=str(args.scenario)))
    except ConfigError as exc:  # found once the run starts: still about the scenario's fields
        print(f"rollart run: config error: {in_file(str(args.scenario), exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("rollart run: interrupted; every process was stopped", file=sys.stderr)
        rc = 130
    except Interrupted as exc:
        print(f"rollart run: {'interrupted' if exc.signum == signal.SIGINT else 'terminated'}"
              f" after step {exc.step}; checkpoint saved: {exc.path}; continue with "
              f"`{resume_command(args, run_dir)}`", file=sys.stderr)
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
    summary = write_summary(run_dir, scenario, started)  # also when it failed before it started
    print_closing(summary, run_dir, args)
    return rc


def print_closing(summary: dict[str, Any], run_dir: Path, args: argparse.Namespace) -> None:
    """The run's closing block (``progress.summary_block``): what it did, where it is, and
    the commands that continue it and write its report."""
    from rollart.trainer.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    resume = (resume_command(argparse.Namespace(**{**vars(args), "steps": "N"}), run_dir)
              if checkpoint is not None else None)
    print_summary_block(summary_block(summary, run_dir, checkpoint=checkpoint, resume=resume))
