"""A benchmark's own options are listed by its --help beside the common ones."""

from __future__ import annotations

import pytest


def test_ablations_help_lists_its_workloads_option(capsys) -> None:
    from benchmarks import ablations

    with pytest.raises(SystemExit) as done:
        ablations.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--workloads" in out and "long_horizon" in out and "--quick" in out


def test_ablations_refuses_an_unknown_workload(capsys) -> None:
    from benchmarks import ablations

    with pytest.raises(SystemExit):
        ablations.main(["--quick", "--workloads", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
