"""``run.local_module``: the operator's own file registers local rewards and envs for
``rollart run`` and ``open_cluster`` alike (``rollart.launcher.localmodule``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart.config import parse_scenario
from rollart.launcher import localmodule
from rollart.launcher.local import preflight
from rollart.transport.errors import ConfigError

TASK = '''
IMPORTS = globals().setdefault("IMPORTS", 0) + 1

class Echo:
    def __init__(self, letters="abc"):
        self.letters = letters
    def reset(self, seed):
        self.letter = self.letters[seed % len(self.letters)]
        return f"say {self.letter}", {"reference": self.letter}
    def step(self, action):
        return "", 0.0, True, False, {}

def contains_reference(prompt, response, reference, metadata):
    return float(reference in response)

REWARDS = {"mine": contains_reference}
ENVS = {"script:echo": Echo}
'''


def _scenario(module: str | None, env_hosts: bool = False):
    return parse_scenario(_scenario_text(module, env_hosts), "s.toml")


def _scenario_text(module: str | None, env_hosts: bool = False) -> str:
    text = ""
    if module is not None:
        text += f'[run]\nlocal_module = "{module}"\n'
    text += ('[[pools]]\nname = "cpu"\n[[domains]]\nname = "d"\nenv = "script:echo"\n'
             'pool = "cpu"\nreward = "mine"\nreward_url = "local"\n')
    # The tiny model's warm-up has nothing to imitate in a user's env: `rollart run` refuses
    # it on (test_validate_refusals), so these scenarios turn it off as the message says.
    text += "[model]\ntiny_warmup = false\n"
    if env_hosts:
        text += '[[env_hosts]]\nname = "e"\n'
    return text


def test_relative_path_is_found_beside_the_scenario_and_imported_once(tmp_path: Path) -> None:
    (tmp_path / "task.py").write_text(TASK)
    sc = _scenario("task.py")
    regs = localmodule.load(sc, tmp_path, "s.toml")
    assert set(regs.rewards) == {"mine"} and set(regs.envs) == {"script:echo"}
    assert regs.path == (tmp_path / "task.py").resolve()
    assert regs.rewards["mine"]("p", "say b", "b", {}) == 1.0
    env = regs.envs["script:echo"](letters="z")
    assert env.reset(3) == ("say z", {"reference": "z"})
    # rollart run checks the names first, open_cluster registers them: one import
    again = localmodule.load(sc, tmp_path, "s.toml")
    assert again.rewards["mine"] is regs.rewards["mine"]
    assert regs.rewards["mine"].__globals__["IMPORTS"] == 1
    # what `rollart run` checks before any process starts: everything is served
    preflight(sc, "s.toml", local_rewards=regs.rewards, local_envs=regs.envs)


def test_no_module_registers_nothing_and_rollart_run_names_the_field() -> None:
    sc = _scenario(None, env_hosts=True)
    assert localmodule.load(sc) == localmodule.LocalRegistrations()
    # No env host can make 'script:echo' (it is no env family's), and nothing serves it.
    with pytest.raises(ConfigError, match=r"domains\[0\]\.env: unknown env name 'script:echo'"):
        preflight(sc, "s.toml", local_rewards=localmodule.load(sc).rewards)
    with pytest.raises(ConfigError, match=r"domains\[0\]\.reward: .*'mine'.*run\.local_module"):
        preflight(sc, "s.toml", local_rewards=localmodule.load(sc).rewards,
                  local_envs={"script:echo"})
    # A typo of a name the module serves: the message lists what it serves.
    typo = parse_scenario(_scenario_text(None, env_hosts=True).replace("script:echo",
                                                                        "script:ecko"), "s.toml")
    with pytest.raises(ConfigError, match=r"domains\[0\]\.env: unknown env name 'script:ecko'"
                       r".*; served in-process \(run\.local_module's ENVS\): \['script:echo'\]"):
        preflight(typo, "s.toml", local_rewards={"mine"}, local_envs={"script:echo"})


@pytest.mark.parametrize(("body", "error"), [
    (None, r"missing\.py is not a file"),
    ("raise RuntimeError('boom')", r"importing .*failed: RuntimeError: boom"),
    ("import sys\nsys.exit(3)", r"importing .*failed: SystemExit: 3"),
    ("X = 1", r"defines no REWARDS or ENVS"),
    ("REWARDS = [1]", r"REWARDS must be a dict .*got list"),
    ("REWARDS = {'r': 3}", r"REWARDS\['r'\] is not callable \(int\)"),
    ("ENVS = {1: dict}", r"ENVS key 1 is not a non-empty str"),
])
def test_a_bad_module_is_a_config_error_naming_the_field(tmp_path: Path, body, error) -> None:
    name = "missing.py" if body is None else f"bad_{abs(hash(body))}.py"
    if body is not None:
        (tmp_path / name).write_text(body)
    with pytest.raises(ConfigError, match=r"^s\.toml: run\.local_module: .*" + error):
        localmodule.load(_scenario(name), tmp_path, "s.toml")


def test_a_name_registered_by_the_module_and_the_caller_is_refused(tmp_path: Path) -> None:
    (tmp_path / "task2.py").write_text(TASK)
    regs = localmodule.load(_scenario("task2.py"), tmp_path, "s.toml")
    rewards, envs = localmodule.merge(regs, {"other": len}, None)
    assert set(rewards) == {"mine", "other"} and set(envs) == {"script:echo"}
    with pytest.raises(ConfigError, match=r"envs \['script:echo'\] are registered both by "):
        localmodule.merge(regs, None, {"script:echo": dict})


def test_validate_counts_the_modules_names_and_names_a_broken_file(tmp_path: Path,
                                                                    capsys) -> None:
    from rollart.cli import main as cli

    scenario = tmp_path / "s.toml"
    scenario.write_text(_scenario_text("task3.py"))
    (tmp_path / "task3.py").write_text(TASK)
    assert cli(["validate", "--quiet", str(scenario)]) == 0
    assert "would refuse" not in capsys.readouterr().err  # env and reward are served
    (tmp_path / "task3.py").write_text(TASK.replace('"mine"', '"other"'))
    localmodule._LOADED.clear()  # a new process would import the edited file
    assert cli(["validate", "--quiet", str(scenario)]) == 1  # `rollart run` would refuse it
    assert "'mine' is not built in" in capsys.readouterr().err
    (tmp_path / "task3.py").unlink()
    localmodule._LOADED.clear()
    assert cli(["validate", "--quiet", str(scenario)]) == 2
    assert "run.local_module: " in capsys.readouterr().err


def test_the_module_imports_modules_beside_it_wherever_the_cwd(tmp_path: Path, monkeypatch,
                                                              capsys) -> None:
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))  # restored after the test
    folder = tmp_path / "task_folder"
    folder.mkdir()
    (folder / "s.toml").write_text(_scenario_text("task4.py"))
    # one helper imported at the top of the file, one only when the reward runs
    (folder / "h8_top_helper.py").write_text("LETTERS = 'xyz'\n")
    (folder / "h8_late_helper.py").write_text("def score(ok):\n    return 1.0 if ok else 0.0\n")
    (folder / "task4.py").write_text(
        TASK.replace('letters="abc"', "letters=LETTERS")
        .replace("return float(reference in response)",
                 "from h8_late_helper import score\n    return score(reference in response)")
        .replace("class Echo", "from h8_top_helper import LETTERS\n\nclass Echo", 1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for name in ("h8_top_helper", "h8_late_helper"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    from rollart.cli import main as cli

    # `rollart validate` / `rollart run` find it beside the scenario, cwd elsewhere
    assert cli(["validate", "--quiet", str(folder / "s.toml")]) == 0, capsys.readouterr().err
    regs = localmodule.load(parse_scenario(_scenario_text("task4.py"), "s.toml"), folder)
    assert regs.envs["script:echo"]().reset(1) == ("say y", {"reference": "y"})
    assert regs.rewards["mine"]("p", "say y", "y", {}) == 1.0  # the late import works too
    for name in ("h8_top_helper", "h8_late_helper"):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_module_that_fails_to_import_leaves_sys_path_as_it_was(tmp_path: Path,
                                                                 monkeypatch) -> None:
    import sys

    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "task5.py").write_text("import h8_no_such_helper\n")
    before = list(sys.path)
    with pytest.raises(ConfigError, match=r"ModuleNotFoundError: No module named "
                                          r"'h8_no_such_helper'"):
        localmodule.load(_scenario("task5.py"), tmp_path, "s.toml")
    assert sys.path == before
