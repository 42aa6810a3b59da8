"""The env host as a real subprocess (``python -m rollart.envhost.host``) driven by EnvClient."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from rollart.envhost.client import EnvClient
from rollart.envhost.solvers import next_action
from rollart.transport import messages as m
from rollart.transport.errors import EnvError, PeerDeadError
from rollart.transport.security import env_credentials

TESTS_DIR = Path(__file__).resolve().parents[1]
ECHO = "py:envhost_user_envs:EchoEnv"
HANG = "py:envhost_user_envs:HangingEnv"
MAX_SESSIONS = 8


class HostProcess:
    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.ready = tmp_path / "ready"
        self.log = tmp_path / "host.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rollart.envhost.host",
                    "--ready-file",
                    str(self.ready),
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + 90
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"env host exited {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"env host not ready in 90 s:\n{self.output()}")
            time.sleep(0.05)
        self.address = self.ready.read_text()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    proc = HostProcess(
        tmp_path_factory.mktemp("envhost"),
        "--name", "itest",
        "--step-timeout-s", "1.0",
        "--max-sessions", str(MAX_SESSIONS),
        "--threads", "4",
        "--latency", 'py:envhost_user_envs:make_echo={"distribution": "normal", "mean_s": 0.4}',
        *(f"--allow-env=py:envhost_user_envs:{a}"
          for a in ("EchoEnv", "HangingEnv", "make_echo", "RaisingEnv", "ToolCallEnv")),
        "--allow-env=py:no_such_mod_q:X",  # allowed, so its import is tried (and fails)
    )  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture
async def client(host):
    c = EnvClient(host.address, name="itest", default_timeout_s=30.0, auth=env_credentials())
    yield c
    await c.close()


async def test_gem_guess_the_number_episode_is_won(client):
    name = "game:GuessTheNumber-v0-easy"
    opened = await client.open(name, seed=4)
    observations, actions = [opened.observation], []
    try:
        for _ in range(4):
            action = next_action(name, observations, actions, opened.info)
            result = await client.step(opened.session_id, action)
            observations.append(result.observation)
            actions.append(action)
            if result.terminated:
                break
        assert result.terminated and result.reward == 1.0
    finally:
        await client.close_session(opened.session_id)


async def test_gem_sokoban_and_mastermind(client):
    for name, action in [
        ("game:Sokoban-v0-easy", "\\boxed{up}"),
        ("game:Mastermind-v0-easy", "\\boxed{1 2}"),
    ]:
        opened = await client.open(name, seed=1)
        again = await client.open(name, seed=1)
        assert opened.observation == again.observation  # seeded
        result = await client.step(opened.session_id, action)
        assert result.observation.startswith("At turn 1") and not result.terminated
        for sid in (opened.session_id, again.session_id):
            await client.close_session(sid)


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "countdown", "chain_sum"])
async def test_reasoning_gym_single_turn(client, dataset):
    name = f"rg:{dataset}"
    opened = await client.open(name, seed=9)
    assert opened.info["dataset"] == dataset and "answer" not in opened.info
    action = next_action(name, [opened.observation], [], opened.info)
    result = await client.step(opened.session_id, f"The answer is {action}")
    assert result.reward == 1.0 and result.terminated
    await client.close_session(opened.session_id)


async def test_reasoning_gym_options(client):
    opened = await client.open("rg:chain_sum", 3, {"min_terms": 2, "max_terms": 2})
    assert opened.info["config"] == {"min_terms": 2, "max_terms": 2}
    await client.close_session(opened.session_id)
    with pytest.raises(EnvError, match="unknown option") as err:
        await client.open("rg:chain_sum", 3, {"hardness": 9})
    assert err.value.code == "bad_request"


async def test_user_env_by_import_path_with_latency(client):
    opened = await client.open(ECHO, 5, {"max_turns": 2})
    assert opened.observation == "echo env, seed 5"
    first = await client.step(opened.session_id, "hey")
    assert (first.reward, first.terminated, first.info) == (3.0, False, {"turn": 1, "arr": [0, 1]})
    assert (await client.step(opened.session_id, "x")).terminated
    await client.close_session(opened.session_id)
    # make_echo has 0.4 s injected latency (--latency on the command line)
    delayed = await client.open("py:envhost_user_envs:make_echo", 6)
    t0 = time.monotonic()
    await client.step(delayed.session_id, "slow")
    assert time.monotonic() - t0 >= 0.4
    await client.close_session(delayed.session_id)


async def test_raising_env_fails_that_session_only(client):
    bad = await client.open("py:envhost_user_envs:RaisingEnv", 0)
    good = await client.open(ECHO, 0, {"max_turns": 10})
    before = await client.stats()
    with pytest.raises(EnvError, match="RuntimeError: boom") as err:
        await client.step(bad.session_id, "x")
    assert err.value.code == "env_error"
    with pytest.raises(EnvError, match="was closed: env_error") as err:
        await client.step(bad.session_id, "x")
    assert err.value.code == "not_found"
    await client.close_session(bad.session_id)  # closing a failed session is a no-op
    assert (await client.step(good.session_id, "ok")).reward == 2.0
    after = await client.stats()
    assert after.num_errors == before.num_errors + 1
    assert after.num_sessions == before.num_sessions - 1
    await client.close_session(good.session_id)


async def test_hanging_env_times_out_while_others_keep_working(client):
    hung = await client.open(HANG, 0, {"hang_s": 8.0})
    other = await client.open(ECHO, 1, {"max_turns": 100})
    hung_step = asyncio.create_task(client.step(hung.session_id, "hang"))
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    for _ in range(5):
        await client.step(other.session_id, "x")
    assert not hung_step.done()  # served during the hang, not after it
    with pytest.raises(EnvError, match="exceeded its timeout of 1 s") as err:
        await hung_step
    assert err.value.code == "env_timeout"
    assert time.monotonic() - t0 < 6.0  # the 1 s timeout, not the 8 s hang
    with pytest.raises(EnvError) as err:
        await client.step(hung.session_id, "x")
    assert err.value.code == "not_found"
    await client.close_session(other.session_id)


async def test_concurrent_step_on_one_session_rejected(client):
    s = await client.open(HANG, 0, {"hang_s": 0.8})  # under the host's 1 s step timeout
    first = asyncio.create_task(client.step(s.session_id, "hang"))
    await asyncio.sleep(0.1)
    with pytest.raises(EnvError, match="already stepping") as err:
        await client.step(s.session_id, "x")
    assert err.value.code == "bad_request"
    assert (await first).observation == "you said hang"
    await client.close_session(s.session_id)


@pytest.mark.parametrize("name", ["game:NoSuchGame-v0", "rg:nope", "py:no_such_mod_q:X", "x"])
async def test_unknown_env_name(client, name):
    with pytest.raises(EnvError) as err:
        await client.open(name, 0)
    assert err.value.code == "not_found"


async def test_unknown_session(client):
    for call in (client.step("itest-424242", "x"), client.close_session("nope")):
        with pytest.raises(EnvError, match="is unknown") as err:
            await call
        assert err.value.code == "not_found"


async def test_malformed_messages_get_error_replies(host, client):
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    env_credentials().secure_client(sock)  # the run's key, as every client
    sock.connect(host.address)
    decoder = msgspec.msgpack.Decoder(m.Reply)
    call_id = struct.pack(">Q", 7)
    cases = [
        (b"\xc1 not msgpack", "bad_request"),
        (msgspec.msgpack.encode({"kind": "LaunchMissiles"}), "unknown_kind"),
        (msgspec.msgpack.encode({"kind": "EnvStep", "session_id": "s"}), "bad_request"),
        (msgspec.msgpack.encode({"kind": "EnvOpen", "env_name": "rg:x", "seed": "zero"}), "bad_request"),
        (msgspec.msgpack.encode(m.Generate(request_id="r", new_token_ids=b"\x01\x00\x00\x00",
                                           sampling=m.SamplingParams(max_tokens=1))), "unknown_kind"),
    ]  # fmt: skip
    try:
        for body, code in cases:
            await sock.send_multipart([call_id, body])
            frames = await asyncio.wait_for(sock.recv_multipart(), 10)
            reply = decoder.decode(frames[1])
            assert isinstance(reply, m.ErrorReply) and reply.code == code, reply
    finally:
        sock.close(linger=0)
    assert (await client.stats()).host == "itest"  # still serving


async def test_max_sessions(client):
    free = MAX_SESSIONS - (await client.stats()).num_sessions
    opened = [await client.open(ECHO, i) for i in range(free)]
    try:
        with pytest.raises(EnvError, match=f"full: {MAX_SESSIONS}/{MAX_SESSIONS}") as err:
            await client.open(ECHO, 99)
        assert err.value.code == "bad_request"
    finally:
        for s in opened:
            await client.close_session(s.session_id)
    await client.close_session((await client.open(ECHO, 100)).session_id)


async def test_killed_host_raises_peer_dead_not_a_hang(tmp_path):
    proc = HostProcess(tmp_path, "--step-timeout-s", "60", f"--allow-env={HANG}")
    c = EnvClient(proc.address, name="doomed", heartbeat_interval_s=0.2, liveness_timeout_s=1.0, auth=env_credentials())
    try:
        s = await c.open(HANG, 0, {"hang_s": 60.0})
        pending = asyncio.create_task(c.step(s.session_id, "hang"))
        await asyncio.sleep(0.2)
        proc.proc.kill()
        with pytest.raises(PeerDeadError):
            await asyncio.wait_for(pending, 10)
        assert c.dead
        with pytest.raises(PeerDeadError):
            await c.stats()
    finally:
        await c.close()
        proc.stop()


async def test_sigterm_shuts_down_even_with_a_stuck_env(tmp_path):
    proc = HostProcess(tmp_path, "--step-timeout-s", "0.3", f"--allow-env={HANG}",
                       f"--allow-env={ECHO}")
    c = EnvClient(proc.address, name="term", auth=env_credentials())
    try:
        s = await c.open(HANG, 0, {"hang_s": 60.0})
        with pytest.raises(EnvError):
            await c.step(s.session_id, "hang")  # leaves a thread stuck for 60 s
        await c.open(ECHO, 0)
        proc.proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.proc.wait, 15) == 0
        assert "shutting down" in proc.output()
    finally:
        await c.close()
        proc.stop()


def test_bad_config_exits_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "rollart.envhost.host", "--latency", "game={bad"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--latency game: invalid JSON" in proc.stderr


async def test_invalid_action_over_the_wire_keeps_the_session(client):
    opened = await client.open("py:envhost_user_envs:ToolCallEnv", 1, {"max_turns": 2})
    try:
        with pytest.raises(EnvError, match="tool call is not JSON") as err:
            await client.step(opened.session_id, "search(")
        assert err.value.code == "invalid_action"
        ok = await client.step(opened.session_id, '{"tool": "search"}')
        assert ok.observation == "you said search"
    finally:
        await client.close_session(opened.session_id)
