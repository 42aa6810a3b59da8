"""``benchmarks.run_all``'s named sets are what the docs say (``nox -s bench`` runs ``paper``:
one real-service proof, no engine-heavy measured benchmark), ``--set`` / ``--only`` parse, and
every benchmark's summary entry records its wall and CPU seconds and the load around it."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from benchmarks import run_all

ROOT = Path(__file__).resolve().parents[2]


def test_paper_set_has_one_scenario_proof_and_no_heavy_measured_benchmark() -> None:
    paper = run_all.SETS["paper"]
    assert run_all.DEFAULT_SET == "paper"
    assert [n for n in paper if n in run_all.SCENARIO_RUNS] == ["env_tail-scenario"]
    for heavy in ("controller_overhead", "real_engine", "weight_transfer"):
        assert heavy not in paper and heavy in run_all.SETS["measured"]
    for simulated in ("env_tail", "modes", "ablations", "affinity", "redundancy", "staleness",
                      "staleness_waste", "weight_sync", "pd"):
        assert simulated in paper
    # The two sets split "all" with nothing lost or run twice.
    assert not set(paper) & set(run_all.SETS["measured"])
    assert sorted(paper + run_all.SETS["measured"]) == sorted(run_all.SETS["all"])
    assert set(run_all.SETS["all"]) == {*run_all.BENCHMARKS, *run_all.SCENARIO_RUNS}


def _session_args(name: str) -> list[str]:
    """String arguments of every call in the nox session function ``name`` of noxfile.py."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return [a.value for call in ast.walk(fn) if isinstance(call, ast.Call)
            for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def test_nox_sessions_run_the_sets_the_docs_name() -> None:
    bench, measured = _session_args("bench"), _session_args("bench_measured")
    assert bench[bench.index("--set") + 1] == "paper" and "--quick" in bench
    assert "--bench" not in bench  # the bench-marked tests moved to bench_measured
    assert measured[measured.index("--set") + 1] == "measured" and "--bench" in measured


class FakeCompleted:
    returncode = 0


def test_default_is_the_paper_set_and_only_picks_names(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def fake_run(cmd: list[str], **_: object) -> FakeCompleted:
        ran.append(cmd[cmd.index("--json") + 1])
        return FakeCompleted()

    monkeypatch.setattr(run_all.subprocess, "run", fake_run)
    # The fake writes no JSON, so every benchmark counts as failed (exit 1), but each ran once.
    assert run_all.main(["--out", str(tmp_path)]) == 1
    assert [Path(p).stem for p in ran] == list(run_all.SETS["paper"])
    ran.clear()
    run_all.main(["--out", str(tmp_path), "--set", "measured"])
    assert [Path(p).stem for p in ran] == list(run_all.SETS["measured"])
    ran.clear()
    run_all.main(["--out", str(tmp_path), "--only", "pd", "modes-scenario"])
    assert [Path(p).stem for p in ran] == ["pd", "modes-scenario"]


@pytest.mark.parametrize("argv", [["--set", "nope"], ["--only", "nope"], ["--only"],
                                  ["--set", "paper", "--only", "pd"]])
def test_bad_selection_fails_before_running_anything(tmp_path: Path, argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        run_all.main(["--out", str(tmp_path), *argv])
    assert not (tmp_path / "summary.json").exists()


def test_summary_records_wall_cpu_and_load(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    # pd is analytic (well under a second of its own work): a real child process, cheap.
    assert run_all.main(["--quick", "--out", str(tmp_path), "--only", "pd"]) == 0
    entry = json.loads((tmp_path / "summary.json").read_text())["pd"]
    assert entry["status"] == "ok" and entry["ratios"]
    # The child at least imported Python and numpy: some CPU time, never more than 2 cores' worth.
    assert 0.0 < entry["cpu_s"] <= 2 * entry["wall_s"] + 1.0
    assert entry["load1_before"] >= 0.0 and entry["load1_after"] >= 0.0
    (total,) = [line for line in capsys.readouterr().out.splitlines() if "total" in line]
    assert f"{entry['wall_s']:.1f}" in total and f"{entry['cpu_s']:.1f}" in total


LONG = "rollart vs sync_plus, step time, env latency long tail (std 4 s), Qwen3-8B, 5 seeds"


class FakeBenchmarkRun:
    """Stands in for a benchmark's process: writes its JSON (two ratios, one with a 95%
    interval, one a single measurement) where ``--json`` says."""

    returncode = 0

    def __call__(self, cmd: list[str], **_: object) -> FakeBenchmarkRun:
        out = Path(cmd[cmd.index("--json") + 1])
        out.write_text(json.dumps({
            "benchmark": out.stem, "simulated": True, "rows": [],
            "ratios": {LONG: 1.2345, "one measurement": 0.5},
            "ci95": {LONG: [1.1, 1.4], "one measurement": [None, None]}}))
        return self


def test_summary_in_a_log_is_one_line_per_figure_with_its_interval(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(run_all.subprocess, "run", FakeBenchmarkRun())
    assert run_all.main(["--out", str(tmp_path), "--only", "pd", "modes"]) == 0
    lines = capsys.readouterr().out.splitlines()  # captured: not a terminal
    for name in ("pd", "modes"):
        assert f"{name}  {LONG} = 1.23  95% CI [1.1, 1.4]" in lines
        assert f"{name}  one measurement = 0.5" in lines  # no interval: none printed
        (head,) = [x for x in lines if x.startswith(f"{name}  status = ok")]
        assert "wall_s = " in head and "cpu_s = " in head and "simulated = True" in head
    assert [x for x in lines if x.startswith("total  wall_s = ")]
    entry = json.loads((tmp_path / "summary.json").read_text())["pd"]
    assert entry["ci95"] == {LONG: [1.1, 1.4]}


def test_summary_table_on_a_terminal_shows_the_intervals() -> None:
    from rich.console import Console

    summary = {"pd": {"status": "ok", "wall_s": 1.0, "cpu_s": 0.5, "load1_before": 1.0,
                      "load1_after": 1.2, "simulated": True, "ratios": {"x": 2.0},
                      "ci95": {"x": [1.5, 2.5]}}}
    console = Console(record=True, width=200)
    console.print(run_all.summary_table(summary))
    assert "x = 2  95% CI [1.5, 2.5]" in console.export_text()
