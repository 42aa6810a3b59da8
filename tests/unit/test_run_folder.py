"""The run folder (rollart.launcher.rundir), TensorBoard scalars read back with the
``tensorboard`` package, ``rollart report`` plots and page, and ``rollart validate``.

The metrics rows are real ``StepMetrics`` produced by the controller over fake backends (a
short run on looptime's virtual clock), not hand-written numbers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from helpers.fakes import FakeEnvHost, FakeReward, FakeTrainer, FakeWorker, make_scenario
from rollart.cli import main as cli
from rollart.controller import Backends, Cluster
from rollart.launcher import rundir
from rollart.launcher.report import PLOTS, SERIES_PLOTS
from rollart.launcher.sinks import step_scalars

MINIMAL = Path(__file__).resolve().parents[1] / "minimal_scenario.toml"


async def _fake_run(run_dir: Path, steps: int = 12) -> list:
    """A short run over the fakes, written by a RunFolder step hook as a real run is."""
    from helpers.fakes import TOK

    scenario = make_scenario(redundancy=1)
    folder = rundir.RunFolder(run_dir, scenario)
    b = Backends(pools={"p1": [FakeWorker("w1")], "p2": [FakeWorker("w2")]},
                 trainer=FakeTrainer(train_s=0.05), tokenizer=TOK,
                 env_hosts=[FakeEnvHost(turns=2, latency=lambda i, s: 0.02 * (1 + i % 3))],
                 reward_service=FakeReward())
    out = []
    cluster = Cluster.from_scenario(scenario, backends=b)
    cluster.add_step_hook(folder.on_step)
    async with cluster:
        async def go():
            async for step in cluster.train(steps=steps):
                out.append(step)

        await asyncio.wait_for(go(), 10_000)
    folder.close()
    return out


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    asyncio.run(_fake_run(run_dir))
    return run_dir


def test_tensorboard_event_files_hold_every_steps_metrics(finished_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(finished_run / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"reward_mean", "step_time_s", "staleness_max", "reward/game", "reward/math",
            "throughput/generated_tokens_per_s"} <= tags
    events = acc.Scalars("reward_mean")
    assert [e.step for e in events] == [r["step"] for r in rows] == list(range(1, 13))
    assert [e.value for e in events] == pytest.approx([r["reward_mean"] for r in rows])
    for tag, value in step_scalars(rows[-1]).items():
        assert acc.Scalars(tag)[-1].value == pytest.approx(value, rel=1e-6), tag


def test_summary_has_first_and_last_reward_and_trained_share_per_domain(
        finished_run: Path) -> None:
    rows = [json.loads(x) for x in (finished_run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((finished_run / "summary.json").read_text())
    for d in ("game", "math"):
        xs = [r["reward_mean_by_domain"][d] for r in rows if d in r["reward_mean_by_domain"]]
        got = summary["domains"][d]
        assert got["reward_first10_mean"] == pytest.approx(sum(xs[:10]) / len(xs[:10]))
        assert got["reward_last10_mean"] == pytest.approx(sum(xs[-10:]) / len(xs[-10:]))
        assert got["steps_with_samples"] == len(xs)
        groups = sum(r["groups_by_domain"].get(d, 0) for r in rows)
        flat = sum(r["flat_groups_by_domain"].get(d, 0) for r in rows)
        assert groups > 0 and got["flat_group_share"] == pytest.approx(flat / groups)
    shares = [summary["domains"][d]["trained_share"] for d in ("game", "math")]
    assert sum(shares) == pytest.approx(1.0) and all(s > 0 for s in shares)


def test_report_writes_pngs_that_decode_and_a_page_that_embeds_them(finished_run: Path,
                                                                    capsys) -> None:
    from matplotlib.image import imread

    assert cli(["report", str(finished_run)]) == 0
    out = finished_run / "report"
    for name in PLOTS:
        img = imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100, name
        assert img.std() > 0.01, f"{name} is blank"
    page = (out / "index.html").read_text()
    import re

    srcs = re.findall(r'<img src="([^"]+)"', page)
    # the fixed plots, and the training series the fake trainer reports (loss only)
    assert set(PLOTS) <= set(srcs) and set(srcs) - set(PLOTS) <= set(SERIES_PLOTS)
    assert "loss.png" in srcs and "kl.png" not in srcs
    assert all((out / s).is_file() for s in srcs)
    assert "reward_last10_mean" in page and "<td>game</td>" in page


def test_report_without_metrics_fails_with_a_clear_message(tmp_path: Path, capsys) -> None:
    assert cli(["report", str(tmp_path)]) == 2
    assert "no step metrics" in capsys.readouterr().err


def test_fresh_run_moves_an_earlier_run_aside_and_resume_truncates(tmp_path: Path) -> None:
    d = tmp_path / "run"
    (d / "logs").mkdir(parents=True)
    (d / "logs" / "trainer.log").write_text("old run\n")
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i}) + "\n" for i in (1, 2, 3)))
    moved = rundir.prepare(d, None)
    assert moved is not None and (moved / "logs" / "trainer.log").read_text() == "old run\n"
    assert not (d / "logs").exists() and not (d / "metrics.jsonl").exists()
    assert (moved / "metrics.jsonl").exists()
    # resume at step 2: later steps' records go, logs move aside, nothing else does
    (d / "logs").mkdir()
    (d / "logs" / "trainer.log").write_text("first attempt\n")
    for name in ("metrics.jsonl", "transcripts.jsonl"):
        (d / name).write_text("".join(json.dumps({"step": i}) + "\n" for i in (1, 2, 3)))
    moved2 = rundir.prepare(d, 2)
    assert moved2 != moved and (moved2 / "logs" / "trainer.log").read_text() == "first attempt\n"
    for name in ("metrics.jsonl", "transcripts.jsonl"):
        assert [json.loads(x)["step"] for x in (d / name).read_text().splitlines()] == [1, 2]
    assert rundir.prepare(tmp_path / "new", None) is None


def test_a_half_written_last_line_is_left_out_by_report_summary_and_resume(
        finished_run: Path, tmp_path: Path, capsys) -> None:
    # A running run (or one killed mid-write) ends with an incomplete line.
    d = tmp_path / "run"
    d.mkdir()
    lines = (finished_run / "metrics.jsonl").read_text().splitlines()
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n" + lines[-1][:40])
    assert cli(["report", str(d)]) == 0
    assert f"{len(lines)} steps" in capsys.readouterr().out
    assert rundir.write_summary(d, make_scenario(redundancy=1), 0.0)["steps"] == len(lines)
    (d / "transcripts.jsonl").write_text(
        "".join(json.dumps({"step": i}) + "\n" for i in (1, 2, 3)) + '{"step": 4, "te')
    rundir.prepare(d, 2)
    assert [json.loads(x)["step"] for x in (d / "transcripts.jsonl").read_text().splitlines()] \
        == [1, 2]
    # a bad line elsewhere is named, not a traceback
    (d / "metrics.jsonl").write_text(lines[0] + "\n{oops\n" + lines[1] + "\n")
    assert cli(["report", str(d)]) == 2
    assert "line 2 is not JSON" in capsys.readouterr().err


def test_the_base_model_record_names_what_is_missing(tmp_path: Path) -> None:
    from rollart.config import load_scenario
    from rollart.transport.errors import ConfigError

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(ConfigError, match=r"base_model\.json: missing.*--base"):
        rundir.base_model(run)
    rundir.record_base_model(run, tmp_path / "." / "model", load_scenario(MINIMAL))
    assert rundir.base_model(run) == model.resolve()
    (model / "config.json").unlink()  # e.g. the cache was cleared
    with pytest.raises(ConfigError, match=rf"{model.resolve()} is not a Hugging Face checkpoint"):
        rundir.base_model(run)
    (run / "base_model.json").write_text("[1]")
    with pytest.raises(ConfigError, match=r"not a base model record"):
        rundir.base_model(run)


def test_resume_point_needs_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(rundir.ConfigError, match="no complete checkpoint"):
        rundir.resume_point(tmp_path)


def test_validate_prints_the_resolved_scenario(capsys) -> None:
    assert cli(["validate", str(MINIMAL)]) == 1  # no env host: `rollart run` would refuse it
    out, err = capsys.readouterr()
    resolved = json.loads(out)
    assert "error: `rollart run` would refuse it" in err and "env_hosts" in err
    assert resolved["run"]["alpha"] == 1 and resolved["output"]["tensorboard"] is True
    assert resolved["domains"][0]["reward_url"] == "service"  # defaults filled in


def test_validate_ends_on_its_notes_and_says_run_would_refuse(tmp_path: Path) -> None:
    # A terminal shows stdout and stderr together: the notes come after the resolved
    # scenario, and the last line says `rollart run` would refuse it (exit 1: valid as a file;
    # a driver script may still serve what is missing).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rollart.cli", "validate", str(MINIMAL)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stdout
    lines = out.stdout.rstrip().splitlines()
    assert lines[-2].startswith("rollart validate: error: `rollart run` would refuse it")
    assert lines[-1].endswith("valid as a file, but `rollart run` would refuse it: 1 reason(s) "
                              "above")
    assert json.loads("\n".join(lines[:-2]))["run"]["batch_size"] == 8


def test_rollart_run_says_what_validate_notes(tmp_path: Path, capsys) -> None:
    sc = tmp_path / "stop.toml"
    # at_batch spelled out: the default (eager) gives no agreement note
    sc.write_text(MINIMAL.read_text().replace(
        "[[pools]]", '[run.worker_checks]\nagreement_policy = "stop"\n[[env_hosts]]\n'
        'name = "e"\n[[pools]]', 1).replace("[run]", '[run]\nweight_apply = "at_batch"', 1))
    assert cli(["run", str(sc), "--steps", "0"]) == 2  # refused after the notes
    err = capsys.readouterr().err
    assert "rollart run: note: " in err and "weight_apply = 'at_batch'" in err
    assert "--steps: must be >= 1" in err


def test_validate_names_the_bad_field_and_exits_2(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(MINIMAL.read_text().replace('pool = "cpu"', 'pool = "cpu"\nweight = -1'))
    assert cli(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "domains[0].weight" in err
    bad.write_text(MINIMAL.read_text() + "\n[run2]\nx = 1\n")
    assert cli(["validate", str(bad)]) == 2
    assert "run2" in capsys.readouterr().err


def test_validate_notes_a_model_path_that_is_no_local_checkpoint(tmp_path: Path, capsys) -> None:
    sc = tmp_path / "remote_model.toml"
    sc.write_text(MINIMAL.read_text() + '\n[model]\npath = "/nonexistent/model"\n')
    assert cli(["validate", str(sc), "--quiet"]) == 1  # `rollart run` here would refuse it
    err = capsys.readouterr().err
    assert "remote_model.toml: model.path: /nonexistent/model is not a local" in err
    assert cli(["validate", str(MINIMAL), "--quiet"]) == 1  # the tiny model: no note
    assert "model.path" not in capsys.readouterr().err


def test_validate_checks_the_run_key_as_rollart_run_would(tmp_path: Path, capsys) -> None:
    from rollart.transport.security import create_key_file

    key = create_key_file(tmp_path / "keys")
    scenario = tmp_path / "keyed.toml"
    scenario.write_text(_runnable(MINIMAL.read_text()).replace(
        "[run]", f'[run]\nkey_file = "{key}"', 1))
    assert cli(["validate", str(scenario), "--quiet"]) == 0
    key.chmod(0o644)  # readable by other users: rollart run refuses it, so must validate
    assert cli(["validate", str(scenario), "--quiet"]) == 2
    assert str(key) in capsys.readouterr().err
    missing = tmp_path / "missing.toml"
    missing.write_text(MINIMAL.read_text().replace(
        "[run]", f'[run]\nkey_file = "{tmp_path / "nope.key_secret"}"', 1))
    assert cli(["validate", str(missing), "--quiet"]) == 2
    assert "nope.key_secret" in capsys.readouterr().err


def test_scenario_output_table_is_bounded() -> None:
    from rollart.config import parse_scenario

    with pytest.raises(rundir.ConfigError, match="output.transcript_rate"):
        parse_scenario(MINIMAL.read_text() + "\n[output]\ntranscript_rate = 2.0\n")
    sc = parse_scenario(MINIMAL.read_text() + "\n[output]\ntranscripts_per_step = 0\n")
    assert msgspec.to_builtins(sc)["output"]["transcripts_per_step"] == 0


def test_wandb_requested_but_not_installed_is_a_config_error(tmp_path: Path, monkeypatch) -> None:
    import sys

    from rollart.config import parse_scenario

    monkeypatch.setitem(sys.modules, "wandb", None)  # an import of it fails, as when absent
    sc = parse_scenario(MINIMAL.read_text() + "\n[output]\nwandb = true\ntensorboard = false\n")
    with pytest.raises(rundir.ConfigError, match="output.wandb"):
        rundir.RunFolder(tmp_path, sc)


def _runnable(text: str) -> str:
    """MINIMAL plus an env host: what ``rollart run``'s preflight asks for."""
    return text + '\n[[env_hosts]]\nname = "envs"\n'


def _run_cli(argv: list[str], monkeypatch) -> int:
    from rollart.launcher import run

    monkeypatch.setattr(run, "tune_gc", lambda: None)  # leave this process's GC as it is
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return cli(["run", *argv])


def test_run_names_file_field_and_value_of_a_model_path_that_is_no_checkpoint(
        tmp_path: Path, capsys, monkeypatch) -> None:
    sc = tmp_path / "remote_model.toml"
    sc.write_text(_runnable(MINIMAL.read_text()) + '\n[model]\npath = "/nonexistent/model"\n')
    assert _run_cli([str(sc), "--out", str(tmp_path / "run")], monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"{sc}: model.path: /nonexistent/model is not a local" in err, err
    assert not (tmp_path / "run" / "logs").exists()  # nothing started


def test_run_and_validate_name_the_file_of_a_key_others_can_read(
        tmp_path: Path, capsys, monkeypatch) -> None:
    from rollart.transport.security import create_key_file

    key = create_key_file(tmp_path / "keys")
    key.chmod(0o644)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # resolve_model checks no more; nothing loads it
    sc = tmp_path / "keyed.toml"
    sc.write_text(_runnable(MINIMAL.read_text()).replace("[run]", f'[run]\nkey_file = "{key}"', 1)
                  + f'\n[model]\npath = "{model}"\n')
    assert cli(["validate", str(sc), "--quiet"]) == 2
    assert f"{sc}: key file {key}" in capsys.readouterr().err
    assert _run_cli([str(sc), "--out", str(tmp_path / "run")], monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"{sc}: key file {key}" in err, err
    assert not (tmp_path / "run" / "logs").exists()


def test_in_file_prefixes_the_file_once() -> None:
    from rollart.config import ConfigError, in_file

    assert str(in_file("a.toml", ConfigError("model.path: x"))) == "a.toml: model.path: x"
    named = ConfigError("a.toml: run.steps: y")
    assert in_file("a.toml", named) is named


def test_a_scenario_benchmark_names_the_file_of_a_bad_model_path(tmp_path: Path, capsys) -> None:
    from benchmarks import modes

    sc = tmp_path / "remote_model.toml"
    sc.write_text(_runnable(MINIMAL.read_text()) + '\n[model]\npath = "/nonexistent/model"\n')
    with pytest.raises(SystemExit) as exited:
        modes.main(["--scenario", str(sc), "--quick", "--cache-dir", str(tmp_path / "cache")])
    assert exited.value.code == 2
    assert f"{sc}: model.path: /nonexistent/model is not a local" in capsys.readouterr().err


def test_run_refuses_an_out_that_is_a_file_before_starting(tmp_path: Path, capsys,
                                                           monkeypatch) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    assert _run_cli([str(MINIMAL), "--out", str(afile)], monkeypatch) == 2
    assert f"--out {afile}: exists and is not a directory" in capsys.readouterr().err
    assert afile.read_text() == "not a folder"


def test_the_resume_hint_keeps_the_runs_options() -> None:
    from rollart.launcher.run import _parse, resume_command

    args = _parse(["my scenario.toml", "--steps", "8", "--cache-dir", "/tmp/c",
                   "--checkpoint-on-interrupt", "--out", "runs/a"])
    assert resume_command(args, Path("runs/a")) == (
        "rollart run 'my scenario.toml' --resume runs/a --steps 8 --cache-dir /tmp/c "
        "--checkpoint-on-interrupt")
    assert resume_command(_parse(["s.toml"]), Path("r")) == "rollart run s.toml --resume r"


def test_throughput_of_a_resumed_runs_first_step_leaves_out_the_carried_tokens() -> None:
    # 300 tokens in the step, 200 of them generated before the resume (not in its 10 s)
    row = {"step_time_s": 10.0, "num_generated_tokens": 300, "carried_generated_tokens": 200,
           "trained_tokens": 250}
    got = step_scalars(row)
    assert got["throughput/generated_tokens_per_s"] == pytest.approx(10.0)
    assert got["throughput/trained_tokens_per_s"] == pytest.approx(25.0)
    assert step_scalars({**row, "carried_generated_tokens": 0})[
        "throughput/generated_tokens_per_s"] == pytest.approx(30.0)
