"""Run keys (files, modes), the insecure-flag rule and CURVE on the RPC sockets, in-process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from pathlib import Path

import pytest
import zmq

from rollart.config import parse_scenario
from rollart.inference.worker import frame_limit
from rollart.launcher.runkeys import run_auth
from rollart.trainer.service import trainer_message_bytes
from rollart.transport import messages as m
from rollart.transport import security as sec
from rollart.transport.errors import ConfigError, RemoteTimeoutError
from rollart.transport.rpc import RpcClient, RpcServer
from rollart.transport.zmqloop import MAX_BATCH_FRAME_BYTES
from rollart.weights.staging import CheckpointLayout

ROOT = Path(__file__).resolve().parents[2]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_key_files_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)  # the most permissive umask: modes must not depend on it
    try:
        secret = sec.create_key_file(tmp_path / "keys")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "keys") == 0o700
    assert _mode(secret) == 0o600 and _mode(tmp_path / "keys" / "run.key") == 0o600
    key = sec.load_key_file(secret)
    public, _ = zmq.auth.load_certificate(tmp_path / "keys" / "run.key")
    assert key.public == public and len(key.secret) == 40
    assert key.secret.decode() not in repr(key)


def test_an_existing_directory_is_made_private(tmp_path):
    d = tmp_path / "keys"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    sec.create_key_file(d)
    assert _mode(d) == 0o700


def test_key_file_readable_by_others_or_public_only_is_refused(tmp_path):
    secret = sec.create_key_file(tmp_path / "k")
    secret.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        sec.load_key_file(secret)
    public = tmp_path / "k" / "run.key"
    with pytest.raises(ConfigError, match="only a public key"):
        sec.load_key_file(public)
    with pytest.raises(ConfigError, match="No such file"):
        sec.load_key_file(tmp_path / "absent.key_secret")


def test_keygen_refuses_to_replace_a_key_without_force(tmp_path, capsys):
    assert sec.main([str(tmp_path / "k")]) == 0
    first = sec.load_key_file(tmp_path / "k" / "run.key_secret")
    assert sec.main([str(tmp_path / "k")]) == 2
    assert sec.load_key_file(tmp_path / "k" / "run.key_secret") == first
    assert sec.main([str(tmp_path / "k"), "--force"]) == 0
    assert sec.load_key_file(tmp_path / "k" / "run.key_secret").public != first.public


@pytest.mark.parametrize("address,loopback", [
    ("tcp://127.0.0.1:5555", True), ("tcp://localhost:1", True), ("tcp://[::1]:1", True),
    ("ipc:///tmp/x", True), ("tcp://0.0.0.0:1", False), ("tcp://*:1", False),
    ("tcp://10.0.0.2:1", False), ("tcp://gpu-node-3:1", False),
    ("tcp://127.0.0.1.nip.io:1", False), ("tcp://127.example.com:1", False),
    ("tcp://127.0.0.1:1;10.0.0.2:7", False),  # ZeroMQ's source;destination connect form
])
def test_is_loopback(address, loopback):
    assert sec.is_loopback(address) is loopback


def test_insecure_rule_one_opt_in_on_loopback_two_on_the_network():
    names = {"flag_name": "--insecure", "config_name": "run.insecure = true"}
    local, remote = ["tcp://127.0.0.1:1"], ["tcp://127.0.0.1:1", "tcp://10.0.0.2:7"]
    assert sec.check_insecure(remote, flag=False, config=False, **names) is False
    assert sec.check_insecure(local, flag=True, config=False, **names) is True
    assert sec.check_insecure(local, flag=False, config=True, **names) is True
    assert sec.check_insecure(remote, flag=True, config=True, **names) is True
    for flag, config in ((True, False), (False, True)):
        with pytest.raises(ConfigError) as err:
            sec.check_insecure(remote, flag=flag, config=config, **names)
        text = str(err.value)
        assert "10.0.0.2" in text and "--insecure" in text and "run.insecure = true" in text


def test_service_auth_choices(tmp_path, monkeypatch):
    key_file = sec.create_key_file(tmp_path / "k")
    monkeypatch.delenv(sec.KEY_FILE_ENV, raising=False)
    monkeypatch.delenv(sec.INSECURE_ENV, raising=False)
    with pytest.raises(ConfigError, match="--key-file"):
        sec.service_auth(None, False, "tcp://127.0.0.1:0")
    assert sec.service_auth(str(key_file), False, "tcp://0.0.0.0:0").path == key_file
    with pytest.raises(ConfigError, match="not both"):
        sec.service_auth(str(key_file), True, "tcp://127.0.0.1:0")
    assert sec.service_auth(None, True, "tcp://127.0.0.1:0") is sec.INSECURE
    with pytest.raises(ConfigError, match="ROLLART_INSECURE=1"):
        sec.service_auth(None, True, "tcp://0.0.0.0:0")
    monkeypatch.setenv(sec.INSECURE_ENV, "1")
    assert sec.service_auth(None, True, "tcp://0.0.0.0:0") is sec.INSECURE
    # The environment alone never turns authentication off.
    monkeypatch.setenv(sec.KEY_FILE_ENV, str(key_file))
    assert isinstance(sec.service_auth(None, False, "tcp://0.0.0.0:0"), sec.RunKey)


def _scenario(extra: str = "") -> object:
    text = (ROOT / "tests" / "minimal_scenario.toml").read_text()
    return parse_scenario(text + extra)


def test_run_auth_makes_a_key_per_run_and_hands_out_its_path(tmp_path):
    keyed = run_auth(_scenario(), tmp_path)
    path = tmp_path / "keys" / "run.key_secret"
    assert keyed.argv == ["--key-file", str(path.resolve())]
    assert keyed.auth == sec.load_key_file(path)
    assert sec.run_credentials(tmp_path).public == keyed.auth.public
    # No key material on any command line.
    assert keyed.auth.secret.decode() not in " ".join(keyed.argv)


def test_run_auth_insecure_and_hand_started_services(tmp_path):
    assert run_auth(_scenario(), tmp_path, insecure=True).argv == ["--insecure"]
    remote = _scenario('\n[[env_hosts]]\nname = "far"\naddress = "tcp://10.0.0.2:7000"\n')
    with pytest.raises(ConfigError, match="run.insecure"):
        run_auth(remote, tmp_path, insecure=True)
    with pytest.raises(ConfigError, match=r"env_hosts\[\d\]\.address.*run.key_file"):
        run_auth(remote, tmp_path)
    theirs = sec.create_key_file(tmp_path / "theirs")
    keyed = run_auth(remote, tmp_path / "run", key_file=theirs)
    assert keyed.auth.public == sec.load_key_file(theirs).public
    assert sec.run_credentials(tmp_path / "run").public == keyed.auth.public
    assert _mode(tmp_path / "run" / "keys" / "run.key_secret") == 0o600


async def test_only_the_runs_key_is_served_and_batches_travel_encrypted(tmp_path):
    key = sec.load_key_file(sec.create_key_file(tmp_path / "a"))
    other = sec.load_key_file(sec.create_key_file(tmp_path / "b"))

    async def echo(msg: m.EnvStep, _frames):
        return m.EnvStepResult(session_id=msg.session_id, observation=msg.action, reward=0.0,
                               terminated=False, truncated=False)

    server = RpcServer("tcp://127.0.0.1:0", {m.EnvStep: echo}, name="curve", auth=key)
    serving = asyncio.create_task(server.serve_forever())
    good = RpcClient(server.address, auth=key, heartbeat_interval_s=0)
    plain = RpcClient(server.address, auth=sec.INSECURE, heartbeat_interval_s=0)
    stranger = RpcClient(server.address, auth=other, heartbeat_interval_s=0)
    try:
        refused = [asyncio.create_task(c.call(m.EnvStep(session_id="x", action="no"),
                                              timeout_s=3.0)) for c in (plain, stranger)]
        # Many small calls in one tick: batch envelopes, through CURVE.
        replies = await asyncio.gather(*(good.call(m.EnvStep(session_id="s", action=str(i)))
                                         for i in range(500)))
        assert [r.observation for r, _ in replies] == [str(i) for i in range(500)]
        for task in refused:
            with pytest.raises(RemoteTimeoutError):
                await task
    finally:
        for c in (good, plain, stranger):
            await c.close()
        await server.close()
        serving.cancel()


async def test_a_client_key_unknown_to_zap_is_counted_as_refused(tmp_path):
    key = sec.load_key_file(sec.create_key_file(tmp_path / "a"))

    async def ack(_msg, _frames):
        return m.Ack()

    server = RpcServer("tcp://127.0.0.1:0", {m.EnvClose: ack}, name="zap", auth=key)
    serving = asyncio.create_task(server.serve_forever())
    before = sec.refused_handshakes()
    # Knows the server's public key, holds its own key pair: only ZAP can tell.
    intruder = sec.RunKey(public=key.public, secret=key.secret)
    public, secret = zmq.curve_keypair()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    intruder.secure_client(sock)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    sock.connect(server.address)
    # The refused handshake never opens a pipe; a blocking send would wait for one forever.
    with contextlib.suppress(zmq.Again):
        sock.send_multipart([b"\0" * 8, b"x"], flags=zmq.NOBLOCK)
    try:
        deadline = asyncio.get_running_loop().time() + 60
        while sec.refused_handshakes() == before:
            assert asyncio.get_running_loop().time() < deadline, "ZAP never refused the key"
            await asyncio.sleep(0.05)
    finally:
        sock.close(linger=0)
        await server.close()
        serving.cancel()


def test_server_frame_limit_never_below_a_batch_envelope():
    server_kw = {"name": "s", "auth": sec.INSECURE}

    async def make(**kw):
        s = RpcServer("tcp://127.0.0.1:0", {}, **server_kw, **kw)
        limit = s._sock.getsockopt(zmq.MAXMSGSIZE)
        await s.close()
        return limit

    assert asyncio.run(make(max_message_bytes=1024)) == MAX_BATCH_FRAME_BYTES
    assert asyncio.run(make(max_message_bytes=64 << 20)) == 64 << 20
    assert asyncio.run(make(max_message_bytes=1 << 30, max_frame_bytes=8 << 20)) == 8 << 20


def test_worker_frame_limit_is_the_largest_tensor_in_float32():
    layout = CheckpointLayout(shapes={"embed": (151_936, 1024), "norm": (1024,)}, tied=True)
    assert frame_limit(layout, 2 << 30) == 151_936 * 1024 * 4
    small = CheckpointLayout(shapes={"w": (16, 16)}, tied=False)
    assert frame_limit(small, 2 << 30) == 64 << 20  # Generate bodies still fit
    assert frame_limit(None, 123 << 20) == 123 << 20


def test_trainer_message_bytes_fits_a_full_batch():
    assert trainer_message_bytes(8, 2048) == 64 << 20
    big = trainer_message_bytes(1024, 32_768)
    assert big >= 9 * 1024 * 32_768 and big < 1 << 30


def test_key_file_path_may_start_with_a_tilde(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    sec.create_key_file(tmp_path / ".rollart")
    assert sec.load_key_file("~/.rollart/run.key_secret").path == tmp_path / ".rollart" / \
        "run.key_secret"
