"""`rollart validate`'s exit codes (0 valid, 1 `rollart run` would refuse it, 2 invalid or a
usage error), as its `--help` documents them, and the `rollart validate: ` prefix of every line
it writes to stderr, notes printed with `--quiet` included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollart.cli import main as cli

MINIMAL = Path(__file__).resolve().parents[1] / "minimal_scenario.toml"


def _scenario(tmp_path: Path, extra: str = "", **replace: str) -> Path:
    """The minimal scenario with an env host (what `rollart run` needs), edited."""
    text = MINIMAL.read_text()
    for old, new in replace.items():
        text = text.replace(old, new)
    path = tmp_path / "s.toml"
    path.write_text(text + '\n[[env_hosts]]\nname = "envs"\n' + extra)
    return path


def _err_lines(capsys) -> tuple[str, list[str]]:
    out, err = capsys.readouterr()
    return out, err.splitlines()


def test_a_valid_scenario_exits_0_and_quiet_prints_nothing(tmp_path, capsys) -> None:
    sc = _scenario(tmp_path)
    assert cli(["validate", str(sc)]) == 0
    out, err = _err_lines(capsys)
    assert json.loads(out)["run"]["batch_size"] == 8
    assert err == [f"rollart validate: {sc}: valid (1 domains, 1 pools)"]
    assert cli(["validate", "--quiet", str(sc)]) == 0
    assert capsys.readouterr() == ("", "")


def test_what_run_would_refuse_exits_1_with_prefixed_error_lines(tmp_path, capsys) -> None:
    missing = tmp_path / "no-model"
    sc = _scenario(tmp_path, f'[model]\npath = "{missing}"\n')
    assert cli(["validate", "--quiet", str(sc)]) == 1
    out, err = _err_lines(capsys)
    assert out == ""
    assert err[0].startswith(f"rollart validate: error: `rollart run` would refuse it: {sc}: "
                             f"model.path: {missing} is not a local Hugging Face checkpoint"), err
    assert err[-1] == (f"rollart validate: {sc}: valid as a file, but `rollart run` would "
                       "refuse it: 1 reason(s) above")
    assert len(err) == 2


@pytest.mark.parametrize("command", ["validate", "run"])
def test_an_unknown_cluster_is_a_usage_error_exiting_2_in_validate_and_run(
        tmp_path, capsys, command) -> None:
    # a bad --cluster is the command line's fault, whatever the scenario says, and both
    # commands say so alike: before reading the scenario
    sc = _scenario(tmp_path)
    out_dir = tmp_path / "run"
    extra = ["--out", str(out_dir)] if command == "run" else []
    assert cli([command, str(sc), "--cluster", "bogus", *extra]) == 2
    out, err = _err_lines(capsys)
    assert (out, err) == ("", [f"rollart {command}: config error: --cluster: 'bogus' is not "
                               "'local', 'ray' or 'ray://HOST:PORT'"])
    assert not out_dir.exists()


@pytest.mark.parametrize("replace, field", [
    ({"batch_size = 8": "batch_size = -8"}, "run.batch_size"),
    ({"batch_size = 8": "batch_size = 8\nbogus = 1"}, "run"),
    ({"group_size = 4": "group_size = 3"}, "batch_size"),  # a cross-field rule
])
def test_an_invalid_scenario_exits_2_with_one_config_error_line(
        tmp_path, capsys, replace, field) -> None:
    sc = _scenario(tmp_path, **{k: v for k, v in replace.items()})
    assert cli(["validate", "--quiet", str(sc)]) == 2
    out, err = _err_lines(capsys)
    assert out == "" and len(err) == 1, err
    assert err[0].startswith(f"rollart validate: config error: {sc}: "), err
    assert field in err[0]


def test_a_missing_file_exits_2(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.toml"
    assert cli(["validate", str(missing)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"rollart validate: config error: {missing}: ")


def test_a_usage_error_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli(["validate"])
    assert exc.value.code == 2
    assert "rollart validate: error: " in capsys.readouterr().err


def test_help_documents_every_exit_code(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli(["validate", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "exit status:" in text
    for line in ("  0  valid", "  1  valid as a file, but `rollart run` would refuse it",
                 "  2  invalid"):
        assert line in text, text


def test_quiet_notes_carry_the_prefix_and_the_file(tmp_path, capsys, caplog) -> None:
    # The tiny model's warm-up has no solver for a user's env: a note, printed like the
    # others (it was a bare log line), and nothing else with --quiet.
    sc = _scenario(tmp_path, '\n[[domains]]\nname = "mine"\nenv = "py:no_such_pkg.envs:Env"\n'
                   'pool = "cpu"\nreward = "env_return"\n')
    with caplog.at_level("WARNING"):
        assert cli(["validate", "--quiet", str(sc)]) == 0
    out, err = _err_lines(capsys)
    assert out == "" and len(err) == 2, err
    for line in err:
        assert line.startswith(f"rollart validate: note: {sc}: "), line
    assert any("model.tiny_warmup: no scripted solver for mine" in line for line in err), err
    assert not [r for r in caplog.records if "tiny_warmup" in r.getMessage()]
