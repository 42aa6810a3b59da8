"""Fault injection into the real reward service (``rollart serve-reward`` subprocess): hung
scorers are killed (process) or abandoned (thread) and never starve later calls; oversized
replies are a typed client error; the service keeps serving throughout (issue #13)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from polling import wait_for
from test_reward_service import _env

from rollart.reward.client import RewardClient
from rollart.transport.errors import RewardError, RewardTooLargeError


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("reward_faults")
    ready, log = tmp / "ready", tmp / "server.log"
    cmd = [
        sys.executable, "-m", "rollart.reward.server", "--port", "0", "--ready-file", str(ready),
        "--functions", "reward_user_functions", "--processes", "1", "--threads", "2",
        "--timeout-s", "30", "--no-auth",
    ]  # fmt: skip
    with open(log, "wb") as log_file:
        proc = subprocess.Popen(cmd, env=_env(), stdout=log_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"reward service did not start (rc={proc.poll()}):\n{log.read_text()}")
        time.sleep(0.1)
    yield "http://" + ready.read_text().strip()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"reward service ignored SIGTERM with hung calls:\n{log.read_text()}")
    assert rc == 0, log.read_text()


async def _health(client: RewardClient, base: str) -> dict:
    session = client._require_session()
    async with session.get(f"{base}/healthz") as resp:
        assert resp.status == 200
        return await resp.json()


async def _idle(client: RewardClient, base: str) -> bool:
    return (await _health(client, base))["idle_processes"] == 1


async def test_hung_scorers_never_starve_later_calls(service: str) -> None:
    async with RewardClient(service, timeout_s=60, max_retries=3, backoff_s=0.01) as client:
        # Three times the thread slots hang (two at a time, each pair on free slots), then
        # more than the one worker process hangs in a row: before, each kept its slot and
        # every later call timed out.
        hung = []
        for _ in range(3):
            hung += await asyncio.gather(
                *(client.score("hangs_forever", "p", "r") for _ in range(2)),
                return_exceptions=True)
        for _ in range(3):
            # The killed worker's replacement is started in the background; once it is idle
            # the next hung call runs (rather than waiting for it: a 503, not a hang).
            await wait_for(lambda: _idle(client, service))
            with pytest.raises(RewardError, match="timed out after 1 s") as info:
                await client.score("hangs_in_process", "p", "r")
            assert info.value.status == 504
        assert all(isinstance(e, RewardError) and e.status == 504 for e in hung)
        assert all("after" not in e.reason.split("timed out")[0] for e in hung)  # no retries
        for i in range(4):  # thread and process functions are served as before
            ok = await client.score("length_bonus", "p", "x" * (i + 1), None,
                                    {"target_len": 4})
            assert ok.reward == (i + 1) / 4
            math = await client.score("math", "p", r"\boxed{42}", "42")
            assert math.reward == 1.0
        health = await _health(client, service)
    assert health["hung_threads"] == 6
    assert health["killed_processes"] == 3


async def test_oversized_details_are_a_typed_error(service: str) -> None:
    async with RewardClient(service, timeout_s=60, max_reply_bytes=8 << 20,
                            max_details_bytes=4096) as client:
        with pytest.raises(RewardTooLargeError, match="exceed max_details_bytes = 4096"):
            await client.score("huge_details", "p", "r")
    async with RewardClient(service, timeout_s=60, max_reply_bytes=65536) as client:
        with pytest.raises(RewardTooLargeError, match="exceeds max_reply_bytes = 65536"):
            await client.score("huge_details", "p", "r")
        ok = await client.score("math", "p", r"\boxed{1}", "1")
    assert ok.reward == 1.0
