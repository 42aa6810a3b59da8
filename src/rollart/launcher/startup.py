"""Start-up of ``open_cluster`` once its checks passed (``rollart.launcher.local``): the run
folder, the services and a client of each, the cluster over them; and the shut-down that closes
whatever was reached, in reverse.

The phases, in order (each one's docstring says what it refuses):

1. preflight (``local``): the scenario and its ``run.local_module`` loaded and checked, before
   any process starts or any file is written;
2. model (``local``): the checkpoint the services load (the tiny model built if missing);
3. :func:`open_run_folder`: the private run folder, its writer, the run's key, the supervisor;
4. :func:`connect_services`: every service started, a client connected to each (``Backends``);
5. :func:`connect_cluster`: the ``Cluster`` over those backends, the run folder's step hook on
   it; its controller is built by ``rollart.controller.build.build_controller`` when it starts.

:func:`shut_down` closes a :class:`Live` whichever phase it reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart import logredact
from rollart.config import RewardServiceConfig, Scenario, in_file, scenario_to_json
from rollart.filemodes import SHARE_ENV, apply_umask, restrict_tree
from rollart.launcher.peers import PeerLoss
from rollart.launcher.procs import Supervisor
from rollart.launcher.progress import StartProgress
from rollart.transport.errors import ConfigError, RollartError

if TYPE_CHECKING:
    from rollart.controller.build import Backends
    from rollart.controller.driver import Cluster
    from rollart.launcher.rundir import RunFolder, RunState
    from rollart.launcher.runkeys import RunAuth
    from rollart.reward.client import RewardClient


@dataclass
class Plan:
    """What the preflight phase settled: the scenario, where its errors point, the local
    rewards and envs to register, and where the services run (a Ray address, or ``None``)."""

    scenario: Scenario
    source: str
    rewards: dict[str, Any]
    envs: dict[str, Any]
    ray_address: str | None


@dataclass
class Live:
    """What ``open_cluster`` holds open, filled in phase by phase and closed by
    :func:`shut_down` whatever phase failed."""

    run_dir: Path
    folder: RunFolder
    keyed: RunAuth
    #: the umask before ``open_cluster`` narrowed it (restored last)
    old_umask: int
    #: a ``Supervisor``, or a ``RaySupervisor`` with ``cluster="ray"``
    sup: Any = None
    #: the worker, env-host and trainer clients, closed in reverse
    clients: list[Any] = field(default_factory=list)
    env_clients: list[Any] = field(default_factory=list)
    trainer_client: Any = None
    reward: RewardClient | None = None
    endpoints: dict[str, RewardClient] = field(default_factory=dict)
    cluster: Cluster | None = None


def peer_liveness(scenario: Scenario) -> dict[str, float]:
    """Heartbeat keyword arguments of the run's worker and env-host clients (``run.
    liveness_timeout_s``)."""
    return {"liveness_timeout_s": scenario.run.liveness_timeout_s}


def open_run_folder(plan: Plan, run_dir: Path, point: tuple[Path, RunState] | None, *,
                    final_step: int, started: float, note: Callable[[str], None],
                    insecure: bool, key_file: str | Path | None) -> Live:
    """Phase 3: the run folder, private before anything is written (folder 0700, files 0600,
    or group-readable with ``output.share_with_group``: the services started later inherit
    the umask, and an existing folder, reused or resumed, is narrowed by chmod), its
    ``config.json``, its writer and the run's key; and the supervisor of the services.
    The umask is restored if this fails (else by :func:`shut_down`).

    Raises:
        ConfigError: about ``output.*`` or ``run.key_file``, naming the scenario file.
    """
    from rollart.launcher import rundir
    from rollart.launcher.runkeys import run_auth

    scenario = plan.scenario
    share = scenario.output.share_with_group
    old_umask = apply_umask(share)
    try:
        rundir.prepare(run_dir, point[1].step if point else None)
        restrict_tree(run_dir, share)
        (run_dir / "config.json").write_bytes(scenario_to_json(scenario))
        folder = rundir.RunFolder(run_dir, scenario, final_step=final_step, started=started,
                                  on_note=note)
        keyed = run_auth(scenario, run_dir, insecure=insecure, key_file=key_file)
    except BaseException as exc:
        os.umask(old_umask)
        if isinstance(exc, ConfigError):
            raise in_file(plan.source, exc) from None
        raise
    live = Live(run_dir, folder, keyed, old_umask)
    if plan.ray_address is None:
        live.sup = Supervisor(run_dir, env={SHARE_ENV: "1" if share else "0"})
    else:
        from rollart.launcher.raycluster import RaySupervisor

        live.sup = RaySupervisor(run_dir, scenario, plan.ray_address)
    return live


async def connect_services(live: Live, plan: Plan, model_dir: Path,
                           point: tuple[Path, RunState] | None,
                           note: Callable[[str], None]) -> Backends:
    """Phase 4: start the scenario's services (``rollart.launcher.services``) and connect a
    client to each: the reward service and http(s) reward endpoints, the inference workers
    of every pool, the env hosts and the trainer. Returns the cluster's ``Backends``; every
    client is recorded on ``live`` as soon as it exists.

    Raises:
        ConfigError: a reward token variable or file is missing (before any process starts).
        ProcessFailedError: a service failed to start.
        RollartError: a worker started for another weight transfer than ``trainer.*``'s.
    """
    from transformers import AutoConfig, AutoTokenizer

    from rollart.controller.build import Backends
    from rollart.controller.observe.loophealth import LoopLagMonitor
    from rollart.controller.training.remote import RemoteTrainer
    from rollart.envhost.client import EnvClient
    from rollart.inference.client import InferenceClient
    from rollart.launcher.services import start_services
    from rollart.reward.client import RewardClient
    from rollart.trainer.client import TrainerClient

    scenario, run_dir, auth = plan.scenario, live.run_dir, live.keyed.auth
    t0 = time.perf_counter()
    note(f"starting services (logs: {run_dir / 'logs'})")
    rc = scenario.reward
    # Tokens first: a missing token variable / file fails before any process starts.
    try:
        service_token, token_file, endpoint_tokens = reward_tokens(scenario, run_dir)
    except ConfigError as exc:
        raise in_file(plan.source, exc) from None
    for secret in (service_token, *endpoint_tokens.values()):
        if secret:
            logredact.add_secret(secret)
    async with StartProgress(live.sup, note):  # each service as it is ready, and who is late
        addrs = await start_services(live.sup, scenario, model_dir,
                                     trainer_resume=point[0] if point else None,
                                     auth_argv=live.keyed.argv,
                                     checkpoint_dir=run_dir / "checkpoints",
                                     reward_token_file=token_file)
    note(f"services ready in {time.perf_counter() - t0:.1f} s")
    live.reward = RewardClient(addrs.reward_url, max_concurrency=rc.max_concurrency,
                               timeout_s=rc.timeout_s, max_retries=rc.max_retries,
                               backoff_s=rc.backoff_s, token=service_token,
                               **reward_limits(rc))
    await live.reward.__aenter__()
    # Domains scored by any endpoint speaking the reward contract (e.g. a FaaS URL).
    for url, token in sorted(endpoint_tokens.items()):
        endpoint = RewardClient(url, max_concurrency=rc.max_concurrency,
                                timeout_s=rc.timeout_s, max_retries=rc.max_retries,
                                backoff_s=rc.backoff_s, token=token, **reward_limits(rc))
        await endpoint.__aenter__()
        live.endpoints[url] = endpoint
    liveness = peer_liveness(scenario)
    pools = {name: [InferenceClient(a, auth=auth, name=f"{name}-{i}", **liveness)
                    for i, a in enumerate(addrs_)]
             for name, addrs_ in addrs.workers.items()}
    workers = [w for ws in pools.values() for w in ws]
    live.clients += workers
    await check_weight_transfer(scenario, workers)
    live.env_clients = [EnvClient(a, auth=auth, name=h.name, **liveness)
                        for a, h in zip(addrs.env_hosts, scenario.env_hosts, strict=True)]
    # A collective broadcast is a rendezvous plus start / update / finish on every worker,
    # each bounded by weight_transfer_timeout_s on the trainer: never give up before it.
    live.trainer_client = TrainerClient(addrs.trainer, auth=auth, publish_timeout_s=max(
        600.0, 4 * scenario.trainer.weight_transfer_timeout_s + 60.0))
    live.clients += [*live.env_clients, live.trainer_client]
    return Backends(
        pools=pools, env_hosts=live.env_clients, reward_service=live.reward,
        reward_endpoints=live.endpoints,
        trainer=RemoteTrainer(
            live.trainer_client, version=point[1].version if point else 0,
            push_needs_pause=scenario.trainer.weight_transfer != "zmq"),
        tokenizer=AutoTokenizer.from_pretrained(model_dir), loop_lag=LoopLagMonitor(),
        vocab_size=vocab_size_of(AutoConfig.from_pretrained(model_dir)))


def connect_cluster(live: Live, plan: Plan, backends: Backends,
                    point: tuple[Path, RunState] | None, buffer_class: Any) -> Cluster:
    """Phase 5: the (not yet started) ``Cluster`` over ``backends``, with the run folder's
    step hook (metrics, checkpoints) and the local rewards and envs registered. Its controller
    is wired by ``rollart.controller.build.build_controller`` when the cluster starts (after
    the driver script's own registrations)."""
    from rollart.controller.buffer.core import SampleBuffer
    from rollart.controller.driver import Cluster

    live.cluster = cluster = Cluster(
        plan.scenario, backends, point[1].controller if point else None,
        buffer_class=buffer_class or SampleBuffer,
        transcripts=live.folder.transcript_recorder(backends.tokenizer),
        run_dir=live.run_dir, run_folder=live.folder, run_key=live.keyed.auth,
        trainer_client=live.trainer_client)
    cluster.add_step_hook(live.folder.on_step)
    for name, fn in plan.rewards.items():
        cluster.register_reward(name, fn)
    for name, factory in plan.envs.items():
        cluster.register_env(name, factory)
    return cluster


async def shut_down(live: Live) -> None:
    """Close what ``open_cluster`` opened, whichever phase it reached: the cluster, the run
    folder (``summary.json``), the clients, the services, then the umask."""
    if live.cluster is not None:
        with contextlib.suppress(Exception):
            await live.cluster.close()
    # Blocking, but only joins the transcript thread and flushes files.
    live.folder.close()
    for c in reversed(live.clients):
        with contextlib.suppress(Exception):
            await c.close()
    for client in [live.reward, *live.endpoints.values()]:
        if client is not None:
            with contextlib.suppress(Exception):
                await client.__aexit__(None, None, None)
    await live.sup.stop_all()
    os.umask(live.old_umask)


def reward_tokens(scenario: Scenario, run_dir: Path
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


def peer_loss(sup: Any, scenario: Scenario, pools: Mapping[str, Sequence[Any]],
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


async def check_weight_transfer(scenario: Scenario, workers: list[Any]) -> None:
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


def vocab_size_of(config: Any) -> int | None:
    """The model's vocabulary size (rows of its embedding), for the proxy's token-id check;
    ``None`` when the config does not say."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None


def reward_limits(rc: RewardServiceConfig) -> dict[str, Any]:
    """The reward client's timeout-retry and size-limit options from the scenario."""
    return {"retry_timeouts": rc.retry_timeouts, "max_reply_bytes": rc.max_reply_bytes,
            "max_details_bytes": rc.max_details_bytes}
