"""Bearer-token authentication of the reward service (rollart.reward.auth), in-process."""

from __future__ import annotations

import os
import stat

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rollart.reward.auth import create_token_file, read_token_file, token_from
from rollart.reward.client import RewardClient
from rollart.reward.runner import RewardRunner
from rollart.reward.server import _parse_args, build_registry, create_app
from rollart.transport.errors import ConfigError, RewardError

TOKEN = "s3cret-token-for-tests"


@pytest.fixture
async def server():
    runner = RewardRunner(num_threads=2, num_processes=None, default_timeout_s=120)
    app = create_app(build_registry(), runner, token=TOKEN)
    srv = TestServer(app)
    await srv.start_server()
    yield srv
    await srv.close()


async def test_requests_without_or_with_a_wrong_token_get_401_and_the_service_keeps_serving(
        server):
    async with TestClient(server) as client:
        body = {"prompt": "p", "response": "4", "reference": "4"}
        for headers, fragment in [({}, "no Authorization header"),
                                  ({"Authorization": "Bearer nope"}, "wrong bearer token"),
                                  ({"Authorization": TOKEN}, "wrong bearer token"),
                                  ({"Authorization": f"Bearer {TOKEN}x"}, "wrong bearer token")]:
            resp = await client.post("/v1/reward/exact_match", json=body, headers=headers)
            assert resp.status == 401
            assert fragment in (await resp.json())["error"]
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            assert TOKEN not in await resp.text()
        assert (await client.get("/v1/reward")).status == 401
        assert (await client.get("/healthz")).status == 200  # liveness stays open
        ok = await client.post("/v1/reward/exact_match", json=body,
                               headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status == 200 and (await ok.json())["reward"] == 1.0
        # RFC 7235: the scheme is case-insensitive; the token is not.
        for scheme in ("bearer", "BEARER"):
            ok = await client.post("/v1/reward/exact_match", json=body,
                                   headers={"Authorization": f"{scheme} {TOKEN}"})
            assert ok.status == 200
        bad = await client.post("/v1/reward/exact_match", json=body,
                                headers={"Authorization": f"Bearer {TOKEN.upper()}x"})
        assert bad.status == 401


async def test_reward_client_sends_its_token(server):
    url = str(server.make_url("/"))
    async with RewardClient(url, token=TOKEN, max_retries=0) as good:
        assert (await good.score("exact_match", "p", "4", "4")).reward == 1.0
    async with RewardClient(url, token="wrong", max_retries=3, backoff_s=0.0) as bad:
        with pytest.raises(RewardError) as err:
            await bad.score("exact_match", "p", "4", "4")
    assert err.value.status == 401 and "after" not in err.value.reason  # 401: not retried


def test_token_file_is_private_and_read_back(tmp_path):
    path = tmp_path / "secrets" / "reward.token"
    token = create_token_file(path)
    assert len(token) >= 40 and read_token_file(path, "t") == token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    with pytest.raises(FileExistsError):
        create_token_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="accessible by group or others"):
        read_token_file(path, "t")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(ConfigError, match="is empty"):
        read_token_file(empty, "t")


def test_token_from_env_or_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLART_TEST_TOKEN", " abc \n")
    assert token_from("ROLLART_TEST_TOKEN", None, "d") == "abc"
    monkeypatch.delenv("ROLLART_TEST_TOKEN")
    with pytest.raises(ConfigError, match="ROLLART_TEST_TOKEN.*unset") as err:
        token_from("ROLLART_TEST_TOKEN", None, "domains[x]")
    assert "domains[x]" in str(err.value)
    assert token_from(None, None, "d") is None


def test_non_loopback_host_needs_a_token_or_an_explicit_no_auth(tmp_path):
    with pytest.raises(SystemExit):
        _parse_args(["--host", "0.0.0.0"])
    assert _parse_args(["--host", "0.0.0.0", "--no-auth"]).no_auth
    assert _parse_args(["--host", "0.0.0.0", "--token-file", str(tmp_path / "t")]).token_file
    with pytest.raises(SystemExit):
        _parse_args(["--token-file", "t", "--no-auth"])


def test_readme_multi_machine_reward_command_is_accepted() -> None:
    # The README's "Running across several machines" serve-reward command, parsed as the
    # service parses it: a non-loopback --host needs --token-file (or --no-auth).
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Running across several machines", 1)[1].split("\n## ", 1)[0]
    commands = [" ".join(c.split()) for c in re.findall(r"`(rollart serve-reward[^`]*)`",
                                                          section, re.S)]
    assert commands
    for cmd in commands:
        _parse_args(shlex.split(cmd)[2:])  # exits 2 (SystemExit) if refused


@pytest.mark.parametrize("host", ["127.0.0.1.nip.io", "127.example.com", "0.0.0.0", ""])
def test_a_host_name_that_only_looks_like_loopback_needs_a_token(host) -> None:
    with pytest.raises(SystemExit):
        _parse_args(["--host", host, "--port", "0"])


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_hosts_need_a_token_or_an_explicit_no_auth(host, capsys) -> None:
    # Every local user can connect to a loopback port: as the ZeroMQ services need --key-file
    # or --insecure there, the reward service needs --token-file or --no-auth.
    with pytest.raises(SystemExit) as exit_:
        _parse_args(["--host", host, "--port", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--token-file" in err and "--no-auth" in err
    assert _parse_args(["--host", host, "--port", "0", "--no-auth"]).host == host
