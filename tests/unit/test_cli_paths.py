"""An empty path given to a command is refused by name (exit 2), never read as the current
directory (``Path("")`` is ``.``): a run or a report would otherwise write into the folder the
user is standing in."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from rollart.cli import main as cli
from rollart.launcher.cliargs import path_arg

SMOKE = Path(__file__).resolve().parents[2] / "scenarios" / "smoke.toml"


@pytest.mark.parametrize("argv, option", [
    (["run", "--out", "", str(SMOKE)], "--out"),
    (["run", "--out", "  ", str(SMOKE)], "--out"),
    (["run", "--resume", "", str(SMOKE)], "--resume"),
    (["run", "--cache-dir", "", str(SMOKE)], "--cache-dir"),
    (["run", ""], "scenario"),
    (["report", ""], "run_dir"),
    (["report", "--out", "", "somewhere"], "--out"),
])
def test_an_empty_path_is_a_usage_error_naming_the_option(
        argv: list[str], option: str, capsys: pytest.CaptureFixture[str],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        cli(argv)
    assert exc.value.code == 2
    assert f"argument {option}: is empty" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written where the user stands


def test_path_arg_keeps_a_real_path() -> None:
    assert path_arg("runs/a") == Path("runs/a")
    with pytest.raises(argparse.ArgumentTypeError):
        path_arg("")
