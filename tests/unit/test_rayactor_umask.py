"""``--cluster ray``: the service actor applies the run's umask (``output.share_with_group``)
before writing anything, and tells the service it starts the same. Ray is not needed: the
actor's class is a plain class (``ray.remote`` wraps it in ``rollart.launcher.raycluster``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import types
from pathlib import Path

import pytest

from rollart import filemodes
from rollart.launcher import rayactor
from rollart.launcher.rayactor import ServiceHost


@pytest.fixture
def loose_umask():
    """A permissive umask, as a Ray worker process may have; restored afterwards."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _umask() -> int:
    cur = os.umask(0o077)
    os.umask(cur)
    return cur


@pytest.mark.parametrize("share", [False, True])
def test_the_actor_applies_the_runs_umask(share: bool, loose_umask, monkeypatch) -> None:
    calls: list[bool | None] = []
    real = filemodes.apply_umask

    def spy(share_with_group: bool | None = None) -> int:
        calls.append(share_with_group)
        return real(share_with_group)

    monkeypatch.setattr(rayactor, "apply_umask", spy)
    host = ServiceHost("worker-a-0", {"/driver/run.key_secret": b"k"}, share_with_group=share)
    try:
        assert calls == [share]
        assert _umask() == 0o022 | filemodes.umask_for(share)
        # A file the service's log would be: private, or group-readable when shared.
        log = host.dir / "probe.log"
        log.write_bytes(b"x")
        mode = stat.S_IMODE(log.stat().st_mode)
        assert mode & stat.S_IROTH == 0
        assert bool(mode & stat.S_IRGRP) is share
        assert stat.S_IMODE(Path(host.paths["/driver/run.key_secret"]).stat().st_mode) == 0o600
    finally:
        shutil.rmtree(host.dir, ignore_errors=True)


def test_the_default_is_private(loose_umask) -> None:
    host = ServiceHost("reward", {})
    try:
        assert _umask() == 0o022 | filemodes.umask_for(False)
    finally:
        shutil.rmtree(host.dir, ignore_errors=True)


@pytest.mark.parametrize("share", [False, True])
def test_the_service_is_told_the_same(share: bool, loose_umask, monkeypatch) -> None:
    fake_ray = types.ModuleType("ray")
    fake_ray.util = types.SimpleNamespace(get_node_ip_address=lambda: "10.0.0.7")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    host = ServiceHost("trainer", {}, share_with_group=share)
    seen: dict[str, str] = {}

    async def start(name, argv, *, env, ready_timeout_s):
        seen.update(env)
        raise rayactor.ProcessFailedError(name, 1, host.dir / "x.log", "stopped by the test")

    monkeypatch.setattr(host.sup, "start", start)
    try:
        got = asyncio.run(host.start(["python", "-m", "x"], {filemodes.SHARE_ENV: "1",
                                                            "CUDA_VISIBLE_DEVICES": "3"},
                                     "host", 5.0))
        assert got["error"] == 1
        assert seen[filemodes.SHARE_ENV] == ("1" if share else "0")
        assert "CUDA_VISIBLE_DEVICES" not in seen
    finally:
        shutil.rmtree(host.dir, ignore_errors=True)
