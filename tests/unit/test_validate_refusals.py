"""What `rollart run` would refuse, `rollart validate` refuses too (exit 1, naming the field and
the fix), and `rollart run` refuses it before it starts any process."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from rollart.cli import main as cli
from rollart.inference import companions
from rollart.launcher import machine
from rollart.transport.errors import ConfigError

MINIMAL = Path(__file__).resolve().parents[1] / "minimal_scenario.toml"


def _runnable(extra: str = "", **replace: str) -> str:
    text = MINIMAL.read_text()
    for old, new in replace.items():
        text = text.replace(old, new)
    return text + '\n[[env_hosts]]\nname = "envs"\n' + extra


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the block ends: nothing listens there


def _children() -> set[int]:
    """This process's live child processes (from /proc, no psutil)."""
    me, kids = str(os.getpid()), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat.rpartition(")")[2].split()[1] == me:
            kids.add(int(pid))
    return kids


#: (id, scenario text, extra argv, what the message says)
CASES = [
    ("unknown_reward", _runnable(**{'reward = "reasoning_gym"': 'reward = "reasonig_gym"'}), [],
     ["domains[0].reward", "serves no function 'reasonig_gym'",
      "did you mean 'reasoning_gym'", "reward.modules"]),
    ("cuda_on_cpu_torch", _runnable('\n[trainer]\ndevice = "cuda"\n'), [],
     ["trainer.device", 'set trainer.device = "cpu"']),
    ("wandb_missing", _runnable('\n[output]\nwandb = true\n'), [],
     ["output.wandb", "pip install wandb", "output.wandb = false"]),
    ("ray_unreachable", _runnable(), ["--cluster", f"ray://127.0.0.1:{_closed_port()}"],
     ["--cluster: no Ray cluster answers at 127.0.0.1:", "--cluster local"]),
    ("unknown_env", _runnable(**{"rg:basic_arithmetic": "nosuch:thing"}), [],
     ["domains[0].env", "unknown env name 'nosuch:thing'"]),
    ("missing_model", _runnable('\n[model]\npath = "/nonexistent/model"\n'), [],
     ["model.path: /nonexistent/model is not a local", 'path = "tiny"']),
]


@pytest.fixture
def no_launch(monkeypatch):
    """`rollart run`'s start of the services, replaced by a sentinel that records a call."""
    from rollart.launcher import run

    calls: list[Path] = []

    async def sentinel(scenario, run_dir, *args, **kwargs) -> int:
        calls.append(run_dir)
        return 0

    monkeypatch.setattr(run, "_drive", sentinel)
    monkeypatch.setattr(run, "tune_gc", lambda: None)  # leave this process's GC as it is
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if machine._torch_version() is None or not machine._torch_version().endswith("+cpu"):
        pytest.skip("the cuda case needs this machine's CPU-only torch")
    return calls


@pytest.mark.parametrize(("text", "argv", "expect"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_validate_and_run_refuse_before_any_process(tmp_path, capsys, no_launch, text, argv,
                                                    expect) -> None:
    sc = tmp_path / "bad.toml"
    sc.write_text(text)
    assert cli(["validate", "--quiet", str(sc), *argv]) == 1
    err = capsys.readouterr().err
    assert "rollart validate: error: `rollart run` would refuse it: " in err, err
    for part in expect:
        assert part in err, (part, err)
    assert f"{sc}: " in err  # the file is named
    before = _children()
    assert cli(["run", str(sc), "--out", str(tmp_path / "run"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollart run: config error: "), err
    for part in expect:
        assert part in err, (part, err)
    assert no_launch == []  # nothing was started
    assert not (tmp_path / "run").exists()
    assert _children() <= before  # no process left behind


def test_the_good_scenario_passes_both(tmp_path, capsys, no_launch) -> None:
    # The sentinel is reached once nothing is refused: the refusals above are real.
    sc = tmp_path / "good.toml"
    sc.write_text(_runnable())
    assert cli(["validate", "--quiet", str(sc)]) == 0
    assert "error" not in capsys.readouterr().err
    assert cli(["run", str(sc), "--out", str(tmp_path / "run")]) == 0
    assert no_launch == [tmp_path / "run"]


def test_a_function_of_reward_modules_counts(tmp_path, monkeypatch) -> None:
    from rollart.config import parse_scenario

    (tmp_path / "myrewards.py").write_text(
        "from rollart.reward.registry import reward_function\n"
        "@reward_function('mine')\n"
        "def mine(prompt, response, reference, metadata):\n    return 1.0\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    text = _runnable('\n[reward]\nmodules = ["myrewards"]\n',
                     **{'reward = "reasoning_gym"': 'reward = "mine"'})
    machine.service_rewards(parse_scenario(text))
    with pytest.raises(ConfigError, match=r"domains\[0\].reward: .*'other'.*'mine'"):
        machine.service_rewards(parse_scenario(text.replace('"mine"', '"other"')))
    broken = text.replace('["myrewards"]', '["no_such_module_here"]')
    with pytest.raises(ConfigError, match="reward.modules: the reward service could not load"):
        machine.service_rewards(parse_scenario(broken.replace('"mine"', '"other"')))


def test_a_local_ray_cluster_that_is_not_running_is_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(machine, "_gcs_server_running", lambda: False)
    with pytest.raises(ConfigError, match=r"--cluster ray: no running Ray cluster found .* "
                                          "`ray start --head`"):
        machine.ray_reachable("auto")
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        (tmp_path / "ray_current_cluster").write_text(
            f"127.0.0.1:{listening.getsockname()[1]}\n")
        machine.ray_reachable("auto")  # something answers there: not refused


def test_companions_built_for_another_torch_get_the_uninstall_line(monkeypatch) -> None:
    versions = {"torch": "2.13.0+cpu", "torchvision": "0.24.0", "torchaudio": "2.13.0+cpu"}
    requires = {"torchvision": ["numpy", "torch==2.9.0"], "torchaudio": ["torch==2.13.0"]}

    def version(name: str) -> str:
        if name not in versions:
            raise companions.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(companions.importlib.metadata, "version", version)
    monkeypatch.setattr(companions.importlib.metadata, "requires",
                        lambda name: requires.get(name))
    assert companions.mismatched_companions() == [
        "torchvision 0.24.0 (needs torch==2.9.0, torch is 2.13.0+cpu)"]
    with pytest.raises(ConfigError, match="`pip uninstall -y torchvision torchaudio torchcodec`"):
        companions.check_torch_companions()
    versions["torchcodec"] = "0.9.0"  # no torch pin: its build tag tells
    assert companions.mismatched_companions()[1] == (
        "torchcodec 0.9.0 (not a +cpu build; torch is 2.13.0+cpu)")
    del versions["torchvision"], versions["torchcodec"]
    companions.check_torch_companions()  # a matching torchaudio is fine


def test_an_inference_worker_refuses_mismatched_companions_before_its_engine(
        monkeypatch, capsys, tmp_path) -> None:
    from rollart.inference import worker

    monkeypatch.setattr(companions, "mismatched_companions", lambda: [
        "torchvision 0.24.0 (needs torch==2.9.0, torch is 2.13.0+cpu)"])

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine must not start")

    monkeypatch.setattr(worker, "serve", no_engine)
    (tmp_path / "config.json").write_text("{}")  # nothing loads it
    assert worker.main(["--model", str(tmp_path), "--name", "w0", "--insecure"]) == 2
    err = capsys.readouterr().err
    assert "w0: FATAL: installed packages: torchvision 0.24.0" in err
    assert "`pip uninstall -y torchvision torchaudio torchcodec`" in err


USER_ENV = '''
class Echo:
    def reset(self, seed):
        return "say a", {"reference": "a"}
    def step(self, action):
        return "", float("a" in action), True, False, {}

ENVS = {"script:echo": Echo}
'''


def test_a_tiny_warm_up_with_only_user_envs_is_refused_by_both(tmp_path, capsys, monkeypatch,
                                                               no_launch) -> None:
    # The default model (tiny, warmed up) on domains of user envs only (run.local_module's
    # ENVS): the warm-up has nothing to imitate, so `rollart run` refuses; validate must too.
    monkeypatch.setenv("ROLLART_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "task.py").write_text(USER_ENV)
    text = MINIMAL.read_text().replace(
        "[run]\n", '[run]\nlocal_module = "task.py"\n').replace(
        "rg:basic_arithmetic", "script:echo").replace('"reasoning_gym"', '"env_return"')
    sc = tmp_path / "mine.toml"
    sc.write_text(text)
    expect = [f"{sc}: model.tiny_warmup: ", "no domain has one: arith (script:echo)",
              "set tiny_warmup = false under [model]"]
    assert cli(["validate", "--quiet", str(sc)]) == 1
    err = capsys.readouterr().err
    for part in ["rollart validate: error: `rollart run` would refuse it: ", *expect]:
        assert part in err, (part, err)
    before = _children()
    assert cli(["run", str(sc), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rollart run: config error: "), err
    for part in expect:
        assert part in err, (part, err)
    assert no_launch == [] and not (tmp_path / "run").exists()
    assert _children() <= before
    assert not (tmp_path / "cache").exists()  # a refused warm-up set is not remembered
    # The fix the message names makes both accept it.
    sc.write_text(text + "\n[model]\ntiny_warmup = false\n")
    assert cli(["validate", "--quiet", str(sc)]) == 0
    assert "error" not in capsys.readouterr().err
    assert cli(["run", str(sc), "--out", str(tmp_path / "run")]) == 0
    assert no_launch == [tmp_path / "run"]
