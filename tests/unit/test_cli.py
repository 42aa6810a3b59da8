"""The ``rollart`` command's own front end: usage and exit codes (argparse's conventions)."""

from __future__ import annotations

import subprocess
import sys

from rollart.cli import main as cli


def test_no_command_is_a_usage_error_on_stderr(capsys) -> None:
    assert cli([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "usage: rollart COMMAND" in err and "validate" in err


def test_help_prints_usage_to_stdout_and_succeeds(capsys) -> None:
    for flag in ("--help", "-h"):
        assert cli([flag]) == 0
        out, err = capsys.readouterr()
        assert "usage: rollart COMMAND" in out and err == ""


def test_the_process_exit_status_follows() -> None:
    bare = subprocess.run([sys.executable, "-m", "rollart.cli"], capture_output=True,
                          text=True, timeout=120)
    assert bare.returncode == 2 and bare.stdout == "" and "usage:" in bare.stderr
    helped = subprocess.run([sys.executable, "-m", "rollart.cli", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "usage:" in helped.stdout


def test_a_mistyped_command_gets_a_did_you_mean(capsys) -> None:
    assert cli(["runn"]) == 2
    assert "unknown command 'runn' (did you mean 'run'?)" in capsys.readouterr().err
    assert cli(["frobnicate"]) == 2
    assert "did you mean" not in capsys.readouterr().err
