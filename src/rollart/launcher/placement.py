"""Where each service of a scenario goes on a Ray cluster (``rollart run --cluster ray``):
pure decisions, no Ray import (``rollart.launcher.raycluster`` acts on them).

Every service ``rollart.launcher.services.start_services`` would start on this machine (the
reward service without ``reward.url``, env hosts without ``address``, pools without
``addresses``, the trainer) gets one Ray placement-group bundle, and one actor in it that runs
the service's ``rollart serve-*`` process. A bundle reserves:

- an inference worker of a GPU pool: 1 CPU, ``tensor_parallel_size`` GPUs and as many units of
  the pool's resource (``pools[].ray_resource``, default its ``hardware`` label: a node started
  with ``ray start --num-gpus 8 --resources '{"h20": 8}'`` hosts eight TP-1 ``h20`` workers);
  one bundle holds a worker's tensor-parallel GPUs, so they are on one node (vLLM's
  tensor-parallel executor runs on one node);
- an inference worker of a ``cpu`` pool: 1 CPU and 1 unit of ``ray_resource`` if set;
- an env host, the reward service: 1 CPU and 1 unit of their ``ray_resource`` if set (e.g.
  ``cpu_env``: the CPU env cluster);
- the trainer: 1 CPU, and with ``device = "cuda"`` ``num_processes`` GPUs (torchrun's ranks on
  one node) and as many units of ``trainer.ray_resource``; with ``cpu``, ``num_processes`` CPUs
  and 1 unit.

A pool's workers share one placement group (``PACK``: as few nodes as fit, spread when they do
not), so a pool is reserved whole or not at all and released in one call; every other service
has its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rollart.config import Scenario
from rollart.transport.errors import ConfigError

#: Ray's custom resource names: no reserved ones (see ``rollart.config.schema.RayResource``).
_RESOURCE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*(:[A-Za-z0-9_.\-]+)?$")
_RESERVED = {"CPU", "GPU", "memory", "object_store_memory"}


@dataclass(frozen=True)
class Group:
    """A placement group to create: its ``bundles`` (resource name -> amount) and strategy."""

    name: str
    bundles: list[dict[str, float]]
    strategy: str = "PACK"


@dataclass(frozen=True)
class Slot:
    """Where service ``service`` runs: bundle ``bundle`` of group ``group``; ``bind`` says how
    its command line takes the node's address (``"host"``: ``--host IP``, the reward service;
    ``"address"``: ``--address tcp://IP:0``, the ZeroMQ services)."""

    service: str
    group: str
    bundle: int
    bind: str = "address"


@dataclass
class Plan:
    """Every group to create and every service's slot, by service name (the launcher's names:
    ``reward``, ``env-NAME``, ``worker-POOL-I``, ``trainer``)."""

    groups: dict[str, Group] = field(default_factory=dict)
    slots: dict[str, Slot] = field(default_factory=dict)

    def resources(self, service: str) -> dict[str, float]:
        """The bundle reserved for ``service``."""
        slot = self.slots[service]
        return self.groups[slot.group].bundles[slot.bundle]


def parse_cluster(spec: str | None) -> str | None:
    """The Ray address of a ``--cluster`` value: ``None`` for ``local`` / ``None`` (this
    machine); ``"auto"`` for ``ray`` (the cluster this machine belongs to, or ``$RAY_ADDRESS``);
    ``HOST:PORT`` for ``ray://HOST:PORT`` (the cluster's GCS address, as ``ray start
    --address`` takes it).

    Raises:
        ConfigError: anything else.
    """
    if spec is None or spec == "local":
        return None
    if spec == "ray":
        return "auto"
    if spec.startswith("ray://") and len(spec) > len("ray://"):
        return spec[len("ray://"):]
    raise ConfigError(f"--cluster: {spec!r} is not 'local', 'ray' or 'ray://HOST:PORT'")


def _resource(name: str | None, what: str) -> str | None:
    if name is not None and (name in _RESERVED or not _RESOURCE.match(name)):
        raise ConfigError(f"{what}: {name!r} is not a Ray custom resource name (letters, digits, "
                          "'_', '.', '-'; not CPU / GPU / memory); set ray_resource")
    return name


def _bundle(cpus: float, gpus: float, resource: str | None, units: float) -> dict[str, float]:
    out = {"CPU": cpus}
    if gpus:
        out["GPU"] = gpus
    if resource is not None:
        out[resource] = units
    return out


def plan_placement(scenario: Scenario, prefix: str = "rollart") -> Plan:
    """The placement of ``scenario``'s launched services (see the module docstring); group
    names start with ``prefix`` (one per run, so two runs on one cluster never share one).

    Raises:
        ConfigError: a GPU pool's ``hardware`` label is not a valid resource name and no
            ``ray_resource`` is set.
    """
    sc = scenario
    plan = Plan()

    def single(service: str, bundle: dict[str, float], bind: str = "address") -> None:
        group = f"{prefix}-{service}"
        plan.groups[group] = Group(group, [bundle], "STRICT_PACK")
        plan.slots[service] = Slot(service, group, 0, bind)

    if sc.reward.url is None:
        single("reward", _bundle(1, 0, _resource(sc.reward.ray_resource, "reward.ray_resource"),
                                 1), bind="host")
    for i, host in enumerate(sc.env_hosts):
        if host.address is None:
            res = _resource(host.ray_resource, f"env_hosts[{i}].ray_resource")
            single(f"env-{host.name}", _bundle(1, 0, res, 1))
    for i, pool in enumerate(sc.pools):
        if pool.addresses:
            continue
        gpu = pool.hardware != "cpu"
        res = _resource(pool.ray_resource or (pool.hardware if gpu else None),
                        f"pools[{i}].ray_resource" if pool.ray_resource
                        else f"pools[{i}].hardware")
        tp = pool.engine.tensor_parallel_size if gpu else 0
        bundle = _bundle(1, tp, res, tp or 1)
        group = f"{prefix}-pool-{pool.name}"
        plan.groups[group] = Group(group, [dict(bundle) for _ in range(pool.num_workers)])
        for w in range(pool.num_workers):
            name = f"worker-{pool.name}-{w}"
            plan.slots[name] = Slot(name, group, w)
    t = sc.trainer
    res = _resource(t.ray_resource, "trainer.ray_resource")
    if t.device == "cuda":
        single("trainer", _bundle(1, t.num_processes, res, t.num_processes))
    else:
        single("trainer", _bundle(t.num_processes, 0, res, 1))
    return plan


def describe(bundle: dict[str, float]) -> str:
    """``{"CPU": 1, "h20": 2}`` as ``CPU=1 h20=2`` (error messages)."""
    return " ".join(f"{k}={v:g}" for k, v in bundle.items())
