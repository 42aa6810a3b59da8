"""Open a cluster on this machine from a scenario: start its services, connect clients, and hand
back a ``rollart.Cluster`` (the driver API) that is closed, with every process, on exit.

::

    async with rollart.open_cluster("scenarios/quickstart.toml") as cluster:
        async for step in cluster.train(steps=2):
            print(step.metrics.reward_mean_by_domain)

If a service process dies while the block runs and the run cannot go on without it (see
``rollart.launcher.peers``: a worker whose pool has live workers left, or an env host with live
peers, is survived), the block is cancelled and ``ProcessFailedError`` (naming the process, its
exit code and showing its log tail) is raised from it: the one error of the run, also when the
controller noticed the loss first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from rollart.config import Scenario, load_scenario, scenario_to_json
from rollart.launcher.peers import PeerLoss
from rollart.launcher.procs import ProcessFailedError, Supervisor
from rollart.transport.errors import ConfigError, RollartError


def preflight(scenario: Scenario, source: str = "<scenario>") -> None:
    """Checks that only matter when rollart starts the services itself (before anything starts).

    Raises:
        ConfigError: no env host to open sessions on, or a domain scored by a local reward
            function that nothing can register (only the driver API registers them).
    """
    if not scenario.env_hosts:
        raise ConfigError(f"{source}: env_hosts: at least one [[env_hosts]] is needed to run "
                          "the domains' environments")
    for i, dom in enumerate(scenario.domains):
        if dom.reward_url == "local" and dom.reward != "env_return":
            raise ConfigError(
                f"{source}: domains[{i}].reward: local reward {dom.reward!r} is not built in "
                "(only 'env_return' is); serve it from the reward service (reward_url = "
                "\"service\", loaded with reward.modules) or register it with the driver API")


def resolve_model(scenario: Scenario, cache_dir: Path) -> Path:
    """The policy checkpoint dir: a local HF dir, or the embedded tiny model (built + cached).

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

    try:
        return ensure_quickstart_model(cache_dir, scenario)
    except ValueError as exc:  # e.g. warm-up requested but no domain has a solver
        raise ConfigError(f"model.tiny_warmup: {exc}") from None


@contextlib.asynccontextmanager
async def open_cluster(scenario: str | Path | Scenario, *, run_dir: str | Path | None = None,
                       cache_dir: str | Path = ".cache/rollart",
                       trainer_resume: Path | None = None, trainer_version: int = 0,
                       controller_resume: dict[str, Any] | None = None,
                       on_note: Any = None) -> AsyncIterator[Any]:
    """Start ``scenario``'s local services and yield a (not yet started) ``Cluster``.

    Args:
        scenario: a scenario file or a validated ``Scenario``.
        run_dir: where logs (``run_dir/logs``) and ``config.json`` go (default: a new
            ``runs/driver-<time>``).
        cache_dir: where the embedded tiny model is built and cached.
        trainer_resume / trainer_version / controller_resume: continue from a checkpoint.
        on_note: optional ``callable(str)`` told about progress (services starting / ready).
    Raises:
        ConfigError: bad scenario (before any process starts).
        ProcessFailedError: a service failed to start or died during the block.
    """
    from transformers import AutoTokenizer

    from rollart.controller.driver import Backends, Cluster
    from rollart.controller.loophealth import LoopLagMonitor
    from rollart.controller.training import RemoteTrainer
    from rollart.envhost.client import EnvClient
    from rollart.inference.client import InferenceClient
    from rollart.launcher.services import start_services
    from rollart.reward.client import RewardClient
    from rollart.trainer.client import TrainerClient

    source = "<scenario>"
    if not isinstance(scenario, Scenario):
        source = str(scenario)
        scenario = load_scenario(scenario)
    preflight(scenario, source)
    model_dir = resolve_model(scenario, Path(cache_dir))
    run_dir = Path(run_dir) if run_dir else Path("runs") / f"driver-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_bytes(scenario_to_json(scenario))
    note = on_note or (lambda _text: None)

    sup = Supervisor(run_dir)
    clients: list[Any] = []
    reward: RewardClient | None = None
    endpoints: dict[str, RewardClient] = {}
    cluster: Cluster | None = None
    failed: list[ProcessFailedError] = []
    watcher: asyncio.Task | None = None
    try:
        t0 = time.perf_counter()
        note(f"starting services (logs: {run_dir / 'logs'})")
        addrs = await start_services(sup, scenario, model_dir, trainer_resume=trainer_resume)
        note(f"services ready in {time.perf_counter() - t0:.1f} s")
        rc = scenario.reward
        reward = RewardClient(addrs.reward_url, max_concurrency=rc.max_concurrency,
                              timeout_s=rc.timeout_s, max_retries=rc.max_retries,
                              backoff_s=rc.backoff_s)
        await reward.__aenter__()
        # Domains scored by any endpoint speaking the reward contract (e.g. a FaaS URL).
        for url in sorted({d.reward_url for d in scenario.domains
                           if d.reward_url.startswith(("http://", "https://"))}):
            endpoint = RewardClient(url, max_concurrency=rc.max_concurrency,
                                    timeout_s=rc.timeout_s, max_retries=rc.max_retries,
                                    backoff_s=rc.backoff_s)
            await endpoint.__aenter__()
            endpoints[url] = endpoint
        pools = {name: [InferenceClient(a, name=f"{name}-{i}") for i, a in enumerate(addrs_)]
                 for name, addrs_ in addrs.workers.items()}
        workers = [w for ws in pools.values() for w in ws]
        clients += workers
        await _check_weight_transfer(scenario, workers)
        envs = [EnvClient(a, name=h.name)
                for a, h in zip(addrs.env_hosts, scenario.env_hosts, strict=True)]
        # A collective broadcast is a rendezvous plus start / update / finish on every worker,
        # each bounded by weight_transfer_timeout_s on the trainer: never give up before it.
        trainer_client = TrainerClient(addrs.trainer, publish_timeout_s=max(
            600.0, 4 * scenario.trainer.weight_transfer_timeout_s + 60.0))
        clients += envs + [trainer_client]
        backends = Backends(
            pools=pools, env_hosts=envs, reward_service=reward, reward_endpoints=endpoints,
            trainer=RemoteTrainer(
                trainer_client, version=trainer_version,
                push_needs_pause=scenario.trainer.weight_transfer != "zmq"),
            tokenizer=AutoTokenizer.from_pretrained(model_dir), loop_lag=LoopLagMonitor())
        cluster = Cluster.from_scenario(scenario, backends=backends, resume=controller_resume)
        cluster.run_dir = run_dir  # type: ignore[attr-defined]
        cluster.trainer_client = trainer_client  # type: ignore[attr-defined]

        body = asyncio.current_task()
        loss = _peer_loss(sup, scenario, pools, envs, trainer_client, cluster)

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
        for c in reversed(clients):
            with contextlib.suppress(Exception):
                await c.close()
        for client in [reward, *endpoints.values()]:
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.__aexit__(None, None, None)
        await sup.stop_all()


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
