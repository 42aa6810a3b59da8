"""EnvHost handlers in-process (no sockets): sessions, failures, timeouts, latency, config."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import pytest

from rollart.envhost.host import EnvHost, HostConfig, _parser, build_config
from rollart.envhost.latency import LatencyConfig
from rollart.transport import messages as m
from rollart.transport.errors import ConfigError, EnvError

TESTS_DIR = Path(__file__).resolve().parents[1]
ECHO = "py:envhost_user_envs:EchoEnv"
HANG = "py:envhost_user_envs:HangingEnv"
USER_ENVS = [f"py:envhost_user_envs:{a}" for a in (
    "EchoEnv", "make_echo", "RaisingEnv", "HangingEnv", "SlowResetEnv", "NanRewardEnv",
    "BadShapeEnv", "NotAnEnv", "ToolCallEnv", "StrayCancelEnv")]


@pytest.fixture
def user_envs(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    import envhost_user_envs

    return envhost_user_envs


@pytest.fixture
async def make_host(user_envs):
    hosts: list[EnvHost] = []

    def make(**kwargs) -> EnvHost:
        kwargs.setdefault("allow_env", USER_ENVS)
        host = EnvHost(HostConfig(**kwargs))
        hosts.append(host)
        return host

    yield make
    for host in hosts:
        await host.aclose()


async def open_(host: EnvHost, name: str, seed: int = 0, **options) -> m.EnvOpened:
    return await host.open(m.EnvOpen(env_name=name, seed=seed, options=options))


async def step(host: EnvHost, sid: str, action: str) -> m.EnvStepResult:
    return await host.step(m.EnvStep(session_id=sid, action=action))


async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_open_step_close_and_stats(make_host, user_envs):
    host = make_host()
    opened = await open_(host, "rg:chain_sum", seed=2)
    assert opened.session_id == "envhost-1" and "\\boxed{}" in opened.observation
    echo = await open_(host, ECHO, seed=101, max_turns=2)
    assert echo.info == {"seed": 101, "max_turns": 2}
    result = await step(host, echo.session_id, "abc")
    assert (result.observation, result.reward, result.terminated) == ("you said abc", 3.0, False)
    stats = await host.stats()
    assert (stats.host, stats.num_sessions, stats.num_steps, stats.num_errors) == (
        "envhost",
        2,
        1,
        0,
    )
    ack = await host.close_session(m.EnvClose(session_id=echo.session_id))
    assert ack.detail == "closed" and 101 in user_envs.CLOSED_SEEDS
    assert (await host.stats()).num_sessions == 1
    again = await host.close_session(m.EnvClose(session_id=echo.session_id))
    assert again.detail == "already closed: closed by the client"
    with pytest.raises(EnvError, match="was closed: closed by the client") as err:
        await step(host, echo.session_id, "x")
    assert err.value.code == "not_found"


async def test_the_host_closes_a_session_whose_episode_ended(make_host, user_envs):
    host = make_host()
    s = await open_(host, ECHO, seed=103, max_turns=2)
    first = await step(host, s.session_id, "a")
    assert (first.terminated, first.closed) == (False, False)
    last = await step(host, s.session_id, "b")
    # closed with its last step: no EnvClose is needed, and its env is released
    assert (last.terminated, last.closed, last.observation) == (True, True, "you said b")
    assert (await host.stats()).num_sessions == 0
    await wait_for(lambda: 103 in user_envs.CLOSED_SEEDS)
    ack = await host.close_session(m.EnvClose(session_id=s.session_id))
    assert ack.detail == "already closed: closed by the host when its episode ended"
    assert user_envs.CLOSED_SEEDS.count(103) == 1


async def test_unknown_session_and_env_names(make_host):
    host = make_host()
    for call in (
        step(host, "envhost-99", "x"),
        host.close_session(m.EnvClose(session_id="envhost-99")),
        open_(host, "game:NoSuchGame-v0"),
    ):
        with pytest.raises(EnvError) as err:
            await call
        assert err.value.code == "not_found"
    with pytest.raises(EnvError, match="unknown option") as err:
        await open_(host, "rg:chain_sum", bogus=1)
    assert err.value.code == "bad_request"
    stats = await host.stats()
    assert stats.num_sessions == 0 and stats.num_errors == 0  # misuse is not an env failure


async def test_env_raising_fails_only_that_session(make_host, user_envs):
    host = make_host()
    bad = await open_(host, "py:envhost_user_envs:RaisingEnv", seed=201, fail_at=2)
    good = await open_(host, ECHO, seed=202)
    await step(host, bad.session_id, "ok")
    with pytest.raises(EnvError, match="RuntimeError: boom") as err:
        await step(host, bad.session_id, "now fails")
    assert err.value.code == "env_error"
    with pytest.raises(EnvError, match="was closed: env_error") as err:
        await step(host, bad.session_id, "again")
    assert err.value.code == "not_found"
    assert (await step(host, good.session_id, "still fine")).reward == 10.0
    await wait_for(lambda: 201 in user_envs.CLOSED_SEEDS)  # the failed env was released
    stats = await host.stats()
    assert (stats.num_sessions, stats.num_steps, stats.num_errors) == (1, 2, 1)


async def test_contract_violation_is_env_error(make_host):
    host = make_host()
    s = await open_(host, "py:envhost_user_envs:NanRewardEnv")
    with pytest.raises(EnvError, match="reward must be finite") as err:
        await step(host, s.session_id, "x")
    assert err.value.code == "env_error"


async def test_hung_step_times_out_while_others_keep_working(make_host, user_envs):
    # Margins of seconds, not tenths: a loaded CI machine starves this process that long.
    host = make_host(step_timeout_s=1.0, threads=2)
    hung = await open_(host, HANG, seed=301, hang_s=4.0)
    other = await open_(host, ECHO, seed=302, max_turns=100)
    hung_task = asyncio.create_task(step(host, hung.session_id, "hang"))
    await asyncio.sleep(0.05)
    for i in range(5):  # served while the other session's thread is blocked
        assert (await step(host, other.session_id, "x" * i)).reward == i
    assert not hung_task.done()
    with pytest.raises(EnvError, match="exceeded its timeout of 1 s") as err:
        await hung_task
    assert err.value.code == "env_timeout"
    assert host.num_stuck_threads == 1
    with pytest.raises(EnvError, match="was closed: env_timeout"):
        await step(host, hung.session_id, "x")
    assert 301 not in user_envs.CLOSED_SEEDS  # not closed under its running step...
    await wait_for(lambda: 301 in user_envs.CLOSED_SEEDS)  # ...but once it returns
    await wait_for(lambda: host.num_stuck_threads == 0)
    assert (await host.stats()).num_errors == 1


async def test_step_on_busy_session_rejected(make_host):
    host = make_host(step_timeout_s=5.0)
    s = await open_(host, HANG, hang_s=2.0)
    first = asyncio.create_task(step(host, s.session_id, "hang"))
    await asyncio.sleep(0.05)
    with pytest.raises(EnvError, match="already stepping") as err:
        await step(host, s.session_id, "x")
    assert err.value.code == "bad_request"
    assert (await first).observation == "you said hang"


async def test_open_timeout(make_host):
    host = make_host(open_timeout_s=0.2)
    with pytest.raises(EnvError, match="exceeded") as err:
        await open_(host, "py:envhost_user_envs:SlowResetEnv", reset_s=0.6)
    assert err.value.code == "env_timeout"
    assert (await host.stats()).num_sessions == 0
    await wait_for(lambda: host.num_stuck_threads == 0)


async def test_max_sessions(make_host):
    host = make_host(max_sessions=2)
    a = await open_(host, ECHO)
    await open_(host, ECHO)
    with pytest.raises(EnvError, match="full: 2/2 sessions") as err:
        await open_(host, ECHO)
    assert err.value.code == "bad_request"
    await host.close_session(m.EnvClose(session_id=a.session_id))
    await open_(host, ECHO)


async def test_close_during_step_releases_after_it(make_host, user_envs):
    host = make_host()
    s = await open_(host, HANG, seed=401, hang_s=2.0)
    running = asyncio.create_task(step(host, s.session_id, "hang"))
    await asyncio.sleep(0.05)
    ack = await host.close_session(m.EnvClose(session_id=s.session_id))
    assert ack.detail.startswith("closing after")
    assert (await running).observation == "you said hang"
    await wait_for(lambda: 401 in user_envs.CLOSED_SEEDS)


async def test_latency_is_awaited_not_a_thread(make_host):
    slow = LatencyConfig(distribution="normal", mean_s=2.0, std_s=0.0)
    host = make_host(threads=1, latency={ECHO: slow})
    a = await open_(host, ECHO, max_turns=10)
    b = await open_(host, "py:envhost_user_envs:make_echo", max_turns=10)
    t0 = time.monotonic()
    delayed = asyncio.create_task(step(host, a.session_id, "x"))
    await asyncio.sleep(0.05)
    await step(host, b.session_id, "y")  # the only thread is free during a's delay
    assert not delayed.done()
    await delayed
    assert time.monotonic() - t0 >= 2.0


async def test_injected_failure_fails_the_session(make_host):
    host = make_host(latency={"py": LatencyConfig(failure_rate=1.0)})
    s = await open_(host, ECHO)
    with pytest.raises(EnvError, match="injected failure") as err:
        await step(host, s.session_id, "x")
    assert err.value.code == "env_error"
    stats = await host.stats()
    assert (stats.num_sessions, stats.num_errors) == (0, 1)


async def test_aclose_releases_every_session(user_envs):
    host = EnvHost(HostConfig(allow_env=[ECHO]))
    for seed in (501, 502):
        await open_(host, ECHO, seed=seed)
    await host.aclose()
    assert {501, 502} <= set(user_envs.CLOSED_SEEDS)


# ---- py: allow-list ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", [
    "py:os:system", "py:subprocess:check_output", "py:envhost_user_envs:EchoEnv.__init__",
    "py:envhost_user_envs:np.load", "py:envhost_user_envs_missing:EchoEnv"])
async def test_py_env_not_on_the_allow_list_is_refused_before_import(make_host, tmp_path,
                                                                    monkeypatch, name):
    imported: list[str] = []
    import importlib

    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module",
                        lambda mod, *a: imported.append(mod) or real_import(mod, *a))
    host = make_host(allow_env=[ECHO])
    side_effect = tmp_path / "ran"
    with pytest.raises(EnvError, match="allow-list") as err:
        await open_(host, name, command=f"touch {side_effect}")
    assert err.value.code == "bad_request"
    assert name in err.value.message and "--allow-env" in err.value.message
    assert imported == [] and not side_effect.exists()
    assert (await host.stats()).num_sessions == 0
    assert (await open_(host, ECHO, seed=3)).observation == "echo env, seed 3"  # still serving


async def test_default_host_allows_no_py_env_but_builtin_families(make_host):
    host = make_host(allow_env=[])
    with pytest.raises(EnvError, match="allowed: none") as err:
        await open_(host, ECHO)
    assert err.value.code == "bad_request"
    with pytest.raises(EnvError) as err:  # rg: needs no entry: the dataset lookup runs
        await open_(host, "rg:no_such_dataset_zz")
    assert err.value.code == "not_found"


@pytest.mark.parametrize("entry", ["py:os", "game:GuessTheNumber-v0", "py::X", "os:system"])
def test_malformed_allow_entries_are_config_errors(entry):
    with pytest.raises(ConfigError, match="expected an exact py:package.module:Attr"):
        build_config(parse("--allow-env", entry))


def test_allow_env_from_toml_and_flags(tmp_path):
    path = tmp_path / "env.toml"
    path.write_text(f'allow_env = ["{ECHO}"]\n')
    cfg = build_config(parse("--config", str(path), "--allow-env", HANG))
    assert cfg.allow_env == [ECHO, HANG]


# ---- config ------------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(list(argv))


def test_build_config_toml_then_flags(tmp_path):
    path = tmp_path / "env.toml"
    path.write_text(
        'name = "h1"\nstep_timeout_s = 5.0\nthreads = 4\n'
        '[latency.game]\ndistribution = "normal"\nmean_s = 10.0\nstd_s = 3.0\n'
    )
    cfg = build_config(
        parse("--config", str(path), "--threads", "8", "--latency", 'rg={"failure_rate": 0.5}')
    )
    assert (cfg.name, cfg.step_timeout_s, cfg.threads) == ("h1", 5.0, 8)
    assert cfg.latency["game"] == LatencyConfig(distribution="normal", mean_s=10.0, std_s=3.0)
    assert cfg.latency["rg"].failure_rate == 0.5
    assert build_config(parse()).address == "tcp://127.0.0.1:0"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--threads", "0"], "Expected `int` >= 1"),
        (["--latency", "game"], "expected KEY=JSON"),
        (["--latency", "game={oops"], "invalid JSON"),
        (["--latency", 'game={"distribution": "normal", "mean": 1}'], "unknown field `mean`"),
        (["--config", "/nonexistent/env.toml"], "No such file"),
    ],
)
def test_build_config_errors(argv, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_config(parse(*argv))


def test_build_config_unknown_toml_key(tmp_path):
    path = tmp_path / "env.toml"
    path.write_text("step_timeout = 5\n")
    with pytest.raises(ConfigError, match=f"{path}.*unknown field `step_timeout`"):
        build_config(parse("--config", str(path)))


async def test_invalid_action_is_reported_and_the_session_stays_open(make_host):
    host = make_host()
    opened = await open_(host, "py:envhost_user_envs:ToolCallEnv", seed=1, max_turns=2)
    with pytest.raises(EnvError, match="tool call is not JSON") as err:
        await step(host, opened.session_id, '{"tool": "search"')  # broken JSON
    assert err.value.code == "invalid_action"
    assert host.num_errors == 0  # the model's fault, not an env failure
    ok = await step(host, opened.session_id, '{"tool": "search"}')
    assert ok.observation == "you said search" and not ok.terminated


async def test_stray_cancelled_error_in_env_code_is_an_env_error(make_host):
    host = make_host()
    opened = await open_(host, "py:envhost_user_envs:StrayCancelEnv", seed=1)
    with pytest.raises(EnvError, match="raised CancelledError") as err:
        await step(host, opened.session_id, "a")
    assert err.value.code == "env_error"
    assert (await open_(host, ECHO, seed=2)).observation  # the host keeps serving
