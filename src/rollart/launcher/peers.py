"""What ``open_cluster`` does when one of its service processes exits on its own.

The launcher knows a process is gone the moment it exits (``Supervisor.wait_any_failure``), long
before a heartbeat would tell: its client is marked dead at once, so nothing waits on it or talks
to it again (no session closes, aborts or weight pushes to a dead peer). Then:

- an inference worker whose pool has another live worker: taken out of its pool
  (``Controller.remove_worker``); its in-flight turns fail with ``PeerDeadError`` and the proxy
  re-sends them to a live worker of the pool (counted in ``num_rerouted``); the run goes on;
- an env host while another host lives: new sessions go to the live hosts, trajectories whose
  session was on the dead one fail as ``env_host_lost`` and are retried; the run goes on;
- anything else (the last worker of a pool, the last env host, the trainer, the reward service):
  fatal, reported once as ``ProcessFailedError`` naming the process, its exit code and its log,
  with :meth:`PeerLoss.context` saying why the run cannot go on.
"""

from __future__ import annotations

from typing import Any

from rollart.launcher.procs import ServiceProcess


class PeerLoss:
    """Decides, per exited service, whether the run survives it (see the module docstring).

    Args:
        workers: service name -> (pool name, that worker's client); local workers only.
        env_hosts: service name -> env host client; local hosts only.
        all_env_hosts: every env host client of the run (given addresses included).
        others: service name -> client with ``mark_dead`` (e.g. the trainer's).
        cluster: the ``Cluster``; its controller may not be started yet.
    """

    def __init__(self, workers: dict[str, tuple[str, Any]], env_hosts: dict[str, Any],
                 all_env_hosts: list[Any], others: dict[str, Any], cluster: Any) -> None:
        self.workers = workers
        self.env_hosts = env_hosts
        self.all_env_hosts = all_env_hosts
        self.others = others
        self.cluster = cluster
        self.pools: dict[str, list[Any]] = {}
        for pool, client in workers.values():
            self.pools.setdefault(pool, []).append(client)
        #: service name -> why the run could not go on without it
        self.context: dict[str, str] = {}
        #: service names the run went on without, in the order they exited
        self.survived: list[str] = []

    def on_exit(self, svc: ServiceProcess) -> bool:
        """Called once per unexpected exit; True: the run goes on without ``svc``."""
        code = svc.proc.returncode if svc.proc is not None else None
        why = f"process {svc.name!r} exited with code {code} (log: {svc.log_path})"
        client = (self.workers[svc.name][1] if svc.name in self.workers
                  else self.env_hosts.get(svc.name) or self.others.get(svc.name))
        ok = False
        if svc.name in self.workers:
            ok = self._worker_lost(svc.name, why)
        elif svc.name in self.env_hosts:
            ok = any(not h.dead for h in self.all_env_hosts if h is not client)
            if not ok:
                self.context[svc.name] = "no live env host is left"
        controller = self.cluster.controller
        if not ok and controller is not None:
            controller.stop_soon()  # what fails next follows from this exit: one message
        # After stop_soon: the calls pending on it fail now, not after a liveness timeout.
        if client is not None and not client.dead:
            client.mark_dead(why)
        if ok:
            self.survived.append(svc.name)
        return ok

    def _worker_lost(self, name: str, why: str) -> bool:
        pool, client = self.workers[name]
        controller = self.cluster.controller
        if controller is None:  # not started: its proxy will skip the dead client
            client.mark_dead(why)
            left = sum(not c.dead for c in self.pools[pool])
        elif not [w for w in controller.proxy.pools[pool].workers
                  if w is not client and not w.dead]:
            left = 0  # fatal: left in place, the one message is the launcher's
        else:
            # idempotent: a worker already out of its pool (e.g. quarantined) stays out
            left = controller.remove_worker(client.name, why)
        if not left:
            self.context[name] = f"it was the last live worker of pool {pool!r}"
        return left > 0
