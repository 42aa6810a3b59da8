"""Reward runner, result validation and the aiohttp app, in-process.

The bad-input cases over a real subprocess are in tests/integration/test_reward_service.py; this
file covers what is easier to reach in-process (pool failures, 429, timeouts of async functions).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from rollart.reward import builtins
from rollart.reward.protocol import InvalidRewardError, validate_result
from rollart.reward.registry import RewardInputError, RewardRegistry
from rollart.reward.runner import RewardRunner, ScoringError
from rollart.reward.server import create_app


# Module-level so the process pool can import them by reference in its spawned workers.
def fake_worker_dies(prompt, response, reference, metadata):
    os._exit(3)


def fake_worker_exits(prompt, response, reference, metadata):
    raise SystemExit(4)


def fake_sleeps(prompt, response, reference, metadata):
    time.sleep(float(response))
    return 1.0


async def fake_async_sleeps(prompt, response, reference, metadata):
    await asyncio.sleep(float(response))
    return 1.0


def fake_rejects(prompt, response, reference, metadata):
    raise RewardInputError("metadata.x is required")


def fake_raises(prompt, response, reference, metadata):
    raise ZeroDivisionError("boom")


def fake_own_timeout(prompt, response, reference, metadata):
    raise TimeoutError("solver gave up after 2 s")


async def fake_async_cancels(prompt, response, reference, metadata):
    raise asyncio.CancelledError()


def fake_thread_cancels(prompt, response, reference, metadata):
    raise asyncio.CancelledError()


def fake_set_details(prompt, response, reference, metadata):
    return 1.0, {"not_json": object()}


def fake_returns(prompt, response, reference, metadata):
    return metadata["value"]


@pytest.mark.parametrize(
    ("result", "reward", "details"),
    [
        (1, 1.0, {}),
        (0.25, 0.25, {}),
        (np.float32(0.5), 0.5, {}),
        ((1.0, {"a": 1}), 1.0, {"a": 1}),
        ([0.0, None], 0.0, {}),
    ],
)
def test_validate_result_accepts(result: Any, reward: float, details: dict) -> None:
    out = validate_result("f", result)
    assert (out.reward, out.details) == (reward, details)
    assert type(out.reward) is float


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (None, "returned None"),
        (float("nan"), "non-finite"),
        (float("inf"), "non-finite"),
        (True, "returned bool"),
        ("1.0", "returned str"),
        ((1.0, 2.0, 3.0), "length 3"),
        ((1.0, "details"), "details of type str"),
        ((1.0, {1: "x"}), "string keys"),
        ((None, {}), "returned None"),
    ],
)
def test_validate_result_rejects(result: Any, match: str) -> None:
    with pytest.raises(InvalidRewardError, match=match):
        validate_result("f", result)


@pytest.fixture
async def runner() -> AsyncIterator[RewardRunner]:
    r = RewardRunner(num_threads=4, num_processes=1, default_timeout_s=20.0, warm_up=False)
    yield r
    r.close()


def _spec(fn: Any, **kwargs: Any):
    registry = RewardRegistry()
    return registry.register(fn, **kwargs)


async def _score(
    runner: RewardRunner, fn: Any, response: str = "", metadata: dict | None = None, **kw: Any
):
    return await runner.score(_spec(fn, **kw), "p", response, None, metadata or {})


@pytest.mark.parametrize(
    ("fn", "kwargs", "status", "match"),
    [
        (fake_rejects, {}, 422, "rejected the input: metadata.x is required"),
        (fake_raises, {}, 500, "raised ZeroDivisionError: boom"),
        (fake_raises, {"executor": "inline"}, 500, "raised ZeroDivisionError"),
        (fake_own_timeout, {}, 504, "timed out: solver gave up"),
        (fake_returns, {}, 422, "returned None"),
        (fake_async_cancels, {}, 500, "raised CancelledError although nothing cancelled it"),
        (fake_thread_cancels, {}, 500, "raised CancelledError"),
    ],
)
async def test_runner_classifies_failures(
    runner: RewardRunner, fn: Any, kwargs: dict, status: int, match: str
) -> None:
    with pytest.raises(ScoringError, match=match) as info:
        await _score(runner, fn, metadata={"value": None}, **kwargs)
    assert info.value.status == status


@pytest.mark.parametrize(("fn", "executor"), [(fake_sleeps, "thread"), (fake_async_sleeps, None)])
async def test_runner_timeout_frees_the_caller(
    runner: RewardRunner, fn: Any, executor: str | None
) -> None:
    start = time.monotonic()
    with pytest.raises(ScoringError, match=r"timed out after 0.2 s") as info:
        await _score(runner, fn, "3", timeout_s=0.2, executor=executor)
    assert info.value.status == 504
    assert time.monotonic() - start < 2.0


async def test_runner_process_pool_runs_math_and_survives_dead_workers(
    runner: RewardRunner,
) -> None:
    math_spec = RewardRegistry().register(builtins.math_reward)
    ok = await runner.score(math_spec, "p", r"\boxed{6}", "6", {})
    assert ok.reward == 1.0
    with pytest.raises(ScoringError, match="raised SystemExit") as info:
        await _score(runner, fake_worker_exits, executor="process")
    assert info.value.status == 500
    with pytest.raises(ScoringError, match="worker process died") as info:
        await _score(runner, fake_worker_dies, executor="process")
    assert info.value.status == 503
    # A fresh process replaces the dead one.
    again = await runner.score(math_spec, "p", r"\boxed{7}", "6", {})
    assert again.reward == 0.0
    assert runner.stats()["broken_processes"] == 1


async def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def fake_hangs_forever(prompt, response, reference, metadata):
    time.sleep(3600)


async def test_hung_process_calls_are_killed_and_replaced(runner: RewardRunner) -> None:
    # One worker process: without the kill, the first hung call would hold it for an hour and
    # every later call would time out queueing for it.
    spec_ok = _spec(fake_returns, executor="process", timeout_s=60.0)
    runner.start_process_pool()
    for _ in range(3):
        # A replacement joins the idle slots once started (not counted against a deadline).
        await _wait_for(lambda: runner.stats()["idle_processes"] == 1)
        with pytest.raises(ScoringError, match="timed out after 0.5 s") as info:
            await _score(runner, fake_hangs_forever, executor="process", timeout_s=0.5)
        assert info.value.status == 504
    assert runner.stats()["killed_processes"] == 3
    ok = await runner.score(spec_ok, "p", "r", None, {"value": 0.75})
    assert ok.reward == 0.75
    await _wait_for(lambda: len(runner._procs) == runner.num_processes)  # replaced, no leak


async def test_hung_thread_calls_are_abandoned_and_do_not_starve_later_calls() -> None:
    release = threading.Event()

    def fake_blocks(prompt, response, reference, metadata):
        release.wait(60)
        return 1.0

    runner = RewardRunner(num_threads=2, max_hung_threads=3, warm_up=False)
    try:
        for _ in range(3):  # more hung calls than threads
            with pytest.raises(ScoringError, match="timed out") as info:
                await _score(runner, fake_blocks, executor="thread", timeout_s=0.3)
            assert info.value.status == 504
        assert runner.stats()["hung_threads"] == 3
        # Past max_hung_threads thread calls are refused at once, naming why...
        with pytest.raises(ScoringError, match="3 thread calls hung") as info:
            await _score(runner, fake_returns, metadata={"value": 1.0}, executor="thread")
        assert info.value.status == 503
        # ...and once the hung calls return, thread calls are served again.
        release.set()
        await _wait_for(lambda: runner.stats()["hung_threads"] == 0)
        ok = await _score(runner, fake_returns, metadata={"value": 0.5}, executor="thread")
        assert ok.reward == 0.5
    finally:
        release.set()
        runner.close()


async def test_a_saturated_pool_answers_503_not_504(runner: RewardRunner) -> None:
    release = threading.Event()

    def fake_blocks(prompt, response, reference, metadata):
        release.wait(60)
        return 1.0

    busy = asyncio.ensure_future(_score(runner, fake_blocks, executor="thread", timeout_s=30))
    try:
        others = [asyncio.ensure_future(_score(runner, fake_blocks, executor="thread",
                                               timeout_s=30)) for _ in range(3)]
        # All 4 thread slots are taken: a call that cannot get one is "busy", not "hung".
        await _wait_for(lambda: runner._thread_slots is not None and runner._thread_slots.locked())
        with pytest.raises(ScoringError, match="no free thread slot within 0.3 s") as info:
            await _score(runner, fake_returns, metadata={"value": 1.0}, executor="thread",
                         timeout_s=0.3)
        assert info.value.status == 503
        assert runner.stats()["hung_threads"] == 0
    finally:
        release.set()
    assert [r.reward for r in await asyncio.gather(busy, *others)] == [1.0] * 4


async def test_hung_thread_calls_leave_slots_for_later_calls() -> None:
    release = threading.Event()

    def fake_blocks(prompt, response, reference, metadata):
        release.wait(60)
        return 1.0

    runner = RewardRunner(num_threads=2, max_hung_threads=64, warm_up=False)
    try:
        for _ in range(4):  # twice the thread slots
            with pytest.raises(ScoringError, match="timed out"):
                await _score(runner, fake_blocks, executor="thread", timeout_s=0.2)
        ok = await _score(runner, fake_returns, metadata={"value": 0.25}, executor="thread",
                          timeout_s=30.0)
        assert ok.reward == 0.25
        assert runner.stats()["hung_threads"] == 4
    finally:
        release.set()
        runner.close()


@pytest.fixture
async def client(runner: RewardRunner) -> AsyncIterator[TestClient]:
    registry = RewardRegistry()
    registry.register_module(builtins)
    registry.register(fake_async_sleeps, "slow")
    registry.register(fake_sleeps, "slow_thread")
    registry.register(fake_set_details, "bad_details")
    app = create_app(registry, runner, max_body_bytes=2048, max_inflight=1)
    async with TestClient(TestServer(app)) as c:
        yield c


def _body(response: str = "", **extra: Any) -> dict:
    return {"prompt": "p", "response": response, "reference": None, **extra}


async def test_saturated_server_answers_429(client: TestClient) -> None:
    slow = asyncio.ensure_future(client.post("/v1/reward/slow", json=_body("0.5")))
    await asyncio.sleep(0.1)
    busy = await client.post("/v1/reward/boxed_format", json=_body(r"\boxed{1}"))
    assert busy.status == 429
    assert busy.headers["Retry-After"] == "1"
    assert "limit 1" in (await busy.json())["error"]
    assert (await slow).status == 200
    ok = await client.post("/v1/reward/boxed_format", json=_body(r"\boxed{1}"))
    assert (await ok.json())["reward"] == 1.0


async def test_loop_stays_responsive_while_a_thread_function_runs(client: TestClient) -> None:
    slow = asyncio.ensure_future(client.post("/v1/reward/slow_thread", json=_body("1.0")))
    await asyncio.sleep(0.1)
    start = time.monotonic()
    assert (await client.get("/healthz")).status == 200
    assert time.monotonic() - start < 0.5
    assert (await slow).status == 200


async def test_details_that_are_not_json_are_422(client: TestClient) -> None:
    resp = await client.post("/v1/reward/bad_details", json=_body())
    assert resp.status == 422
    assert "not JSON" in (await resp.json())["error"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "match"),
    [
        ("GET", "/v1/reward/math", None, 405, "Method Not Allowed: GET /v1/reward/math"),
        ("GET", "/nowhere", None, 404, "Not Found"),
        ("POST", "/v1/reward/math", b"[1, 2]", 400, "Expected `object`, got `array`"),
        ("POST", "/v1/reward/math", b"   ", 400, "body is empty"),
        (
            "POST",
            "/v1/reward/math",
            b'{"prompt": "p", "response": "r", "reference": 1, "x": 2}',
            400,
            "unknown field `x`",
        ),
        (
            "POST",
            "/v1/reward/math",
            b'{"prompt": "p", "response": "r", "reference": 1, "metadata": []}',
            400,
            "metadata",
        ),
        ("POST", "/v1/reward/math", b"{" + b" " * 4096 + b"}", 413, "limit is 2048 bytes"),
    ],
)
async def test_http_errors_are_json(
    client: TestClient, method: str, path: str, body: bytes | None, status: int, match: str
) -> None:
    resp = await client.request(method, path, data=body)
    assert resp.status == status
    assert resp.content_type == "application/json"
    assert match in (await resp.json())["error"]


async def test_list_and_health(client: TestClient) -> None:
    listing = await (await client.get("/v1/reward")).json()
    by_name = {f["name"]: f for f in listing["functions"]}
    assert by_name["math"]["executor"] == "process"
    assert by_name["slow"]["executor"] == "async"
    assert by_name["math"]["timeout_s"] == 20.0
    assert (await (await client.get("/healthz")).json()) == {
        "status": "ok", "hung_threads": 0, "idle_processes": 0, "killed_processes": 0,
        "broken_processes": 0}


async def test_invalid_utf8_is_a_400_and_reference_is_optional():
    from aiohttp.test_utils import TestClient, TestServer

    from rollart.reward.runner import RewardRunner
    from rollart.reward.server import build_registry, create_app

    runner = RewardRunner(num_threads=2, warm_up=False)
    client = TestClient(TestServer(create_app(build_registry(), runner)))
    await client.start_server()
    try:
        resp = await client.post("/v1/reward/exact_match", data=b'{"prompt": "\xff\xfe"}',
                                 headers={"Content-Type": "application/json"})
        assert resp.status == 400 and "malformed" in (await resp.json())["error"]
        resp = await client.post("/v1/reward/env_return", json={
            "prompt": "p", "response": "r", "metadata": {"env_return": 1.0}})
        assert resp.status == 200 and (await resp.json())["reward"] == 1.0
    finally:
        await client.close()
        runner.close()
