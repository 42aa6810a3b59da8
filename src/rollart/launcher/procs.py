"""Local process supervision for ``rollart run``: start service processes, find their addresses,
notice when one dies, and stop them all (no orphans).

Each service writes its bound address to a ``--ready-file`` once it serves, so services bind port
0 and nothing races for fixed ports. Children run in their own process group and get SIGTERM
when this process dies (Linux ``PR_SET_PDEATHSIG``); each service then stops its own children
(an inference worker still starting its engine does so once the engine is up), so even a
SIGKILLed launcher leaves no orphans behind for long.

No orphans when a service dies on its own either: a service's own children (vLLM's
``EngineCore`` and ``VLLM::Worker``, the reward service's process pool) inherit its process
group and do not leave it, and the group outlives its leader. So the moment the supervisor sees
a service exit (:meth:`Supervisor.wait_any_failure`), it SIGKILLs that service's whole group:
whatever the service started dies with it, however the service ended. ``stop_all`` signals the
groups of every service, dead ones included, and kills what is left of a group once its leader
has exited. Rejected alternatives: ``PR_SET_PDEATHSIG`` inside each service for its children
fires when the *thread* that forked them exits (process pools fork from helper threads) and
needs code in every library that spawns; ``PR_SET_CHILD_SUBREAPER`` would make the launcher (a
user's driver script, under the driver API) the parent of every orphan, changing its process for
good. A descendant that calls ``setsid`` itself escapes the group (nothing in vLLM 0.32's engine
path or ``concurrent.futures`` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rollart.transport.errors import RollartError


class ProcessFailedError(RollartError):
    """A supervised process exited unexpectedly (fatal for the run). Names it and its log."""

    def __init__(self, name: str, returncode: int | None, log_path: Path, tail: str,
                 context: str = "") -> None:
        self.name = name
        self.returncode = returncode
        self.log_path = log_path
        self.tail = tail
        super().__init__(
            f"process {name!r} exited with code {returncode} (log: {log_path})"
            f"{'; ' + context if context else ''}\n"
            f"--- last lines of its log ---\n{tail}"
        )

    def with_context(self, context: str) -> ProcessFailedError:
        """The same error, saying why the run cannot go on without the process."""
        return ProcessFailedError(self.name, self.returncode, self.log_path, self.tail, context)


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_ERROR_MARKERS = ("Error:", "FATAL", "Exception:")


def log_tail(path: Path, num_lines: int = 30) -> str:
    """The last ``num_lines`` lines of a log file ('' if it does not exist), preceded by the
    first error lines of the last 1 MiB when the tail does not show them (torchrun, for one,
    ends a rank's failure with its own summary, far below the rank's error)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (1 << 20)))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    tail = lines[-num_lines:]
    errors = [ln for ln in lines[:-num_lines] if any(k in ln for k in _ERROR_MARKERS)]
    errors = list(dict.fromkeys(errors))[:5]
    if not errors:
        return "\n".join(tail)
    return "\n".join(["(error lines earlier in the log:)", *errors, "(last lines:)", *tail])


@dataclass
class ServiceProcess:
    """One supervised child process and where its log and ready file are."""

    name: str
    argv: list[str]
    log_path: Path
    ready_path: Path
    proc: asyncio.subprocess.Process | None = None
    address: str | None = None
    expected_exit: bool = field(default=False)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the service's process group (its children included), alive or not.

        The group id is the service's pid (``start_new_session``); Linux does not reuse a pid
        while a process group of that id has members, so this reaches only this service's.
        """
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (``[state, ppid, pgrp, ...]``),
    or ``None`` when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses
    return stat[stat.rindex(")") + 2:].split()


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes of process group ``pgid``, from ``/proc``."""
    out = []
    for entry in os.listdir("/proc"):
        fields = proc_stat(entry) if entry.isdigit() else None
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            out.append(int(entry))
    return out


class Supervisor:
    """Starts services, waits until each is ready, watches them, and stops them all.

    Args:
        run_dir: logs go to ``run_dir/logs/NAME.log``; ready files to ``run_dir/ready/``.
        env: extra environment variables for every child.
    """

    def __init__(self, run_dir: Path, env: dict[str, str] | None = None) -> None:
        self.run_dir = run_dir
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "ready").mkdir(parents=True, exist_ok=True)
        self._env = {**os.environ, **(env or {})}
        self.services: dict[str, ServiceProcess] = {}
        self._failed: asyncio.Future[ServiceProcess] | None = None

    async def start(self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
                    ready_timeout_s: float = 300.0) -> str:
        """Start ``argv`` (a ``--ready-file`` option is appended) and wait for its address.

        Returns:
            The address the service wrote to its ready file.
        Raises:
            ProcessFailedError: the process exited before it was ready.
            TimeoutError: not ready within ``ready_timeout_s``.
        """
        if name in self.services:
            raise ValueError(f"service {name!r} already started")
        svc = ServiceProcess(
            name=name, argv=list(argv),
            log_path=self.run_dir / "logs" / f"{name}.log",
            ready_path=self.run_dir / "ready" / f"{name}.addr",
        )
        svc.ready_path.unlink(missing_ok=True)
        self.services[name] = svc
        log = svc.log_path.open("ab")
        try:
            svc.proc = await asyncio.create_subprocess_exec(
                *svc.argv, "--ready-file", str(svc.ready_path),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                env={**self._env, **(env or {})},
                start_new_session=True, preexec_fn=_set_pdeathsig,
            )
        finally:
            log.close()
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if svc.ready_path.exists() and (text := svc.ready_path.read_text().strip()):
                svc.address = text
                return text
            if svc.proc.returncode is not None:
                raise ProcessFailedError(name, svc.proc.returncode, svc.log_path,
                                         log_tail(svc.log_path))
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name!r} not ready after {ready_timeout_s:.0f} s "
                                   f"(log: {svc.log_path})")
            await asyncio.sleep(0.1)

    def failure(self, svc: ServiceProcess) -> ProcessFailedError:
        """The error naming exited service ``svc``, its exit code and log (with its tail)."""
        return ProcessFailedError(svc.name, svc.proc.returncode if svc.proc else None,
                                  svc.log_path, log_tail(svc.log_path))

    def unexpected_exit(self) -> ProcessFailedError | None:
        """The error of a service that exited unexpectedly and was not survived, if any."""
        for svc in self.services.values():
            if not svc.alive and svc.proc is not None and not svc.expected_exit:
                return self.failure(svc)
        return None

    async def wait_any_failure(
            self, survive: Callable[[ServiceProcess], bool] | None = None,
    ) -> ProcessFailedError:
        """Return (never raise) an error for the first service that exits unexpectedly and
        that the run cannot survive.

        Every service that exits has its process group SIGKILLed at once (its children die with
        it). ``survive(svc)`` is asked about each unexpected exit: True means the run goes on
        without the service (e.g. an inference worker whose pool has live workers left); the
        service then counts as an expected exit.
        """
        reaped: set[str] = set()
        while True:
            for svc in list(self.services.values()):
                if svc.proc is None or svc.alive or svc.name in reaped:
                    continue
                reaped.add(svc.name)
                svc.kill_group()
                if svc.expected_exit:
                    continue
                if survive is not None and survive(svc):
                    svc.expected_exit = True
                    continue
                return self.failure(svc)
            await asyncio.sleep(0.2)

    async def stop_all(self, timeout_s: float = 15.0, grace_s: float = 2.0) -> None:
        """SIGTERM every service's process group (dead services' too: their children may live
        on), SIGKILL a group whose leader is still there after ``timeout_s``, and SIGKILL what is
        left of any group ``grace_s`` after its leader exited (orphans of a service that did not
        stop its children)."""
        started = [s for s in self.services.values() if s.proc is not None]
        for svc in started:
            svc.expected_exit = True
            svc.kill_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for svc in started:
            remaining = max(0.1, deadline - time.monotonic())
            proc = svc.proc
            if proc is None:  # never spawned: nothing to wait for
                continue
            try:
                await asyncio.wait_for(proc.wait(), remaining)
            except TimeoutError:
                svc.kill_group(signal.SIGKILL)
                await proc.wait()
        grace_end = time.monotonic() + grace_s
        for svc in started:
            assert svc.proc is not None
            while time.monotonic() < grace_end:
                if not group_members(svc.proc.pid):
                    break
                await asyncio.sleep(0.1)
            svc.kill_group(signal.SIGKILL)


def python_module(module: str, *args: str) -> list[str]:
    """argv running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]
