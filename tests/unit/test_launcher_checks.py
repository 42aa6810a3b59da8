"""Launcher checks: workers started for another weight transfer are refused before the first
step; a failed process's error lines are shown even far above its log tail."""

from __future__ import annotations

import logging

import msgspec
import pytest

from helpers.fakes import FakeWorker, make_scenario
from rollart.launcher.startup import check_weight_transfer
from rollart.transport import messages as m
from rollart.transport.errors import RollartError


class FakeTransferWorker(FakeWorker):
    def __init__(self, name: str, kind: str) -> None:
        super().__init__(name)
        self.address, self.kind = f"tcp://{name}:1", kind

    async def stats(self) -> m.WorkerStats:
        return m.WorkerStats(worker=self.name, num_running=0, num_waiting=0, version=0,
                             weight_transfer=self.kind)  # type: ignore[arg-type]


def _scenario(kind: str):
    sc = make_scenario()
    return msgspec.structs.replace(
        sc, trainer=msgspec.structs.replace(sc.trainer, weight_transfer=kind))


async def test_a_worker_without_the_collective_transfer_is_named() -> None:
    workers = [FakeTransferWorker("a", "gloo"), FakeTransferWorker("b", "zmq")]
    with pytest.raises(RollartError, match=r"\{'tcp://b:1': 'zmq'\}.*--weight-transfer gloo"):
        await check_weight_transfer(_scenario("gloo"), workers)
    await check_weight_transfer(_scenario("gloo"), workers[:1])
    await check_weight_transfer(_scenario("zmq"), workers)  # staged buckets: any worker


def test_a_failure_far_above_the_log_tail_is_still_shown(tmp_path) -> None:
    from rollart.launcher.procs import log_tail

    log = tmp_path / "trainer.log"
    log.write_text("start\nValueError: LOCAL_RANK 1 but only 0 CUDA device(s) visible\n"
                   + "".join(f"torchrun summary line {i}\n" for i in range(40)))
    text = log_tail(log, num_lines=30)
    assert "LOCAL_RANK 1 but only 0 CUDA device(s)" in text
    assert text.endswith("torchrun summary line 39")
    short = tmp_path / "ok.log"
    short.write_text("a\nb\n")
    assert log_tail(short) == "a\nb"


def _local_scenario(env_hosts: bool):
    from rollart.config import parse_scenario

    text = ('[[pools]]\nname = "cpu"\n[[domains]]\nname = "d"\nenv = "script:echo"\n'
            'pool = "cpu"\nreward = "mine"\nreward_url = "local"\n')
    if env_hosts:
        text += '[[env_hosts]]\nname = "e"\n'
    return parse_scenario(text, "s.toml")


def test_preflight_lets_a_driver_script_bring_its_own_reward_and_env() -> None:
    from rollart.launcher.local import preflight
    from rollart.transport.errors import ConfigError

    sc = _local_scenario(env_hosts=False)
    # open_cluster: rewards may still be registered on the yielded cluster; envs given
    preflight(sc, "s.toml", local_envs={"script:echo"})
    with pytest.raises(ConfigError, match=r"env_hosts: .*script:echo.*open_cluster\(envs="):
        preflight(sc, "s.toml")
    # open_cluster(rewards=...) and `rollart run` (which registers nothing) know the set
    preflight(sc, "s.toml", local_rewards={"mine"}, local_envs={"script:echo"})
    with pytest.raises(ConfigError, match=r"domains\[0\]\.reward: .*'mine'.*rewards="):
        preflight(_local_scenario(env_hosts=True), "s.toml", local_rewards=(),
                  local_envs={"script:echo"})


@pytest.mark.parametrize("reward", ["env_return", "env_success"])
def test_the_env_derived_rewards_are_built_in_locally(reward) -> None:
    import asyncio

    from rollart.config import parse_scenario
    from rollart.controller.routing.routers import RewardRouter
    from rollart.launcher.local import preflight

    sc = parse_scenario('[[pools]]\nname = "cpu"\n[[domains]]\nname = "d"\nenv = '
                        '"game:GuessTheNumber-v0-easy"\npool = "cpu"\nreward = '
                        f'"{reward}"\nreward_url = "local"\n[[env_hosts]]\nname = "e"\n',
                        "s.toml")
    preflight(sc, "s.toml", local_rewards=())  # `rollart run` registers nothing else
    router = RewardRouter()
    router.check("d", reward, "local")
    lost = asyncio.run(router.score(reward, "local", "p", "r", None, {"env_return": 0.8}))
    won = asyncio.run(router.score(reward, "local", "p", "r", None, {"env_return": 1.0}))
    assert (lost.reward, won.reward) == ((0.8, 1.0) if reward == "env_return" else (0.0, 1.0))


@pytest.mark.parametrize(("env", "expect"), [
    ("game:GuessTheNumbr-v0-easy", r"domains\[0\]\.env: unknown GEM env "
     r"'game:GuessTheNumbr-v0-easy' \(did you mean 'game:GuessTheNumber-v0-easy'\?\); "
     r"registered games: .*game:GuessTheNumber-v0-easy"),
    ("rg:basic_arithmatic", r"domains\[0\]\.env: unknown reasoning-gym dataset "
     r"'basic_arithmatic' \(did you mean 'rg:basic_arithmetic'\?\); e\.g\. rg:"),
    ("rg:zzzzqqq", r"domains\[0\]\.env: unknown reasoning-gym dataset 'zzzzqqq'; e\.g\. "),
    ("gme:GuessTheNumber-v0-easy", r"domains\[0\]\.env: unknown env name "
     r"'gme:GuessTheNumber-v0-easy': expected FAMILY:NAME"),
    ("script:echo", r"domains\[0\]\.env: unknown env name 'script:echo'"),
    ("game:GuessTheNumber-v0-easy", None),
    ("rg:basic_arithmetic", None),
    ("py:nowhere.to.be:Found", None),  # imported by the env host, from its own path
])
def test_preflight_refuses_an_env_no_env_host_can_make(env, expect) -> None:
    # A typo'd env name used to pass validation and fail every session open of the run, once
    # every service had started.
    from rollart.config import parse_scenario
    from rollart.launcher.local import preflight
    from rollart.transport.errors import ConfigError

    sc = parse_scenario(f'[[pools]]\nname = "cpu"\n[[domains]]\nname = "d"\nenv = "{env}"\n'
                        'pool = "cpu"\nreward = "env_return"\n[[env_hosts]]\nname = "e"\n',
                        "s.toml")
    if expect is None:
        preflight(sc, "s.toml", local_rewards=())
        return
    with pytest.raises(ConfigError, match=r"^s\.toml: " + expect):
        preflight(sc, "s.toml", local_rewards=())
    preflight(sc, "s.toml", local_rewards=(), local_envs={env})  # served in-process: its name


async def test_cluster_start_names_envs_nobody_serves() -> None:
    from helpers.fakes import TOK, FakeReward, FakeTrainer
    from rollart.controller import Backends, Cluster
    from rollart.transport.errors import ConfigError

    b = Backends(pools={"cpu": [FakeWorker("w")]}, trainer=FakeTrainer(), tokenizer=TOK,
                 reward_service=FakeReward())
    cluster = Cluster.from_scenario(_local_scenario(env_hosts=False), backends=b)
    cluster.register_reward("mine", lambda *a: 1.0)
    with pytest.raises(ConfigError, match="script:echo"):
        await cluster.start()


def test_a_pools_prefix_store_size_reaches_its_workers(tmp_path) -> None:
    # Issue 11: a worker's prefix store is sized from the scenario (engine.max_prefix_tokens);
    # before, every launched worker kept the 16 Mi-token default, too small for 10k
    # trajectories (each evicted one resends its whole context).
    from pathlib import Path

    from rollart.config import parse_scenario
    from rollart.launcher.services import worker_argv
    from rollart.transport.errors import ConfigError

    base = (Path(__file__).resolve().parents[2] / "scenarios" / "quickstart.toml").read_text()
    assert base.count("[pools.engine]") == 2
    sc = parse_scenario(base.replace("[pools.engine]", "[pools.engine]\nmax_prefix_tokens = 123456",
                                     1), "q.toml")
    sized, plain = sc.pools
    argv = worker_argv(sc, sized, "w-0", 0, tmp_path, [])
    assert argv[argv.index("--max-prefix-tokens") + 1] == "123456"
    assert "--max-prefix-tokens" not in worker_argv(sc, plain, "w-1", 1, tmp_path, [])
    with pytest.raises(ConfigError, match="max_prefix_tokens"):
        parse_scenario(base.replace("[pools.engine]", "[pools.engine]\nmax_prefix_tokens = 0", 1),
                       "bad.toml")


def test_validate_notes_prefix_stores_too_small_for_the_trajectories_in_flight() -> None:
    from rollart.launcher.validate import prefix_store_notes

    # 10k trajectories in flight ((19 + 1) x 512), one worker per pool, 8k tokens each
    big = make_scenario(alpha=19, batch_size=512, group_size=8, max_tokens_per_trajectory=8192,
                        max_tokens_per_turn=64)
    notes = prefix_store_notes(big)
    assert len(notes) == 2 and all("max_prefix_tokens" in n and "10240 trajectories" in n
                                   for n in notes)
    sized = msgspec.structs.replace(big, pools=[
        msgspec.structs.replace(p, engine=msgspec.structs.replace(
            p.engine, max_prefix_tokens=10240 * 8192)) for p in big.pools])
    assert prefix_store_notes(sized) == []
    assert prefix_store_notes(make_scenario()) == []  # the fakes' small runs fit the default


@pytest.mark.parametrize(("run", "noted"), [
    ({"worker_checks": {"agreement_policy": "stop"}, "weight_apply": "at_batch"}, True),
    ({"worker_checks": {"agreement_policy": "quarantine"}, "mode": "areal",
      "weight_apply": "at_batch"}, True),
    ({"worker_checks": {"agreement_policy": "warn"}, "weight_apply": "at_batch"}, False),
    ({"worker_checks": {"agreement_policy": "stop"}, "weight_apply": "eager"}, False),
    # the default applies eagerly in overlap modes: nothing to note
    ({"worker_checks": {"agreement_policy": "stop"}}, False),
    ({"worker_checks": {"agreement_policy": "stop"}, "mode": "sync", "alpha": 0}, False),
])
def test_validate_notes_an_agreement_check_judged_on_all_tokens(run, noted) -> None:
    # Under at_batch overlap no batch after the first holds tokens of the trainer's version,
    # so a worker is judged on all its tokens (the policy's change within alpha included).
    from rollart.launcher.validate import agreement_notes

    notes = agreement_notes(make_scenario(**run))
    assert bool(notes) == noted
    if noted:
        assert "weight_apply = 'at_batch'" in notes[0] and "the policy's change" in notes[0]


def test_validate_notes_a_py_env_whose_package_is_not_on_the_path() -> None:
    # Imported by the env host, on its own path: a note, not an error (found, not imported).
    from rollart.config import parse_scenario
    from rollart.launcher.validate import py_env_notes

    def scenario(env: str):
        return parse_scenario(f'[[pools]]\nname = "cpu"\n[[domains]]\nname = "d"\n'
                              f'env = "{env}"\npool = "cpu"\nreward = "env_return"\n'
                              '[[env_hosts]]\nname = "e"\n', "s.toml")

    (note,) = py_env_notes(scenario("py:nosuchpkg.envs:Nope"))
    assert "domains[0].env: 'py:nosuchpkg.envs:Nope': no package 'nosuchpkg'" in note
    assert py_env_notes(scenario("py:rollart.envhost.families:GemEnv")) == []
    assert py_env_notes(scenario("py:nosuchpkg.envs:Nope"), {"py:nosuchpkg.envs:Nope"}) == []
    assert py_env_notes(scenario("rg:basic_arithmetic")) == []


@pytest.mark.parametrize("env_hosts", [True, False])
def test_open_cluster_leaves_env_names_to_the_script(monkeypatch, env_hosts) -> None:
    # A driver script may register an in-process env on the yielded cluster (register_env)
    # before its first step, so open_cluster does not refuse a name no env host can make,
    # nor a scenario without [[env_hosts]] (the cluster's start names an env nobody serves:
    # test_cluster_start_names_envs_nobody_serves); `rollart run` and `rollart validate`
    # (which know every env) do.
    import asyncio

    from rollart.config import parse_scenario
    from rollart.launcher import local

    class ReachedTheStart(Exception):
        pass

    def stop_here(_cluster):
        raise ReachedTheStart

    monkeypatch.setattr(local, "parse_cluster", stop_here)
    sc = parse_scenario('[[pools]]\nname = "cpu"\n[[domains]]\nname = "d"\n'
                        'env = "local_count"\npool = "cpu"\nreward = "env_return"\n'
                        + ('[[env_hosts]]\nname = "e"\n' if env_hosts else ""), "s.toml")

    async def open_it():
        async with local.open_cluster(sc):
            pass

    with pytest.raises(ReachedTheStart):
        asyncio.run(open_it())


_WARMUP_SCENARIO = ('[[pools]]\nname = "cpu"\n[[domains]]\nname = "mine"\nenv = "local_count"\n'
                    'pool = "cpu"\nreward = "env_return"\n')


def test_the_tiny_warm_up_of_only_user_envs_says_to_turn_it_off(tmp_path) -> None:
    # The documented driver pattern with the default model (tiny, warmed up): the warm-up has
    # no solver for a user's env, and the error must say which line to add; before any process
    # starts (open_cluster's model phase comes before its services).
    import asyncio

    from rollart.config import parse_scenario
    from rollart.launcher import local
    from rollart.transport.errors import ConfigError

    sc = parse_scenario(_WARMUP_SCENARIO, "s.toml")

    async def open_it():
        async with local.open_cluster(sc, source="s.toml", cache_dir=tmp_path,
                                      run_dir=tmp_path / "run"):
            pass

    with pytest.raises(ConfigError, match=r"^s\.toml: model\.tiny_warmup: .*no domain has one: "
                       r"mine \(local_count\); set tiny_warmup = false under \[model\]"):
        asyncio.run(open_it())
    assert not (tmp_path / "run").exists()
    assert not list(tmp_path.glob("warmup-set-*"))  # a refused set is not the last one
    off = parse_scenario(_WARMUP_SCENARIO + "[model]\ntiny_warmup = false\n", "s.toml")
    local.check_warmup_domains(off)


def test_the_tiny_warm_up_skips_user_envs_beside_built_in_ones_with_a_line(caplog) -> None:
    from rollart.config import parse_scenario
    from rollart.launcher.local import check_warmup_domains

    sc = parse_scenario(_WARMUP_SCENARIO + '[[domains]]\nname = "arith"\nenv = '
                        '"rg:basic_arithmetic"\npool = "cpu"\nreward = "env_return"\n', "s.toml")
    with caplog.at_level("WARNING", logger="rollart"):
        check_warmup_domains(sc)
    (line,) = [r.getMessage() for r in caplog.records if "tiny_warmup" in r.getMessage()]
    assert "no scripted solver for mine (local_count)" in line and "arith" not in line


def test_checking_a_gem_env_name_leaves_the_root_logger_as_it_was() -> None:
    # gem's __init__ calls logging.basicConfig(level=INFO): a driver script that configured
    # no logging would print every library's INFO lines from then on.
    import subprocess
    import sys

    code = ("import logging\n"
            "from rollart.envhost.families import check_env_name\n"
            "check_env_name('game:GuessTheNumber-v0-easy')\n"
            "import sys; assert 'gem' in sys.modules\n"
            "root = logging.getLogger(); print(root.level, len(root.handlers))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.split() == [str(logging.WARNING), "0"], out.stdout + out.stderr


def test_validate_notes_engines_that_run_more_sequences_than_the_send_window() -> None:
    from rollart.launcher.validate import cost_notes, window_notes

    def scenario(max_num_seqs: int | None, window: int = 4096):
        sc = make_scenario(max_generate_in_flight=window)
        return msgspec.structs.replace(sc, pools=[
            msgspec.structs.replace(p, engine=msgspec.structs.replace(
                p.engine, max_num_seqs=max_num_seqs)) for p in sc.pools])

    notes = window_notes(scenario(512, window=256))
    assert len(notes) == 2 and all(
        "max_num_seqs = 512 is not below run.max_generate_in_flight = 256" in n
        and "never runs a full batch" in n for n in notes)
    assert set(notes) <= set(cost_notes(scenario(512, window=256)))
    (equal, _) = window_notes(scenario(256, window=256))
    assert "none queued" in equal and "full batch" not in equal
    assert window_notes(scenario(255, window=256)) == []
    assert window_notes(scenario(None, window=1)) == []  # vLLM's own default: not known here


_ECHO_MODULE = '''
class Echo:
    def reset(self, seed):
        return "say a", {}
    def step(self, action):
        return "", 0.0, True, False, {}

ENVS = {"script:echo": Echo}
'''


def test_rollart_run_says_the_warm_up_note_once(tmp_path, monkeypatch, caplog, capsys) -> None:
    # `rollart run` checks the warm-up before its banner and open_cluster checks it again in
    # its preflight; the model phase (a child process) checks it a third time: one line.
    import gc
    import os

    from rollart.launcher import local
    from rollart.launcher.run import main
    from rollart.models import warmup
    from rollart.transport.errors import ConfigError

    async def model_phase(scenario, source, cache_dir, **kwargs):
        # the child's resolve_model, here (its log records reach caplog), the build skipped
        monkeypatch.setattr(warmup, "ensure_quickstart_model", lambda cache, sc: tmp_path)
        local.resolve_model(scenario, cache_dir)
        raise ConfigError("the model phase was reached")

    monkeypatch.setattr(local, "prepare_model", model_phase)
    (tmp_path / "task.py").write_text(_ECHO_MODULE)
    sc = tmp_path / "s.toml"
    sc.write_text('[run]\nlocal_module = "task.py"\n[[pools]]\nname = "cpu"\n'
                  '[[domains]]\nname = "arith"\nenv = "rg:basic_arithmetic"\npool = "cpu"\n'
                  'reward = "env_return"\nreward_url = "local"\n'
                  '[[domains]]\nname = "mine"\nenv = "script:echo"\npool = "cpu"\n'
                  'reward = "env_return"\nreward_url = "local"\n[[env_hosts]]\nname = "e"\n')
    umask, thresholds = os.umask(0o022), gc.get_threshold()
    try:
        with caplog.at_level("WARNING", logger="rollart"):
            rc = main([str(sc), "--out", str(tmp_path / "out"),
                       "--cache-dir", str(tmp_path / "cache")])
    finally:
        os.umask(umask)
        gc.set_threshold(*thresholds)
    assert rc == 2 and "the model phase was reached" in capsys.readouterr().err
    said = [r.getMessage() for r in caplog.records if "no scripted solver" in r.getMessage()]
    assert len(said) == 1 and "mine (script:echo)" in said[0]


def test_the_model_phase_does_not_repeat_the_warm_up_note(tmp_path, monkeypatch,
                                                          caplog) -> None:
    from rollart.config import parse_scenario
    from rollart.launcher.local import resolve_model
    from rollart.models import warmup

    monkeypatch.setattr(warmup, "ensure_quickstart_model", lambda cache, sc: tmp_path)
    sc = parse_scenario(_WARMUP_SCENARIO + '[[domains]]\nname = "arith"\nenv = '
                        '"rg:basic_arithmetic"\npool = "cpu"\nreward = "env_return"\n', "s.toml")
    with caplog.at_level("WARNING", logger="rollart"):
        assert resolve_model(sc, tmp_path / "cache") == tmp_path
    assert not [r for r in caplog.records if "no scripted solver" in r.getMessage()]
