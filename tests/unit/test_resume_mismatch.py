"""`rollart run --resume DIR` with a scenario other than the run's: refused before the warm-up
and the services start, naming each field, and the run folder is left as it was."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from rollart.config import load_scenario, scenario_to_json
from rollart.launcher import run as run_cli
from rollart.launcher.rundir import resume_mismatch
from rollart.trainer.checkpoint import mark_complete, step_dir

ROOT = Path(__file__).resolve().parents[2]
SMOKE, QUICKSTART = ROOT / "scenarios" / "smoke.toml", ROOT / "scenarios" / "quickstart.toml"


def _run_folder(tmp_path: Path, scenario: Path) -> Path:
    """A run folder of ``scenario`` with a sealed step-2 checkpoint and a summary."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.json").write_bytes(scenario_to_json(load_scenario(scenario)))
    d = step_dir(run / "checkpoints", 2)
    d.mkdir()
    (d / "controller.json").write_text(json.dumps({"step": 2, "version": 2, "controller": {}}))
    mark_complete(run / "checkpoints", 2)
    (run / "summary.json").write_text('{"steps": 2}\n')
    return run


def test_resuming_with_another_scenario_is_refused_before_anything_starts(
        tmp_path, capsys) -> None:
    run = _run_folder(tmp_path, SMOKE)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert run_cli.main([str(QUICKSTART), "--resume", str(run), "--steps", "3",
                         "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err
    assert f"differs from the scenario that run was started with ({run / 'config.json'})" in err
    for part in ("run.batch_size (run 8, scenario 32)", "run.group_size (run 4, scenario 8)",
                 "domains (run ['guess', 'arith'], scenario ['guess10', 'guess20'])"):
        assert part in err, part
    # Nothing written: no summary rewritten, no warm-up started, no log folder moved.
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert not (tmp_path / "cache").exists()


def test_a_tiny_model_of_another_shape_is_named(tmp_path) -> None:
    run = _run_folder(tmp_path, SMOKE)
    smoke = load_scenario(SMOKE)
    wider = msgspec.structs.replace(smoke, model=msgspec.structs.replace(
        smoke.model, tiny_hidden_size=256, tiny_num_heads=4))
    assert resume_mismatch(run, wider) == [
        "model.tiny_hidden_size (run None, scenario 256)",
        "model.tiny_num_heads (run None, scenario 4)"]


def test_the_same_scenario_and_a_folder_without_config_have_nothing_in_the_way(
        tmp_path) -> None:
    run = _run_folder(tmp_path, SMOKE)
    assert resume_mismatch(run, load_scenario(SMOKE)) == []
    (run / "config.json").unlink()
    assert resume_mismatch(run, load_scenario(QUICKSTART)) == []
    (run / "config.json").write_text('{"run": {"no_such_field": 1}}')  # another version's
    assert resume_mismatch(run, load_scenario(QUICKSTART)) == []


def test_a_resumed_runs_wall_time_counts_its_earlier_invocations(tmp_path, monkeypatch) -> None:
    run = _run_folder(tmp_path, SMOKE)
    (run / "summary.json").write_text('{"steps": 2, "wall_time_s": 1000.0}\n')
    seen: list[float] = []

    async def no_services(scenario, run_dir, cache_dir, planned, start_step, resume, started,
                          **kwargs) -> int:
        seen.append(started)
        return 0

    monkeypatch.setattr(run_cli, "_drive", no_services)
    monkeypatch.setattr(run_cli, "tune_gc", lambda: None)
    assert run_cli.main([str(SMOKE), "--resume", str(run), "--steps", "3",
                         "--cache-dir", str(tmp_path / "cache")]) == 0
    summary = json.loads((run / "summary.json").read_text())
    # the earlier invocation's 1000 s plus this one's few seconds, not this one's alone
    assert 1000.0 <= summary["wall_time_s"] < 1000.0 + 600.0
    assert len(seen) == 1
    # an unreadable or foreign summary adds nothing
    from rollart.launcher.rundir import earlier_wall_time_s
    for text in ("not json", '{"wall_time_s": -3}', '{"wall_time_s": "x"}', "[1]",
                 '{"wall_time_s": Infinity}', '{"wall_time_s": NaN}', '{"wall_time_s": 1e309}',
                 '{"wall_time_s": 1e300}', '{"wall_time_s": true}'):
        (run / "summary.json").write_text(text)
        assert earlier_wall_time_s(run) == 0.0
    (run / "summary.json").unlink()
    assert earlier_wall_time_s(run) == 0.0
