"""``rollart run SCENARIO --cluster ray[://HOST:PORT]`` (and ``open_cluster(cluster=...)``):
the scenario's services placed on a running Ray cluster; the controller stays one process here,
on the driver.

:class:`RaySupervisor` stands in for the local ``Supervisor`` (``rollart.launcher.procs``):
``start_services`` gives it the same command lines, and it starts each on the node its
placement names (``rollart.launcher.placement``: hardware labels as Ray custom resources), in a
Ray actor that runs the ``rollart serve-*`` process (``rollart.launcher.rayactor``). Failures
follow the local launcher: a service that exits (or whose actor or node dies) is reported by
name with its exit code and log tail, and ``open_cluster``'s ``PeerLoss`` decides whether the run
survives it (a worker whose pool has live workers left is re-routed around); ``stop_all`` (end of
the run, Ctrl-C, a failure) stops every service's process group, kills every actor and removes
every placement group. Logs: the node's copy while the run lasts, the last MiB copied to
``RUN_DIR/logs/NAME.log`` when the service exits or the run stops.

**The run key on the nodes.** Each service's file arguments (``--key-file``, ``--token-file``)
are read here and put in Ray's object store once; the actor writes them, mode 0600, to its
private folder on its node. Acceptable because the Ray cluster is inside the run's trust boundary
already: anyone who can submit work to it runs code on every node (the services' included), so
the object store holding the key gives nobody new access; the key never appears on a command line
(``ps``) or in a task spec, and the node copy goes when the service stops. Ray's own traffic is
not encrypted unless Ray's TLS is on (``RAY_USE_TLS``): across an untrusted network, enable it.

Shared paths: ``model.path`` (or the tiny model's cache) must exist at the same path on every node
hosting a worker or the trainer, and the trainer writes checkpoints under ``RUN_DIR/checkpoints``
on its node (a shared file system for ``--resume``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart.config import Scenario
from rollart.launcher.placement import Plan, describe, plan_placement
from rollart.launcher.procs import ProcessFailedError
from rollart.transport.errors import ConfigError, RollartError

try:
    import ray
    import ray.exceptions
    from ray import ObjectRef
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ConfigError("--cluster ray needs Ray: pip install 'rollart[ray]'") from exc

from rollart.launcher.rayactor import ServiceHost

log = logging.getLogger("rollart.launcher.ray")
#: The actor class (made once: each ``ray.remote`` call would export the class again).
_ServiceActor = ray.remote(ServiceHost)

#: Command-line options naming a file the service reads (shipped to its node, see above).
FILE_OPTIONS = ("--key-file", "--token-file")


@dataclass
class _Exit:
    returncode: int | None = None


@dataclass
class RayService:
    """A service placed on the cluster (``ServiceProcess``'s fields ``PeerLoss`` reads)."""

    name: str
    log_path: Path
    actor: Any = None
    exit_ref: ObjectRef[dict[str, Any]] | None = None
    proc: _Exit | None = None  # set once it exited
    address: str | None = None
    pid: int | None = None
    node_ip: str | None = None
    node_id: str | None = None
    expected_exit: bool = False

    @property
    def alive(self) -> bool:
        return self.actor is not None and self.proc is None


def connect(address: str) -> bool:
    """``ray.init(address)`` unless Ray is connected already; True when this call connected
    (the caller then disconnects). Ray's SIGTERM handler (it exits the process at once) is
    taken back out: ``rollart run`` stops every service on SIGTERM itself."""
    if ray.is_initialized():
        return False
    before = signal.getsignal(signal.SIGTERM)
    ray.init(address=address, namespace="rollart", log_to_driver=False,
             logging_level=logging.WARNING)
    with contextlib.suppress(ValueError, TypeError):  # not the main thread: nothing was set
        signal.signal(signal.SIGTERM, before)
    return True


class RaySupervisor:
    """The ``Supervisor`` of ``--cluster ray`` (see the module docstring).

    Args:
        run_dir: the driver's run folder (log copies under ``run_dir/logs``).
        scenario: the run's scenario (its placement: ``plan_placement``).
        address: the Ray address (``rollart.launcher.placement.parse_cluster``).
        placement_timeout_s: how long a placement group may wait for nodes before the run
            fails, naming what it needs.
    Raises:
        ConfigError: a bad resource label (before anything is placed).
    """

    def __init__(self, run_dir: Path, scenario: Scenario, address: str, *,
                 placement_timeout_s: float = 120.0) -> None:
        self.run_dir = run_dir
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.prefix = f"rollart-{run_dir.name}-{time.time_ns()}"
        self.plan: Plan = plan_placement(scenario, self.prefix)
        self.placement_timeout_s = placement_timeout_s
        self.share_with_group = scenario.output.share_with_group
        self.owns_connection = connect(address)
        self.services: dict[str, RayService] = {}
        self._groups: dict[str, asyncio.Future[Any]] = {}
        self._pgs: dict[str, Any] = {}
        self._files: dict[tuple[str, ...], Any] = {}

    async def _group(self, name: str) -> Any:
        if name not in self._groups:
            self._groups[name] = asyncio.ensure_future(self._create_group(name))
        return await asyncio.shield(self._groups[name])

    def _check_fits(self, name: str) -> None:
        """Fail at once when no live node could ever hold a bundle of group ``name`` (e.g. no
        node carries its hardware label), rather than after ``placement_timeout_s``."""
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        for bundle in self.plan.groups[name].bundles:
            if not any(all(total.get(k, 0) >= v for k, v in bundle.items()) for total in nodes):
                missing = sorted(k for k in bundle if not any(k in total for total in nodes))
                raise RollartError(
                    f"the Ray cluster cannot place {name}: no node has {describe(bundle)}"
                    f"{f' (no node carries {missing})' if missing else ''}. Label nodes with "
                    "their hardware as custom resources, e.g. `ray start --num-gpus 8 "
                    "--resources '{\"h20\": 8}'`, or set the service's ray_resource")

    async def _create_group(self, name: str) -> Any:
        self._check_fits(name)
        spec = self.plan.groups[name]
        # Kept before waiting: stop_all removes it even if this start is abandoned.
        pg = self._pgs[name] = placement_group(spec.bundles, strategy=spec.strategy, name=name)
        ready, _ = await asyncio.to_thread(ray.wait, [pg.ready()],
                                           timeout=self.placement_timeout_s)
        if not ready:
            need = {describe(b) for b in spec.bundles}
            raise RollartError(
                f"the Ray cluster cannot place {name}: {len(spec.bundles)} bundle(s) of "
                f"{' / '.join(sorted(need))} ({spec.strategy}) not free after "
                f"{self.placement_timeout_s:.0f} s; free now: {ray.available_resources()}")
        return pg

    def _file_ref(self, argv: Sequence[str]) -> Any:
        """One object holding ``{driver path: content}`` of ``argv``'s file options; passed
        as the actor's argument, Ray resolves it there and the task spec holds its id only."""
        files = {value: Path(value).read_bytes()
                 for opt, value in zip(argv, argv[1:], strict=False) if opt in FILE_OPTIONS}
        key = tuple(sorted(files))
        if key not in self._files:
            self._files[key] = ray.put(files)
        return self._files[key]

    async def start(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
                    ready_timeout_s: float = 300.0) -> str:
        """Place ``name`` (its slot in the plan), start ``argv`` there and return the address
        it bound on its node.

        Raises:
            ProcessFailedError: the service exited before it was ready (log tail included),
                or its actor died.
            RollartError: no placement for ``name``, or the cluster lacks its resources.
            TimeoutError: not ready within ``ready_timeout_s``.
        """
        if name in self.services:
            raise ValueError(f"service {name!r} already started")
        slot = self.plan.slots.get(name)
        if slot is None:
            raise RollartError(f"no Ray placement for service {name!r}")
        svc = RayService(name, self.run_dir / "logs" / f"{name}.log")
        self.services[name] = svc
        pg = await self._group(slot.group)
        res = dict(self.plan.resources(name))
        files = self._file_ref(argv)
        svc.actor = _ServiceActor.options(
            num_cpus=res.pop("CPU", 0), num_gpus=res.pop("GPU", 0), resources=res,
            max_restarts=0, max_concurrency=8, name=f"{self.prefix}/{name}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=slot.bundle),
        ).remote(name, files, self.share_with_group)
        try:
            # The actor's own ready timeout answers first; this bounds an actor that never
            # runs (its worker process failing to start).
            got = await asyncio.wait_for(asyncio.wrap_future(svc.actor.start.remote(
                list(argv), dict(env or {}), slot.bind, ready_timeout_s).future()),
                ready_timeout_s + 120.0)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if hasattr(exc, "cause") else exc
            if isinstance(cause, TimeoutError):
                raise TimeoutError(f"{name!r} not ready after {ready_timeout_s:.0f} s (log: "
                                   f"{svc.log_path}, copied from its node when the run "
                                   "stops)") from None
            raise
        except ray.exceptions.RayActorError as exc:
            svc.proc = _Exit(None)
            raise ProcessFailedError(name, None, svc.log_path, f"its Ray actor died: {exc}") \
                from None
        if "error" in got:
            svc.proc = _Exit(got["error"])
            self._save_log(svc, got["tail"].encode())
            raise ProcessFailedError(name, got["error"], svc.log_path, got["tail"])
        svc.address, svc.pid, svc.node_ip = got["address"], got["pid"], got["node_ip"]
        svc.exit_ref = svc.actor.wait_exit.remote()
        log.info("%s on %s: %s", name, svc.node_ip, svc.address)
        return got["address"]

    def _save_log(self, svc: RayService, data: bytes) -> None:
        with contextlib.suppress(OSError):
            svc.log_path.write_bytes(data)

    def _poll_exit(self, svc: RayService) -> bool:
        """True once ``svc`` exited (its ``proc.returncode`` set, log tail saved)."""
        if svc.proc is not None:
            return True
        if svc.exit_ref is None:
            return False
        ready, _ = ray.wait([svc.exit_ref], timeout=0)
        if not ready:
            return False
        try:
            got = ray.get(svc.exit_ref)
            svc.proc = _Exit(got["returncode"])
            tail = got["tail"]
        except ray.exceptions.RayError as exc:  # the actor (or its node) is gone
            svc.proc = _Exit(None)
            tail = f"its Ray actor died: {exc}"
        self._save_log(svc, f"(service on {svc.node_ip}; last lines)\n{tail}\n".encode())
        return True

    def failure(self, svc: RayService) -> ProcessFailedError:
        """The error naming exited service ``svc``, its exit code and log tail."""
        tail = svc.log_path.read_text(errors="replace") if svc.log_path.exists() else ""
        return ProcessFailedError(svc.name, svc.proc.returncode if svc.proc else None,
                                  svc.log_path, tail)

    def unexpected_exit(self) -> ProcessFailedError | None:
        """The error of a service that exited unexpectedly and was not survived, if any."""
        for svc in self.services.values():
            if self._poll_exit(svc) and not svc.expected_exit:
                return self.failure(svc)
        return None

    async def wait_any_failure(
            self, survive: Callable[[Any], bool] | None = None) -> ProcessFailedError:
        """As ``Supervisor.wait_any_failure``: the first unexpected, unsurvived exit."""
        seen: set[str] = set()
        while True:
            for svc in list(self.services.values()):
                if svc.name in seen or not self._poll_exit(svc):
                    continue
                seen.add(svc.name)
                if svc.expected_exit:
                    continue
                if survive is not None and survive(svc):
                    svc.expected_exit = True
                    continue
                return self.failure(svc)
            await asyncio.sleep(0.2)

    async def stop_all(self, timeout_s: float = 30.0) -> None:
        """Stop every service's process group (``ServiceHost.stop``), copy their logs' last
        MiB here, kill every actor, remove every placement group, and disconnect from Ray if
        this supervisor connected."""
        placed = [s for s in self.services.values() if s.actor is not None]
        for svc in placed:
            svc.expected_exit = True
        refs: list[ObjectRef[bytes]] = [svc.actor.stop.remote() for svc in placed]
        if refs:
            await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), timeout=timeout_s)
        for svc, ref in zip(placed, refs, strict=True):
            with contextlib.suppress(Exception):
                data = ray.get(ref, timeout=0)
                if data:
                    self._save_log(svc, data)
            with contextlib.suppress(Exception):
                ray.kill(svc.actor, no_restart=True)
            svc.actor = None
        for fut in self._groups.values():
            fut.cancel()
        for pg in self._pgs.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        self._groups.clear()
        self._pgs.clear()
        self._files.clear()
        if self.owns_connection:
            self.owns_connection = False
            ray.shutdown()

