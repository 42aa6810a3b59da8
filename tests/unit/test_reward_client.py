"""RewardClient retry policy, timeouts and concurrency against a small in-test aiohttp server."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rollart.reward.client import RewardClient, RewardResult
from rollart.transport.errors import RewardError, RewardTooLargeError


class FakeRewardEndpoint:
    """Routes ``/{name}`` behave by name; records hit times and peak concurrency."""

    def __init__(self) -> None:
        self.hits: dict[str, list[float]] = defaultdict(list)
        self.bodies: list[dict] = []
        self.inflight = 0
        self.peak = 0

    async def handle(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.hits[name].append(time.monotonic())
        n = len(self.hits[name])
        if name == "flaky":  # 503 twice, then success
            if n <= 2:
                return web.json_response({"error": "warming up"}, status=503)
            return web.json_response({"reward": 1.0, "details": {"attempt": n}})
        if name == "busy":  # 429 once with Retry-After
            if n == 1:
                return web.json_response(
                    {"error": "busy"}, status=429, headers={"Retry-After": "0.3"}
                )
            return web.json_response({"reward": 0.5})
        if name == "bad":
            return web.json_response({"error": "missing field `response`"}, status=400)
        if name == "missing":
            return web.Response(text="no such route", status=404)
        if name == "down":
            return web.json_response({"error": "function crashed"}, status=500)
        if name == "hang":
            await asyncio.sleep(30)
        if name == "timeout504":
            return web.json_response({"error": "timed out after 1 s"}, status=504)
        if name == "huge":  # 2 MB body with a Content-Length
            return web.json_response({"reward": 1.0, "details": {"blob": "x" * (2 << 20)}})
        if name == "huge_stream":  # no Content-Length: chunked
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            await resp.write(b'{"reward": 1.0, "details": {"blob": "')
            for _ in range(64):
                await resp.write(b"x" * 65536)
            await resp.write(b'"}}')
            await resp.write_eof()
            return resp
        if name == "big_details":
            return web.json_response({"reward": 1.0, "details": {"blob": "x" * 5000}})
        if name == "garbage":
            return web.Response(text='{"reward": "high"}', content_type="application/json")
        if name == "slow":
            self.inflight += 1
            self.peak = max(self.peak, self.inflight)
            await asyncio.sleep(0.1)
            self.inflight -= 1
        self.bodies.append(await request.json())
        return web.json_response({"reward": 0.25, "details": {"name": name}})


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[FakeRewardEndpoint, str]]:
    fake = FakeRewardEndpoint()
    app = web.Application()
    app.router.add_post("/fn/{name}", fake.handle)
    app.router.add_post("/v1/reward/{name}", fake.handle)
    async with TestServer(app) as server:
        yield fake, str(server.make_url("/"))


def _client(url: str, **kwargs: float | bool) -> RewardClient:
    opts = {"timeout_s": 5.0, "max_retries": 3, "backoff_s": 0.01, **kwargs}
    return RewardClient(url, **opts)


async def test_posts_the_contract_and_decodes_the_result(endpoint) -> None:
    fake, root = endpoint
    async with _client(root) as client:
        result = await client.score("echo", "prompt", "resp", {"x": [1]}, {"k": "v"})
    assert result == RewardResult(reward=0.25, details={"name": "echo"})
    assert fake.bodies == [
        {"prompt": "prompt", "response": "resp", "reference": {"x": [1]}, "metadata": {"k": "v"}}
    ]


async def test_url_template_with_name(endpoint) -> None:
    fake, root = endpoint
    async with _client(root + "fn/{name}") as client:
        assert client.url_for("a b") == root + "fn/a%20b"
        assert (await client.score("echo", "p", "r")).reward == 0.25
    assert len(fake.hits["echo"]) == 1


async def test_retries_503_then_succeeds(endpoint) -> None:
    fake, root = endpoint
    async with _client(root, backoff_s=0.05) as client:
        result = await client.score("flaky", "p", "r")
    assert result.details == {"attempt": 3}
    t = fake.hits["flaky"]
    # Exponential backoff: 0.05 s then 0.1 s (small tolerance for timer granularity).
    assert t[1] - t[0] >= 0.045 and t[2] - t[1] >= 0.095


async def test_429_honours_retry_after(endpoint) -> None:
    fake, root = endpoint
    async with _client(root) as client:
        assert (await client.score("busy", "p", "r")).reward == 0.5
    t = fake.hits["busy"]
    assert t[1] - t[0] >= 0.28


@pytest.mark.parametrize(
    ("name", "status", "reason"), [("bad", 400, "missing field"), ("missing", 404, "no such route")]
)
async def test_other_4xx_are_not_retried(endpoint, name: str, status: int, reason: str) -> None:
    fake, root = endpoint
    async with _client(root) as client:
        with pytest.raises(RewardError) as info:
            await client.score(name, "p", "r")
    assert info.value.status == status
    assert reason in info.value.reason
    assert len(fake.hits[name]) == 1


async def test_persistent_5xx_fails_after_bounded_retries(endpoint) -> None:
    fake, root = endpoint
    async with _client(root, max_retries=2) as client:
        with pytest.raises(RewardError, match="after 3 attempts: function crashed") as info:
            await client.score("down", "p", "r")
    assert info.value.status == 500
    assert len(fake.hits["down"]) == 3


async def test_hang_times_out_and_is_not_retried_by_default(endpoint) -> None:
    fake, root = endpoint
    async with _client(root, timeout_s=0.2, max_retries=3) as client:
        with pytest.raises(RewardError, match="no reply within timeout_s=0.2") as info:
            await client.score("hang", "p", "r")
        with pytest.raises(RewardError, match="timed out after 1 s") as info504:
            await client.score("timeout504", "p", "r")
    assert info.value.status is None and info504.value.status == 504
    # A hung function is not started again by retries.
    assert len(fake.hits["hang"]) == 1
    assert len(fake.hits["timeout504"]) == 1


async def test_timeouts_are_retried_when_asked(endpoint) -> None:
    fake, root = endpoint
    async with _client(root, max_retries=2, retry_timeouts=True) as client:
        with pytest.raises(RewardError, match="after 3 attempts: timed out"):
            await client.score("timeout504", "p", "r")
    assert len(fake.hits["timeout504"]) == 3


@pytest.mark.parametrize(("name", "match"), [
    ("huge", "reply of \\d+ bytes exceeds max_reply_bytes = 65536"),
    ("huge_stream", "reply body exceeds max_reply_bytes = 65536"),
    ("big_details", "details of 5011 bytes \\(JSON\\) exceed max_details_bytes = 4096"),
])
async def test_oversized_replies_are_a_typed_error(endpoint, name: str, match: str) -> None:
    fake, root = endpoint
    async with _client(root, max_reply_bytes=65536, max_details_bytes=4096) as client:
        with pytest.raises(RewardTooLargeError, match=match):
            await client.score(name, "p", "r")
        # The client keeps working after refusing a body part-way.
        ok = await client.score("plain", "p", "r")
    assert ok.reward == 0.25
    assert len(fake.hits[name]) == 1  # not retried


async def test_hang_times_out_and_is_retried_when_asked(endpoint) -> None:
    fake, root = endpoint
    start = time.monotonic()
    async with _client(root, timeout_s=0.2, max_retries=1, retry_timeouts=True) as client:
        with pytest.raises(RewardError, match="no reply within timeout_s=0.2") as info:
            await client.score("hang", "p", "r")
    assert info.value.status is None
    assert len(fake.hits["hang"]) == 2
    assert time.monotonic() - start < 3.0


async def test_invalid_200_body_is_an_error_without_retry(endpoint) -> None:
    fake, root = endpoint
    async with _client(root) as client:
        with pytest.raises(RewardError, match="invalid 200 reply") as info:
            await client.score("garbage", "p", "r")
    assert info.value.status == 200
    assert len(fake.hits["garbage"]) == 1


async def test_connection_refused_is_retried_then_raised() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with _client(f"http://127.0.0.1:{port}", max_retries=2) as client:
        with pytest.raises(RewardError, match="after 3 attempts: ClientConnectorError") as info:
            await client.score("math", "p", "r")
    assert info.value.status is None


async def test_concurrency_is_limited(endpoint) -> None:
    fake, root = endpoint
    async with _client(root, max_concurrency=2) as client:
        results = await asyncio.gather(*(client.score("slow", "p", str(i)) for i in range(6)))
    assert [r.reward for r in results] == [0.25] * 6
    assert fake.peak == 2


async def test_unopened_client_and_bad_arguments() -> None:
    with pytest.raises(RuntimeError, match="not open"):
        await RewardClient("http://127.0.0.1:1").score("math", "p", "r")
    for kwargs, match in [
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"max_retries": -1}, "max_retries"),
        ({"backoff_s": -1}, "backoff_s"),
    ]:
        with pytest.raises(ValueError, match=match):
            RewardClient("http://127.0.0.1:1", **kwargs)
    with pytest.raises(ValueError, match="http"):
        RewardClient("127.0.0.1:8000")
