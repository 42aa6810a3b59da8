"""The node side of ``--cluster ray``: one Ray actor per service, running the service's
``rollart serve-*`` process under the local launcher's own ``Supervisor``
(``rollart.launcher.procs``) on the node the actor was placed on.

The actor (an async Ray actor: ``start``, ``wait_exit`` and ``stop`` run concurrently):

- narrows its process's umask as ``rollart run`` does (``rollart.filemodes.apply_umask``, from
  the run's ``output.share_with_group``), so the node's log and every file the service writes
  are private, or group-readable when the run shares with its group; the service is told the
  same through ``ROLLART_SHARE_WITH_GROUP``;
- makes a private run folder on the node (``tempfile.mkdtemp``: mode 0700, in the node's temp
  dir) holding the service's log, ready file and its files (``files``: the run's CURVE key, the
  reward service's token), each written with mode 0600; the file contents come from a Ray object
  the driver put, so key material never appears on a command line (visible to every local user
  in ``ps``) nor in the actor's task spec (only the object's id is there);
- starts the same command line as the local launcher with three changes: the node's Python
  (``sys.executable``) instead of the driver's, the node's copies of those files instead of the
  driver's paths, and the service bound to the node's IP (``--address tcp://IP:0`` or
  ``--host IP``) so the controller can reach it; ``CUDA_VISIBLE_DEVICES`` is the one Ray set for
  the actor's GPUs, not the local launcher's device numbering;
- reports the bound address, and later the service's exit (``wait_exit``: its whole process
  group is SIGKILLed at once, as locally);
- ``stop``: SIGTERM / SIGKILL of the process group (``Supervisor.stop_all``), hands back the
  log's last MiB and removes the node folder.

If the actor process itself dies (``ray.kill``, a node failure), the service gets SIGTERM from
its parent-death signal and stops its own children, as when the local launcher is SIGKILLed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollart.filemodes import SHARE_ENV, apply_umask
from rollart.launcher.procs import ProcessFailedError, Supervisor, log_tail

#: The last bytes of a service's log the driver copies into its run folder.
LOG_BYTES = 1 << 20


class ServiceHost:
    """One service on a Ray node (wrapped by ``ray.remote`` in ``rollart.launcher.raycluster``).

    Args:
        name: the service's name (``worker-h20-0``).
        files: driver path -> content of each file the command line names (mode 0600 here).
        share_with_group: the run's ``output.share_with_group`` (the umask of this process and
            of the service it starts).
    """

    def __init__(self, name: str, files: dict[str, bytes],
                 share_with_group: bool = False) -> None:
        self.name = name
        self.share_with_group = share_with_group
        # Before anything is written: the actor's process is Ray's, not `rollart run`'s.
        apply_umask(share_with_group)
        self.dir = Path(tempfile.mkdtemp(prefix=f"rollart-{name}-"))
        self.paths: dict[str, str] = {}
        keys = self.dir / "files"
        keys.mkdir(mode=0o700)
        for i, (path, data) in enumerate(sorted(files.items())):
            local = keys / f"{i}-{Path(path).name}"
            fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            self.paths[path] = str(local)
        self.sup = Supervisor(self.dir)
        self._starting = False

    def node_argv(self, argv: list[str], bind: str, ip: str) -> list[str]:
        """``argv`` as this node runs it (see the module docstring)."""
        out = [sys.executable, *(self.paths.get(a, a) for a in argv[1:])]
        out += ["--host", ip] if bind == "host" else ["--address", f"tcp://{ip}:0"]
        return out

    async def start(self, argv: list[str], env: dict[str, str], bind: str,
                    ready_timeout_s: float) -> dict[str, Any]:
        """Start the service; ``{"address", "pid", "node_ip", "log"}`` once it serves, or
        ``{"error": exit code, "tail": log tail, "log": node log path}`` if it exited first.

        Raises:
            TimeoutError: not ready within ``ready_timeout_s``.
        """
        import ray

        ip = ray.util.get_node_ip_address()
        env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
        env[SHARE_ENV] = "1" if self.share_with_group else "0"
        self._starting = True
        try:
            address = await self.sup.start(self.name, self.node_argv(argv, bind, ip), env=env,
                                           ready_timeout_s=ready_timeout_s)
        except ProcessFailedError as exc:
            return {"error": exc.returncode, "tail": exc.tail, "log": str(exc.log_path)}
        finally:
            self._starting = False
        svc = self.sup.services[self.name]
        assert svc.proc is not None
        return {"address": address, "pid": svc.proc.pid, "node_ip": ip,
                "log": str(svc.log_path)}

    async def wait_exit(self) -> dict[str, Any]:
        """Wait for the service to exit on its own (its process group is then SIGKILLed);
        ``{"returncode", "tail"}``."""
        exc = await self.sup.wait_any_failure()
        return {"returncode": exc.returncode, "tail": exc.tail}

    async def stop(self) -> bytes:
        """Stop the service and its process group; the last ``LOG_BYTES`` of its log. The
        node folder (files, log) is removed."""
        # A stop that overtakes a start still spawning (the run failed elsewhere meanwhile)
        # waits for the process to exist, so stop_all reaches its group.
        deadline = time.monotonic() + 30.0
        while self._starting and time.monotonic() < deadline:
            svc = self.sup.services.get(self.name)
            if svc is not None and svc.proc is not None:
                break
            await asyncio.sleep(0.05)
        await self.sup.stop_all()
        log = self.dir / "logs" / f"{self.name}.log"
        data = b""
        try:
            with log.open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - LOG_BYTES))
                data = f.read()
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)
        return data

    def tail(self) -> str:
        """The last lines of the service's log."""
        return log_tail(self.dir / "logs" / f"{self.name}.log")
