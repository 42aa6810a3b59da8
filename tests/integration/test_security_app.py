"""Application-level access rules with real processes (issue 14, application half).

- env host: a ``py:`` env not on its allow-list is refused before any import and does not run;
  an allowed one works; the host keeps serving;
- trainer: weights go only to registered workers (``PublishLatest`` / ``SetWorkers`` /
  a second ``RegisterWorkers`` naming another address are refused and that address receives
  nothing); a dead registered worker is marked once and skipped afterwards; checkpoints only
  under ``--checkpoint-dir`` (absolute, ``..`` and symlink escapes refused);
- reward service: no token / a wrong token -> 401, the right one is served;
- ``rollart run`` with a ``py:`` domain and a service reward: the launcher's allow-list and
  per-run token make the run work as before.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import zmq

from rollart.envhost.client import EnvClient
from rollart.trainer.client import TrainerClient
from rollart.transport import messages as m
from rollart.transport.errors import EnvError, RemoteError
from rollart.transport.security import env_credentials

TESTS_DIR = Path(__file__).resolve().parents[1]
ECHO = "py:envhost_user_envs:EchoEnv"


def _env_with_tests() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR),
                                                        os.environ.get("PYTHONPATH")]))}


def _free_tcp_address() -> str:
    with socket.socket() as s:  # a port nobody listens on once closed: a dead worker
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


# ---- env host ------------------------------------------------------------------------------------


async def test_env_host_refuses_py_envs_off_its_allow_list(service_launcher, tmp_path):
    host = service_launcher("rollart.envhost.host", ["--allow-env", ECHO],
                            env=_env_with_tests())
    client = EnvClient(host.address, name="envhost", default_timeout_s=60.0,
                       auth=env_credentials())
    ran = tmp_path / "ran"
    attempts = [
        ("py:os:system", {"command": f"id > {ran}"}),
        ("py:subprocess:check_output", {"args": ["touch", str(ran)]}),
        ("py:envhost_user_envs:os.system", {"command": f"id > {ran}"}),
        ("py:envhost_user_envs:EchoEnv.__init__.__globals__", {}),
    ]
    try:
        for name, options in attempts:
            with pytest.raises(EnvError, match="allow-list") as err:
                await client.open(name, 0, options)
            assert err.value.code == "bad_request" and name in err.value.message
        assert not ran.exists()
        opened = await client.open(ECHO, 5, {"max_turns": 1})  # allowed: works, host serving
        assert opened.observation == "echo env, seed 5"
        result = await client.step(opened.session_id, "hi")
        assert result.terminated and result.reward == 2.0
        assert (await client.stats()).num_errors == 0
    finally:
        await client.close()
    assert "refused: py: envs are built only from this env host's allow-list" in host.log()


# ---- trainer -------------------------------------------------------------------------------------


def _samples(n: int) -> list[m.TrainSample]:
    ids = [2, 40, 41, 42, 5, 60, 61, 62]
    return [m.TrainSample.from_lists(token_ids=ids, loss_mask=[0] * 3 + [1] * 5,
                                     behaviour_logprobs=[0.0] * 3 + [-4.0] * 5,
                                     advantage=1.0 if i % 2 == 0 else -1.0, sample_id=f"s{i}")
            for i in range(n)]


async def test_trainer_sends_weights_only_to_registered_workers(tiny_model_dir, service_launcher,
                                                                tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    trainer_proc = service_launcher(
        "rollart.trainer.service",
        ["--model", str(tiny_model_dir), "--options", '{"lr": 0.01}',
         "--checkpoint-dir", str(ckpts)], ready_timeout_s=300)
    ctx = zmq.Context.instance()
    attacker = ctx.socket(zmq.ROUTER)  # would receive a pushed model's buckets
    attacker.setsockopt(zmq.LINGER, 0)
    attacker_port = attacker.bind_to_random_port("tcp://127.0.0.1")
    evil = f"tcp://127.0.0.1:{attacker_port}"
    dead = _free_tcp_address()
    trainer = TrainerClient(trainer_proc.address, auth=env_credentials())
    try:
        with pytest.raises(RemoteError, match="no workers are registered") as err:
            await trainer.publish_latest([evil])
        assert err.value.code == "forbidden"
        await trainer.register_workers([dead])  # the run's only worker (it is dead)
        for call in (trainer.publish_latest([evil]), trainer.set_workers([dead, evil]),
                     trainer.register_workers([dead, evil])):
            with pytest.raises(RemoteError, match=evil) as err:
                await call
            assert err.value.code == "forbidden"
        # Train two versions: both are pushed to the registered set only.
        first = await trainer.train(0, _samples(2))
        published = await trainer.wait_published(first.version)
        assert set(published.failed) == {dead}
        second = await trainer.train(1, _samples(2))
        again = await trainer.wait_published(second.version)
        assert "skipped" in again.failed[dead] and "unreachable since version" in again.failed[dead]
        assert attacker.poll(0) == 0  # every push has completed; nothing reached the attacker
    finally:
        await trainer.close()
        attacker.close()
    log = trainer_proc.log()
    assert "later versions skip it" in log and log.count("later versions skip it") == 1


async def test_trainer_checkpoints_only_under_its_checkpoint_dir(tiny_model_dir,
                                                                 service_launcher, tmp_path):
    base = tmp_path / "t"  # tmp_path itself holds the service logs
    ckpts = base / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    outside = base / "outside"
    outside.mkdir()
    (ckpts / "link").symlink_to(outside)
    trainer_proc = service_launcher(
        "rollart.trainer.service",
        ["--model", str(tiny_model_dir), "--checkpoint-dir", str(ckpts)], ready_timeout_s=300)
    trainer = TrainerClient(trainer_proc.address, auth=env_credentials())
    try:
        for name in (str(base / "abs"), "../escape", "step/../../escape2", "link/step_1"):
            with pytest.raises(RemoteError, match="refused") as err:
                await trainer.save_checkpoint(name)
            assert err.value.code == "forbidden"
        saved = await trainer.save_checkpoint("step_000000")
        assert saved.path == str((ckpts / "step_000000").resolve())
    finally:
        await trainer.close()
    assert (ckpts / "step_000000" / "trainer.json").exists()
    # The trainer's main set a private umask: torch.distributed.checkpoint's files are 0600
    # in 0700 folders, though this test process's umask is looser.
    distcp = list((ckpts / "step_000000").rglob("*.distcp"))
    assert distcp and {stat.S_IMODE(p.stat().st_mode) for p in distcp} == {0o600}
    assert stat.S_IMODE((ckpts / "step_000000").stat().st_mode) == 0o700
    assert sorted(p.name for p in base.iterdir()) == ["outside", "run"]
    assert sorted(p.name for p in (base / "run").iterdir()) == ["checkpoints"]
    assert list(outside.iterdir()) == []


# ---- reward service ------------------------------------------------------------------------------


async def test_reward_service_needs_the_bearer_token(service_launcher, tmp_path):
    from rollart.reward.auth import create_token_file

    token = create_token_file(tmp_path / "secrets" / "reward.token")
    svc = service_launcher("rollart.reward.server",
                           ["--port", "0", "--token-file", str(tmp_path / "secrets" /
                                                               "reward.token")])
    url = f"http://{svc.address}/v1/reward/exact_match"
    body = {"prompt": "p", "response": "4", "reference": "4"}
    async with aiohttp.ClientSession() as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            async with http.post(url, json=body, headers=headers) as resp:
                assert resp.status == 401
                assert "unauthorized" in (await resp.json())["error"]
        async with http.post(url, json=body,
                             headers={"Authorization": f"Bearer {token}"}) as resp:
            assert resp.status == 200 and (await resp.json())["reward"] == 1.0
    assert token not in " ".join(svc.proc.args)  # handed over by path only


def test_reward_service_refuses_a_public_address_without_a_token():
    out = subprocess.run([sys.executable, "-m", "rollart.reward.server", "--host", "0.0.0.0",
                          "--port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--token-file" in out.stderr


def test_reward_service_on_loopback_refuses_to_start_without_a_token_or_no_auth():
    out = subprocess.run([sys.executable, "-m", "rollart.reward.server", "--host", "127.0.0.1",
                          "--port", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--token-file" in out.stderr and "--no-auth" in out.stderr


async def test_reward_service_with_no_auth_serves_and_its_ready_file_is_private(
        service_launcher, tmp_path):
    svc = service_launcher("rollart.reward.server", ["--port", "0", "--no-auth"])
    url = f"http://{svc.address}/v1/reward/exact_match"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json={"prompt": "p", "response": "4",
                                        "reference": "4"}) as resp:
            assert resp.status == 200 and (await resp.json())["reward"] == 1.0
    # Its main set a private umask before writing: the ready file is 0600.
    assert stat.S_IMODE(svc.ready_file.stat().st_mode) == 0o600


# ---- the launcher's defaults, end to end ---------------------------------------------------------

SCENARIO = f"""
[run]
seed = 1
steps = 1
batch_size = 4
group_size = 4
max_turns = 2
max_tokens_per_turn = 8
max_tokens_per_trajectory = 512

[model]
path = "tiny"
tiny_warmup = false
dtype = "float32"

[[pools]]
name = "cpu"
[pools.engine]
enforce_eager = true  # no torch.compile: this run checks secrets, not the engine
kv_cache_bytes = 134217728
max_model_len = 640
max_num_seqs = 16

[[domains]]
name = "echo"
env = "{ECHO}"
env_options = {{ max_turns = 2 }}
pool = "cpu"
reward = "env_return"

[[env_hosts]]
name = "envhost"
threads = 4

[trainer]
checkpoint_every = 1
weight_bucket_bytes = 1048576
"""


@pytest.mark.vllm
@pytest.mark.slow
def test_rollart_run_with_a_py_domain_and_a_token_protected_reward_service(tmp_path,
                                                                          rollart_cache_dir):
    scenario = tmp_path / "sec.toml"
    scenario.write_text(SCENARIO)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "rollart.cli", "run", str(scenario), "--out", str(out),
         "--cache-dir", str(rollart_cache_dir)],  # the session's: the tiny model is built once
        capture_output=True, text=True, timeout=900, env={**os.environ, **_env_with_tests()})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["num_samples"] == 4 and rows[0]["num_failed"] == 0
    token_file = out / "secrets" / "reward.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    for path in out.rglob("*"):  # the secret is nowhere else in the run directory
        if path.is_file() and path != token_file:
            assert token not in path.read_text(errors="replace"), path
    assert (out / "checkpoints" / "step_000001" / "COMPLETE").exists()
    # Private run folder: every folder 0700, every file 0600 (logs, checkpoints included).
    found = {stat.S_IMODE(p.lstat().st_mode) for p in [out, *out.rglob("*")]
             if not p.is_symlink()}
    assert found == {0o700, 0o600}, found
