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

from rollart import logredact
from rollart.config import (
    RewardServiceConfig,
    Scenario,
    in_file,
    load_scenario,
    scenario_to_json,
)
from rollart.filemodes import SHARE_ENV, apply_umask, restrict_tree
from rollart.launcher.peers import PeerLoss
from rollart.launcher.placement import parse_cluster
from rollart.launcher.procs import ProcessFailedError, Supervisor
from rollart.launcher.progress import StartProgress
from rollart.transport.errors import ConfigError, RollartError

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
        check_env_names: check the names of the envs not in ``local_envs`` (off for
            ``open_cluster``, whose driver script may still register envs on the cluster).

    Raises:
        ConfigError: no env host to open a domain's sessions on; a domain's env, served by
            env hosts, that no env host can make (an unknown family, GEM game or
            reasoning-gym dataset: ``check_env_name``; it would fail every session open of
            the run); or (``local_rewards`` given) a domain scored by a local reward function
            nobody registers.
    """
    if not scenario.env_hosts:
        remote = sorted({d.env for d in scenario.domains} - set(local_envs))
        if remote:
            raise ConfigError(f"{source}: env_hosts: at least one [[env_hosts]] is needed to "
                              f"run the envs {remote} (or serve them in-process: an ENVS dict in "
                              "run.local_module, or open_cluster(envs=...))")
    from rollart.envhost.families import EnvSpecError, check_env_name

    for i, dom in enumerate(scenario.domains):
        if not check_env_names or dom.env in local_envs:
            continue
        try:
            check_env_name(dom.env)
        except EnvSpecError as exc:
            served = (f"; served in-process (run.local_module's ENVS): {sorted(local_envs)}"
                      if local_envs else "")
            raise ConfigError(f"{source}: domains[{i}].env: {exc.message}{served}") from None
    if local_rewards is None:
        return
    known = {"env_return", *local_rewards}
    for i, dom in enumerate(scenario.domains):
        if dom.reward_url == "local" and dom.reward not in known:
            raise ConfigError(
                f"{source}: domains[{i}].reward: local reward {dom.reward!r} is not built in "
                "(only 'env_return' is) and nothing registers one: name your file in "
                "run.local_module (with a REWARDS dict), serve it from the reward service "
                "(reward_url = \"service\", loaded with reward.modules) or run the scenario "
                f"from a script: rollart.open_cluster(scenario, rewards={{{dom.reward!r}: fn}})")


def peer_liveness(scenario: Scenario) -> dict[str, float]:
    """Heartbeat keyword arguments of the run's worker and env-host clients (``run.
    liveness_timeout_s``)."""
    return {"liveness_timeout_s": scenario.run.liveness_timeout_s}


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

    changed = warmup_set_change(cache_dir, scenario, resume=resume)
    if changed:
        log.warning("%s", changed)
    try:
        return ensure_quickstart_model(cache_dir, scenario)
    except ValueError as exc:  # e.g. warm-up requested but no domain has a solver
        raise ConfigError(f"model.tiny_warmup: {exc}") from None


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
        started: wall-clock start of the run (``time.time()``) for ``summary.json``.
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
    """
    from transformers import AutoConfig, AutoTokenizer

    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.driver import Backends, Cluster
    from rollart.controller.observe.loophealth import LoopLagMonitor
    from rollart.controller.training.advantages import RemoteTrainer
    from rollart.envhost.client import EnvClient
    from rollart.inference.client import InferenceClient
    from rollart.launcher import localmodule, rundir
    from rollart.launcher.runkeys import run_auth
    from rollart.launcher.services import start_services
    from rollart.reward.client import RewardClient
    from rollart.trainer.client import TrainerClient

    source = source or "<scenario>"
    if not isinstance(scenario, Scenario):
        source = str(scenario)
        scenario_dir = Path(scenario).parent
        scenario = load_scenario(scenario)
    rewards, envs = localmodule.merge(localmodule.load(scenario, scenario_dir, source),
                                      rewards, envs, source)
    # Env names are not checked here: the script may register envs on the yielded cluster
    # (``register_env``) before its first step; ``rollart run`` and ``validate`` check them.
    preflight(scenario, source, local_envs=set(envs), check_env_names=False)
    ray_address = parse_cluster(cluster)
    if ray_address is not None and (insecure or scenario.run.insecure):
        raise ConfigError(f"{source}: --cluster ray: services bind their nodes' network "
                          "addresses, so the run's CURVE key is required (drop --insecure / "
                          "run.insecure)")
    from rollart.launcher import machine

    try:  # before anything starts: one line naming the field, not a traceback minutes later
        # off the loop: a child process lists reward.modules' names, a TCP connect asks Ray
        await asyncio.to_thread(machine.service_rewards, scenario)
        await asyncio.to_thread(machine.ray_reachable, ray_address)
    except ConfigError as exc:
        raise in_file(source, exc) from None
    started = time.time() if started is None else started
    run_dir = Path(run_dir) if run_dir else Path("runs") / f"driver-{time.strftime('%Y%m%d-%H%M%S')}"
    point = rundir.resume_point(run_dir) if resume else None
    # Errors below are about the scenario's fields (model.path, output.wandb, run.key_file,
    # services started by hand): the message names its file.
    try:
        model_dir = resolve_model(scenario, Path(cache_dir) if cache_dir else default_cache_dir(),
                                  resume=resume)
    except ConfigError as exc:
        raise in_file(source, exc) from None
    # Private before anything is written: run folder 0700, its files 0600 (or group-readable
    # with output.share_with_group); the services started below inherit the umask, and an
    # existing folder (a reused or resumed one) is narrowed by chmod.
    share = scenario.output.share_with_group
    old_umask = apply_umask(share)
    # A driver script that gives no on_note still hears about the minute or two of start-up.
    note = on_note or (lambda text: print(f"rollart: {text}", file=sys.stderr, flush=True))
    try:
        rundir.prepare(run_dir, point[1].step if point else None)
        restrict_tree(run_dir, share)
        (run_dir / "config.json").write_bytes(scenario_to_json(scenario))
        folder = rundir.RunFolder(run_dir, scenario, final_step=steps or scenario.run.steps,
                                  started=started)
        keyed = run_auth(scenario, run_dir, insecure=insecure, key_file=key_file)
    except BaseException as exc:
        os.umask(old_umask)
        if isinstance(exc, ConfigError):
            raise in_file(source, exc) from None
        raise
    folder.on_note = note
    auth = keyed.auth

    if ray_address is None:
        sup: Any = Supervisor(run_dir, env={SHARE_ENV: "1" if share else "0"})
    else:
        from rollart.launcher.raycluster import RaySupervisor

        sup = RaySupervisor(run_dir, scenario, ray_address)
    clients: list[Any] = []
    reward: RewardClient | None = None
    endpoints: dict[str, RewardClient] = {}
    cluster: Cluster | None = None
    failed: list[ProcessFailedError] = []
    watcher: asyncio.Task | None = None
    try:
        t0 = time.perf_counter()
        note(f"starting services (logs: {run_dir / 'logs'})")
        rc = scenario.reward
        # Tokens first: a missing token variable / file fails before any process starts.
        try:
            service_token, token_file, endpoint_tokens = _reward_tokens(scenario, run_dir)
        except ConfigError as exc:
            raise in_file(source, exc) from None
        for secret in (service_token, *endpoint_tokens.values()):
            if secret:
                logredact.add_secret(secret)
        async with StartProgress(sup, note):  # each service as it is ready, and who is late
            addrs = await start_services(sup, scenario, model_dir,
                                         trainer_resume=point[0] if point else None,
                                         auth_argv=keyed.argv,
                                         checkpoint_dir=run_dir / "checkpoints",
                                         reward_token_file=token_file)
        note(f"services ready in {time.perf_counter() - t0:.1f} s")
        reward = RewardClient(addrs.reward_url, max_concurrency=rc.max_concurrency,
                              timeout_s=rc.timeout_s, max_retries=rc.max_retries,
                              backoff_s=rc.backoff_s, token=service_token,
                              **_reward_limits(rc))
        await reward.__aenter__()
        # Domains scored by any endpoint speaking the reward contract (e.g. a FaaS URL).
        for url, token in sorted(endpoint_tokens.items()):
            endpoint = RewardClient(url, max_concurrency=rc.max_concurrency,
                                    timeout_s=rc.timeout_s, max_retries=rc.max_retries,
                                    backoff_s=rc.backoff_s, token=token,
                                    **_reward_limits(rc))
            await endpoint.__aenter__()
            endpoints[url] = endpoint
        liveness = peer_liveness(scenario)
        pools = {name: [InferenceClient(a, auth=auth, name=f"{name}-{i}", **liveness)
                        for i, a in enumerate(addrs_)]
                 for name, addrs_ in addrs.workers.items()}
        workers = [w for ws in pools.values() for w in ws]
        clients += workers
        await _check_weight_transfer(scenario, workers)
        env_clients = [EnvClient(a, auth=auth, name=h.name, **liveness)
                for a, h in zip(addrs.env_hosts, scenario.env_hosts, strict=True)]
        # A collective broadcast is a rendezvous plus start / update / finish on every worker,
        # each bounded by weight_transfer_timeout_s on the trainer: never give up before it.
        trainer_client = TrainerClient(addrs.trainer, auth=auth, publish_timeout_s=max(
            600.0, 4 * scenario.trainer.weight_transfer_timeout_s + 60.0))
        clients += env_clients + [trainer_client]
        backends = Backends(
            pools=pools, env_hosts=env_clients, reward_service=reward, reward_endpoints=endpoints,
            trainer=RemoteTrainer(
                trainer_client, version=point[1].version if point else 0,
                push_needs_pause=scenario.trainer.weight_transfer != "zmq"),
            tokenizer=AutoTokenizer.from_pretrained(model_dir), loop_lag=LoopLagMonitor(),
            vocab_size=_vocab_size(AutoConfig.from_pretrained(model_dir)))
        cluster = Cluster.from_scenario(
            scenario, backends=backends, resume=point[1].controller if point else None,
            buffer_class=buffer_class or SampleBuffer,
            transcripts=folder.transcript_recorder(backends.tokenizer))
        cluster.run_dir = run_dir  # type: ignore[attr-defined]
        cluster.trainer_client = trainer_client  # type: ignore[attr-defined]
        cluster.run_key = auth  # type: ignore[attr-defined]
        cluster.run_folder = folder  # type: ignore[attr-defined]
        cluster.add_step_hook(folder.on_step)
        for name, fn in (rewards or {}).items():
            cluster.register_reward(name, fn)
        for name, factory in (envs or {}).items():
            cluster.register_env(name, factory)

        body = asyncio.current_task()
        loss = _peer_loss(sup, scenario, pools, env_clients, trainer_client, cluster)

        async def watch() -> None:
            exc = await sup.wait_any_failure(loss.on_exit)
            failed.append(exc.with_context(loss.context.get(exc.name, "")))
            assert body is not None
            body.cancel()

        watcher = asyncio.create_task(watch())
        try:
            yield cluster
        except asyncio.CancelledError:
            if failed and body is not None:
                body.uncancel()  # the cancellation was ours: surface the real cause
                raise failed[0] from None
            raise
        except Exception as exc:
            # The controller saw a dead peer's effect (PoolExhaustedError, a failed push) before
            # the watcher reported the exit: the exit is the one message.
            dead = sup.unexpected_exit()
            if dead is not None:
                raise dead.with_context(loss.context.get(dead.name, "")) from exc
            raise
    finally:
        if watcher is not None:
            watcher.cancel()
        if cluster is not None:
            with contextlib.suppress(Exception):
                await cluster.close()
        # Blocking, but only joins the transcript thread and flushes files.
        folder.close()
        for c in reversed(clients):
            with contextlib.suppress(Exception):
                await c.close()
        for client in [reward, *endpoints.values()]:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.__aexit__(None, None, None)
        await sup.stop_all()
        os.umask(old_umask)


def _reward_tokens(scenario: Scenario, run_dir: Path
                   ) -> tuple[str | None, Path | None, dict[str, str | None]]:
    """``(service token, its file, {endpoint url: token})`` (``rollart.reward.auth``).

    A reward service the launcher starts gets a fresh token in ``run_dir/secrets/`` (mode
    0600, handed over by path); a running one (``reward.url``) and each http(s) domain
    endpoint use the token their scenario entry names (variable or file), if any.

    Raises:
        ConfigError: a named token variable is unset, or a token file unreadable or not private.
    """
    from rollart.reward.auth import create_token_file, token_from

    rc = scenario.reward
    token_file = None
    if rc.url is None:
        token_file = run_dir / "secrets" / "reward.token"
        token_file.unlink(missing_ok=True)  # a resumed run gets a new token
        token = create_token_file(token_file)
    else:
        token = token_from(rc.token_env, rc.token_file, "reward.token_env / token_file")
    endpoints = {
        d.reward_url: token_from(d.reward_token_env, d.reward_token_file,
                                 f"domains[{d.name}].reward_token_env / reward_token_file")
        for d in scenario.domains if d.reward_url.startswith(("http://", "https://"))}
    return token, token_file, endpoints


def _peer_loss(sup: Supervisor, scenario: Scenario, pools: dict[str, list[Any]],
               envs: list[Any], trainer_client: Any, cluster: Any) -> PeerLoss:
    """Map the services ``start_services`` started (by their names) to their clients."""
    workers = {f"worker-{p.name}-{i}": (p.name, pools[p.name][i])
               for p in scenario.pools if not p.addresses for i in range(p.num_workers)}
    env_hosts = {f"env-{h.name}": c for h, c in zip(scenario.env_hosts, envs, strict=True)
                 if h.address is None}
    known = {name for name in sup.services}
    return PeerLoss({k: v for k, v in workers.items() if k in known},
                    {k: v for k, v in env_hosts.items() if k in known}, envs,
                    {"trainer": trainer_client}, cluster)


async def _check_weight_transfer(scenario: Scenario, workers: list[Any]) -> None:
    """With a collective weight transfer every worker must have been started for it (external
    ones included); found before the first step rather than at the first broadcast.

    Raises:
        RollartError: names the workers started otherwise.
    """
    kind = scenario.trainer.weight_transfer
    if kind == "zmq":
        return  # every worker accepts staged buckets
    stats = await asyncio.gather(*(w.stats() for w in workers))
    wrong = {w.address: s.weight_transfer for w, s in zip(workers, stats, strict=True)
             if s.weight_transfer != kind}
    if wrong:
        raise RollartError(f"trainer.weight_transfer is {kind!r}, but these workers receive "
                           f"weights otherwise: {wrong}; start them with "
                           f"`rollart serve-inference ... --weight-transfer {kind}`")


def _vocab_size(config: Any) -> int | None:
    """The model's vocabulary size (rows of its embedding), for the proxy's token-id check;
    ``None`` when the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def _reward_limits(rc: RewardServiceConfig) -> dict[str, Any]:
    """The reward client's timeout-retry and size-limit options from the scenario."""
    return {"retry_timeouts": rc.retry_timeouts, "max_reply_bytes": rc.max_reply_bytes,
            "max_details_bytes": rc.max_details_bytes}
