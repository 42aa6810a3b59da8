"""Open a cluster on this machine from a scenario: start its services, connect clients, and hand
back a ``rollart.Cluster`` (the driver API) that is closed, with every process, on exit.

::

    async with rollart.open_cluster("scenarios/quickstart.toml", run_dir="runs/demo",
                                    rewards={"my_reward": my_reward}) as cluster:
        async for step in cluster.train(steps=2):
            print(step.metrics.reward_mean_by_domain)

The run folder is written as ``rollart run`` writes it (``rollart.launcher.rundir``: metrics,
TensorBoard, transcripts, checkpoints, summary); ``resume=True`` continues it from its newest
checkpoint. Local rewards and envs come as ``rewards=`` / ``envs=``, from the scenario's
``run.local_module`` file (its ``REWARDS`` / ``ENVS``, as under ``rollart run``:
``rollart.launcher.localmodule``), or are registered on the yielded cluster before its first
step (``register_reward`` / ``register_env``).

This module holds the checks made before anything starts (:func:`preflight`, the model:
:func:`resolve_model`) and ``open_cluster`` itself; what it then opens (the run folder, the
services and their clients, the cluster) and closes is ``rollart.launcher.startup``.

If a service process dies while the block runs and the run cannot go on without it (see
``rollart.launcher.peers``: a worker whose pool has live workers left, or an env host with live
peers, is survived), the block is cancelled and ``ProcessFailedError`` (naming the process, its
exit code and showing its log tail) is raised from it: the one error of the run, also when the
controller noticed the loss first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from rollart.config import Scenario, in_file, load_scenario
from rollart.launcher.modelbuild import prepare_model
from rollart.launcher.placement import parse_cluster
from rollart.launcher.procs import ProcessFailedError
from rollart.launcher.startup import (
    Plan,
    connect_cluster,
    connect_services,
    open_run_folder,
    peer_loss,
    shut_down,
)
from rollart.transport.errors import ConfigError

log = logging.getLogger("rollart.launcher")


def preflight(scenario: Scenario, source: str = "<scenario>", *,
              local_rewards: Collection[str] | None = None,
              local_envs: Collection[str] = (), check_env_names: bool = True) -> None:
    """Checks that only matter when rollart starts the services itself (before anything starts).

    Args:
        local_rewards: names of the local reward functions the caller registers (``None``:
            unknown yet, a driver script may still register them: not checked here, the
            controller checks them when the cluster starts).
        local_envs: env names the caller serves in-process.
        check_env_names: check the names of the envs not in ``local_envs``, and that an env
            host runs them (off for ``open_cluster``, whose driver script may still register
            envs on the cluster: the cluster's start names any env nobody serves).

    Raises:
        ConfigError: no env host to open a domain's sessions on; a domain's env, served by
            env hosts, that no env host can make (an unknown family, GEM game or
            reasoning-gym dataset: ``check_env_name``; it would fail every session open of
            the run); or (``local_rewards`` given) a domain scored by a local reward function
            nobody registers.
    """
    if not scenario.env_hosts and check_env_names:
        remote = sorted({d.env for d in scenario.domains} - set(local_envs))
        if remote:
            raise ConfigError(f"{source}: env_hosts: at least one [[env_hosts]] is needed to "
                              f"run the envs {remote} (or serve them in-process: an ENVS dict in "
                              "run.local_module, or open_cluster(envs=...))")
    from rollart.config.envoptions import check_env_options
    from rollart.envhost.families import EnvSpecError, check_env_name

    unknown: list[str] = []
    for i, dom in enumerate(scenario.domains):
        if not check_env_names or dom.env in local_envs:
            continue
        try:
            check_env_name(dom.env)
        except EnvSpecError as exc:
            served = (f"; served in-process (run.local_module's ENVS): {sorted(local_envs)}"
                      if local_envs else "")
            unknown.append(f"{source}: domains[{i}].env: {exc.message}{served}")
    if unknown:  # every unknown env at once, not one per attempt
        raise ConfigError(reasons=unknown)
    if check_env_names:  # an env served in-process takes whatever its factory takes
        check_env_options(scenario, source, skip=local_envs)
    if local_rewards is None:
        return
    known = {"env_return", "env_success", *local_rewards}
    for i, dom in enumerate(scenario.domains):
        if dom.reward_url == "local" and dom.reward not in known:
            raise ConfigError(
                f"{source}: domains[{i}].reward: local reward {dom.reward!r} is not built in "
                "(only 'env_return' and 'env_success' are) and nothing registers one: name your file in "
                "run.local_module (with a REWARDS dict), serve it from the reward service "
                "(reward_url = \"service\", loaded with reward.modules) or run the scenario "
                f"from a script: rollart.open_cluster(scenario, rewards={{{dom.reward!r}: fn}})")

def resolve_model(scenario: Scenario, cache_dir: Path, *, resume: bool = False) -> Path:
    """The policy checkpoint dir: a local HF dir, or the embedded tiny model (built + cached).
    ``resume``: a resumed run (its starting point is its checkpoint: no warm-up-set warning).

    Raises:
        ConfigError: ``model.path`` is not a local checkpoint dir (rollart never downloads).
    """
    if scenario.model.path != "tiny":
        path = Path(scenario.model.path)
        if not (path / "config.json").exists():
            raise ConfigError(f"model.path: {path} is not a local Hugging Face checkpoint "
                              "directory (no config.json); rollart never downloads models")
        return path
    from rollart.models.warmup import ensure_quickstart_model

    # First: a refused set is not remembered as the last one. Its note was said by the
    # preflight (open_cluster's, before this phase): said again here it would show twice.
    check_warmup_domains(scenario, note=lambda _text: None)
    changed = warmup_set_change(cache_dir, scenario, resume=resume)
    if changed:
        log.warning("%s", changed)
    try:
        return ensure_quickstart_model(cache_dir, scenario)
    except ValueError as exc:
        raise ConfigError(f"model.tiny_warmup: {exc}") from None


def check_warmup_domains(scenario: Scenario,
                         note: Callable[[str], None] | None = None) -> None:
    """The tiny model's warm-up (``model.tiny_warmup``) imitates the scripted solvers of the
    built-in envs (``rollart.envhost.solvers``): a domain of any other env (your own, served
    in-process or by a ``py:`` class) gets no demonstrations, said in one line given to
    ``note`` (default: a WARNING log record; ``rollart validate`` prints it as its notes).

    Raises:
        ConfigError: the warm-up is on and no domain's env has a solver (nothing to warm up
            on): set ``tiny_warmup = false`` under ``[model]``.
    """
    from rollart.envhost.solvers import has_solver

    model = scenario.model
    if model.path != "tiny" or not model.tiny_warmup:
        return
    without = [f"{d.name} ({d.env})" for d in scenario.domains if not has_solver(d.env)]
    if len(without) == len(scenario.domains):
        raise ConfigError(
            f"model.tiny_warmup: the tiny model's warm-up imitates the built-in envs' scripted "
            f"solvers (game:GuessTheNumber-*, rg:*) and no domain has one: {', '.join(without)}; "
            "set tiny_warmup = false under [model] to start from the untrained tiny model")
    if without:
        text = (f"model.tiny_warmup: no scripted solver for {', '.join(without)}: the warm-up "
                "demonstrates only the other domains")
        if note is None:
            log.warning("%s", text)
        else:
            note(text)


def default_cache_dir() -> Path:
    """Per-user cache of built models: ``$ROLLART_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/rollart``, else ``~/.cache/rollart`` (never relative to the working
    directory, so every script and run of a user shares one)."""
    if os.environ.get("ROLLART_CACHE_DIR"):
        return Path(os.environ["ROLLART_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollart"


def warmup_set_change(cache_dir: Path, scenario: Scenario, *, resume: bool = False
                      ) -> str | None:
    """Remember which envs the tiny model (``model.tiny_seed``) was last warmed up on, under
    ``cache_dir``; return a warning when this scenario's set differs (a different warm-up:
    another checkpoint is built, and the RL starting point is not the earlier runs'), else
    ``None``. A resumed run (``resume``) neither warns nor is remembered: its starting point is
    its own checkpoint, whatever scenario ran last."""
    model = scenario.model
    if model.path != "tiny" or not model.tiny_warmup or resume:
        return None
    now = sorted({f"{d.env} {json.dumps(d.env_options, sort_keys=True)}"
                  for d in scenario.domains})
    if model.tiny_warmup_tool_calls:  # another demonstration set of the same envs
        now.append("calculator tool calls")
    marker = Path(cache_dir) / f"warmup-set-seed{model.tiny_seed}.json"
    before = json.loads(marker.read_text()) if marker.exists() else None
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(now))
    if before is None or before == now:
        return None
    return (f"the tiny model's warm-up set changed: it was warmed up on {before}, this "
            f"scenario's domains give {now}; another warmed-up model is used (built now if "
            "missing), so the RL starting point differs from earlier runs'")


@contextlib.asynccontextmanager
async def open_cluster(scenario: str | Path | Scenario, *, run_dir: str | Path | None = None,
                       cache_dir: str | Path | None = None, resume: bool = False,
                       steps: int | None = None,
                       rewards: Mapping[str, Any] | None = None,
                       envs: Mapping[str, Callable[[], Any]] | None = None,
                       buffer_class: Any = None,
                       on_note: Any = None, started: float | None = None,
                       insecure: bool = False,
                       key_file: str | Path | None = None,
                       cluster: str | None = None,
                       scenario_dir: str | Path | None = None,
                       source: str | None = None) -> AsyncIterator[Any]:
    """Start ``scenario``'s local services and yield a (not yet started) ``Cluster`` whose
    steps are written to ``run_dir`` (``rollart.launcher.rundir``).

    Args:
        scenario: a scenario file or a validated ``Scenario``.
        run_dir: the run folder (default: a new ``runs/driver-<time>``). A fresh run moves an
            earlier run's files found there to ``run_dir/previous-<time>/``.
        cache_dir: where the embedded tiny model is built and cached (default
            :func:`default_cache_dir`).
        resume: continue ``run_dir`` from its newest complete checkpoint (trainer weights and
            optimiser, controller state, step count; later steps' records are forgotten).
        steps: the planned last step (checkpointed whatever ``checkpoint_every``; default
            ``run.steps``).
        rewards: local reward functions by name (as ``Cluster.register_reward``).
        envs: in-process env factories by env name (as ``Cluster.register_env``).
        buffer_class: a ``SampleBuffer`` subclass with your own admission / batch assembly
            (``rollart.controller.controller.Controller``); default ``SampleBuffer``.
        on_note: ``callable(str)`` told about progress (services starting, each one ready,
            those still starting every 20 s, checkpoints); default: printed to stderr as
            ``rollart: ...`` (``lambda _text: None`` silences it).
        started: wall-clock start of the run (``time.time()``) for ``summary.json``'s
            ``wall_time_s``; ``None``: now, less the earlier invocations' time on ``resume``.
        insecure: run the ZeroMQ services without authentication (``rollart run --insecure``;
            see ``rollart.launcher.runkeys``). By default every service gets the run's CURVE
            key, kept at ``run_dir/keys/run.key_secret`` (``rollart.run_credentials(run_dir)``
            loads it; the yielded cluster's ``run_key`` is it).
        key_file: the run's key when the scenario names services started by hand (overrides
            ``run.key_file``).
        cluster: where the services run: ``None`` / ``"local"`` (this machine), ``"ray"`` or
            ``"ray://HOST:PORT"``: placed on a running Ray cluster by their hardware labels
            (``rollart.launcher.raycluster``; needs ``rollart[ray]``); the controller stays here.
        scenario_dir: where a relative ``run.local_module`` is found when ``scenario`` is a
            ``Scenario`` (a scenario file's own directory otherwise; default: the working
            directory). Its ``REWARDS`` / ``ENVS`` are registered with ``rewards`` / ``envs``
            (``rollart.launcher.localmodule``).
        source: the scenario's file name for error messages when ``scenario`` is a
            ``Scenario`` read from a file (``rollart run`` passes it); default: the file given
            as ``scenario``, else ``"<scenario>"``.
    Raises:
        ConfigError: bad scenario, or ``resume`` without a checkpoint (before any process
            starts); an error about the scenario names ``source`` first.
        ProcessFailedError: a service failed to start or died during the block.

    Phases (``rollart.launcher.startup``): preflight, model, run folder, services, cluster;
    what was opened is closed on exit whichever phase was reached.
    """
    from rollart.launcher import rundir

    plan = await _preflight(scenario, source=source, scenario_dir=scenario_dir,
                            rewards=rewards, envs=envs, cluster=cluster, insecure=insecure)
    run_dir = Path(run_dir) if run_dir else Path("runs") / f"driver-{time.strftime('%Y%m%d-%H%M%S')}"
    if started is None:  # a resumed run's wall time counts its earlier invocations too
        started = time.time() - (rundir.earlier_wall_time_s(run_dir) if resume else 0.0)
    point = rundir.resume_point(run_dir) if resume else None
    # A driver script that gives no on_note still hears about the minute or two of start-up.
    note = on_note or (lambda text: print(f"rollart: {text}", file=sys.stderr, flush=True))
    model_dir = await prepare_model(
        plan.scenario, plan.source, Path(cache_dir) if cache_dir else default_cache_dir(),
        resume=resume, note=note)
    live = open_run_folder(plan, run_dir, point, final_step=steps or plan.scenario.run.steps,
                           started=started, note=note, insecure=insecure, key_file=key_file)
    failed: list[ProcessFailedError] = []
    watcher: asyncio.Task | None = None
    try:
        rundir.record_base_model(run_dir, model_dir, plan.scenario)  # for `rollart export`
        backends = await connect_services(live, plan, model_dir, point, note)
        opened = connect_cluster(live, plan, backends, point, buffer_class)

        body = asyncio.current_task()
        loss = peer_loss(live.sup, plan.scenario, backends.pools, live.env_clients,
                         live.trainer_client, opened)

        async def watch() -> None:
            exc = await live.sup.wait_any_failure(loss.on_exit)
            failed.append(exc.with_context(loss.context.get(exc.name, "")))
            assert body is not None
            body.cancel()

        watcher = asyncio.create_task(watch())
        try:
            yield opened
        except asyncio.CancelledError:
            if failed and body is not None:
                body.uncancel()  # the cancellation was ours: surface the real cause
                raise failed[0] from None
            raise
        except Exception as exc:
            # The controller saw a dead peer's effect (PoolExhaustedError, a failed push) before
            # the watcher reported the exit: the exit is the one message.
            dead = live.sup.unexpected_exit()
            if dead is not None:
                raise dead.with_context(loss.context.get(dead.name, "")) from exc
            raise
    finally:
        if watcher is not None:
            watcher.cancel()
        await shut_down(live)


async def _preflight(scenario: str | Path | Scenario, *, source: str | None,
                     scenario_dir: str | Path | None, rewards: Mapping[str, Any] | None,
                     envs: Mapping[str, Callable[[], Any]] | None, cluster: str | None,
                     insecure: bool) -> Plan:
    """Phase 1, before any process starts or any file is written: load the scenario and its
    ``run.local_module``, then refuse what would fail later (:func:`preflight`, ``--cluster``
    with ``insecure``, reward names the reward service would not know, an unreachable Ray, a
    tiny-model warm-up with nothing to imitate: :func:`check_warmup_domains`, whose note on
    the domains it skips is logged here, once).

    Raises:
        ConfigError: naming ``source`` (the scenario file) first.
    """
    from rollart.launcher import localmodule, machine

    source = source or "<scenario>"
    if not isinstance(scenario, Scenario):
        source = str(scenario)
        scenario_dir = Path(scenario).parent
        scenario = load_scenario(scenario)
    rewards_, envs_ = localmodule.merge(localmodule.load(scenario, scenario_dir, source),
                                        rewards, envs, source)
    # Env names are not checked here: the script may register envs on the yielded cluster
    # (``register_env``) before its first step; ``rollart run`` and ``validate`` check them.
    preflight(scenario, source, local_envs=set(envs_), check_env_names=False)
    ray_address = parse_cluster(cluster)
    if ray_address is not None and (insecure or scenario.run.insecure):
        raise ConfigError(f"{source}: --cluster ray: services bind their nodes' network "
                          "addresses, so the run's CURVE key is required (drop --insecure / "
                          "run.insecure)")
    try:  # before anything starts: one line naming the field, not a traceback minutes later
        # off the loop: a child process lists reward.modules' names, a TCP connect asks Ray
        await asyncio.to_thread(machine.service_rewards, scenario)
        await asyncio.to_thread(machine.ray_reachable, ray_address)
    except ConfigError as exc:
        raise in_file(source, exc) from None
    try:  # the model phase's refusal and its note, said once (resolve_model is quiet)
        check_warmup_domains(scenario)
    except ConfigError as exc:
        raise in_file(source, exc) from None
    return Plan(scenario, source, rewards_, envs_, ray_address)
