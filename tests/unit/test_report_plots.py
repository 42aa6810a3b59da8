"""``rollart report`` on a synthetic ``metrics.jsonl`` (field names of the controller's
``StepMetrics``): the rolling mean over noisy series, the training-series plots (a series the
run did not record is skipped with one line), and dict-valued summary fields as HTML tables."""

from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

from rollart.controller.observe.metrics import StepMetrics
from rollart.launcher import report
from rollart.launcher.report import PLOTS, SERIES_PLOTS, rolling_mean

REWARD_A = [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def _row(step: int, *, kl: bool = True) -> dict[str, Any]:
    train = {"loss": 0.5 / step, "pg_loss": 0.4 / step, "grad_norm": 1.0 + step % 2}
    if kl:
        train["kl"] = 0.01 * step
    return {
        "step": step, "mode": "rollart", "policy_version": step,
        "reward_mean": 0.5 * REWARD_A[step - 1] + 0.25,
        "reward_mean_by_domain": {"a": REWARD_A[step - 1], "b": 0.5},
        "num_samples": 8, "step_time_s": 2.0, "rollout_time_s": 1.0, "train_time_s": 0.5,
        "weight_sync_total_s": 0.1, "weight_sync_exposed_s": 0.1, "trainer_idle_s": 0.2,
        "staleness_max": 1, "staleness_mean": 0.5, "num_generated_tokens": 400,
        "wasted_tokens": 40, "wasted_tokens_by_reason": {"redundancy": 30, "aborted": 10},
        "buffer_generated_tokens": 400, "trained_tokens": 300, "train_metrics": train,
        "groups_by_domain": {"a": 2, "b": 2}, "flat_groups_by_domain": {"a": 1, "b": 0},
        "by_domain": {"a": {"trained": 4}, "b": {"trained": 4}},
        "response_len_mean_by_domain": {"a": 10.0 + step, "b": 20.0},
        "entropy_mean": 0.3 - 0.01 * step, "entropy_by_domain": {"a": 0.2, "b": 0.4},
    }


def _run_dir(tmp_path: Path, *, kl: bool = True) -> Path:
    rows = [_row(i, kl=kl) for i in range(1, len(REWARD_A) + 1)]
    assert set(rows[0]) <= set(StepMetrics.__struct_fields__)  # the controller's names
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"steps": 6, "mode": "rollart", "wasted_share": 0.1,
               "wasted_tokens_by_reason": {"redundancy": 180, "aborted": 60},
               "domains": {"a": {"reward_first10_mean": 0.5, "wasted_tokens": {"aborted": 7}}},
               "eval": {"a": {"first": 0.25, "last": 0.5, "last_ci95": [0.4, 0.6]}}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_rolling_mean_is_the_trailing_mean_of_the_window() -> None:
    assert rolling_mean([1.0, 2.0, 3.0, 4.0, 10.0], 3) == pytest.approx(
        [1.0, 1.5, 2.0, 3.0, 17 / 3])
    assert rolling_mean([1.0, 5.0], 1) == [1.0, 5.0]
    assert rolling_mean([], 4) == []
    with pytest.raises(ValueError, match="window must be >= 1"):
        rolling_mean([1.0], 0)


def _drawn_lines(monkeypatch) -> dict[str, list]:
    """Plot file name -> ``(label, y values)`` of each line the report saves in it."""
    drawn: dict[str, list] = {}
    save = report._save

    def keep(fig, path):
        drawn[path.name] = [(ln.get_label(), list(ln.get_ydata())) for ln in fig.axes[0].lines]
        save(fig, path)

    monkeypatch.setattr(report, "_save", keep)
    return drawn


def test_the_reward_plot_draws_the_rolling_mean_over_the_raw_line(tmp_path, monkeypatch) -> None:
    drawn = _drawn_lines(monkeypatch)
    run = _run_dir(tmp_path)
    assert report.main([str(run), "--smooth", "3"]) == 0
    lines = dict(drawn["reward.png"])
    # 0,1,0,1,1,0 -> trailing means of up to 3: 0, 1/2, 1/3, 2/3, 2/3, 2/3
    assert lines["a (mean of 3)"] == pytest.approx([0, 1 / 2, 1 / 3, 2 / 3, 2 / 3, 2 / 3])
    raw = [y for label, y in drawn["reward.png"] if label.startswith("_")]  # unlabelled, faint
    assert REWARD_A in raw
    loss = dict(drawn["loss.png"])["all (mean of 3)"]
    assert loss == pytest.approx(rolling_mean([0.5 / s for s in range(1, 7)], 3))

    drawn.clear()
    assert report.main([str(run), "--smooth", "1", "--out", str(tmp_path / "raw")]) == 0
    assert dict(drawn["reward.png"])["a"] == REWARD_A  # no smoothing: the raw line only


def test_every_plot_is_written_and_in_the_page(tmp_path) -> None:
    from matplotlib.image import imread

    run = _run_dir(tmp_path)
    assert report.main([str(run)]) == 0
    out = run / "report"
    page = (out / "index.html").read_text()
    srcs = re.findall(r'<img src="([^"]+)"', page)
    assert sorted(srcs) == sorted([*PLOTS, *SERIES_PLOTS])
    for name in srcs:
        img = imread(out / name)
        assert img.ndim == 3 and img.std() > 0.01, f"{name} is blank"
    for title, *_ in SERIES_PLOTS.values():
        assert f"<h2>{title}</h2>" in page


def test_a_series_the_run_did_not_record_is_skipped_with_one_line(tmp_path, capsys) -> None:
    run = _run_dir(tmp_path, kl=False)
    assert report.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert [x for x in out.splitlines() if "skipped" in x] == [
        "rollart report: kl.png skipped: metrics.jsonl has no train/kl series"]
    assert not (run / "report" / "kl.png").exists()
    page = (run / "report" / "index.html").read_text()
    assert 'src="kl.png"' not in page and 'src="grad_norm.png"' in page


def test_dict_valued_fields_are_tables_not_dict_text(tmp_path) -> None:
    run = _run_dir(tmp_path)
    assert report.main([str(run)]) == 0
    page = (run / "report" / "index.html").read_text()
    assert "{'" not in page and "{&#x27;" not in page and "[0.4" not in page
    # summary.json's waste by reason: a nested key / value table in the run summary
    assert re.search(r"<th>wasted_tokens_by_reason</th><td><table[^>]*><tr><th>redundancy"
                     r"</th><td>180</td></tr><tr><th>aborted</th><td>60</td>", page)
    # a dict inside the per-domain table, a list in the eval table
    assert "<table border=1 cellpadding=3><tr><th>aborted</th><td>7</td>" in page
    assert "<td>0.400, 0.600</td>" in page


def test_smooth_below_one_is_refused(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        report.main([str(_run_dir(tmp_path)), "--smooth", "0"])
    assert exc.value.code == 2 and "--smooth: must be >= 1" in capsys.readouterr().err


def _affinity_run_dir(tmp_path: Path) -> Path:
    """Six steps: domain a spills to pool B at step 2 (and to C at step 3 after a return),
    returns at steps 3 and 5."""
    run = _run_dir(tmp_path)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    spilled = [0, 3, 2, 4, 1, 0]
    spills = {2: {"B": 1}, 3: {"C": 1}}
    returns = {3: 1, 5: 1}
    moves = {2: ["a: A -> B (pool 'A' saturated)"],
             3: ["a: B -> A (pool 'A' has room again)", "a: A -> C (pool 'A' saturated)"],
             5: ["a: C -> A (pool 'A' has room again)"]}
    for r in rows:
        st = r["step"]
        r["num_spilled_by_domain"] = {"a": spilled[st - 1]} if spilled[st - 1] else {}
        r["affinity_moves"] = moves.get(st, [])
        r["affinity_spills_by_domain"] = {"a": spills[st]} if st in spills else {}
        r["affinity_returns_by_domain"] = {"a": returns[st]} if st in returns else {}
    assert set(rows[0]) <= set(StepMetrics.__struct_fields__)  # the controller's names
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_online_affinity_moves_are_drawn_per_domain_and_listed(tmp_path, monkeypatch) -> None:
    from matplotlib.image import imread

    drawn: dict[str, list] = {}
    notes: dict[str, list[str]] = {}
    save = report._save

    def keep(fig, path):
        ax = fig.axes[0]
        drawn[path.name] = [(ln.get_label(), list(ln.get_xdata()), list(ln.get_ydata()))
                            for ln in ax.lines]
        notes[path.name] = [t.get_text() for t in ax.texts]
        save(fig, path)

    monkeypatch.setattr(report, "_save", keep)
    run = _affinity_run_dir(tmp_path)
    assert report.main([str(run)]) == 0
    name, title = report.AFFINITY_PLOT
    lines = {label: (x, y) for label, x, y in drawn[name]}
    assert lines["a: spilled trajectories"] == ([1, 2, 3, 4, 5, 6], [0, 3, 2, 4, 1, 0])
    # a spill marker on the line at each step with spills, a return marker at each return
    assert lines["a: spilled"] == ([2, 3], [3, 2])
    assert lines["a: returned"] == ([3, 5], [2, 1])
    assert sorted(notes[name]) == ["-> B x1", "-> C x1"]
    out = run / "report"
    img = imread(out / name)
    assert img.ndim == 3 and img.std() > 0.01
    page = (out / "index.html").read_text()
    assert f'<img src="{name}"' in page and f"<h2>{html.escape(title)}</h2>" in page
    # every decision listed with its step
    assert "<h2>Online affinity moves</h2>" in page
    assert "<td>3</td><td>a: A -&gt; C (pool &#x27;A&#x27; saturated)</td>" in page
    assert page.count("<td>a: ") == 4


def test_first_turns_held_for_kv_room_are_drawn_without_any_move(tmp_path, monkeypatch) -> None:
    drawn = _drawn_lines(monkeypatch)
    run = _run_dir(tmp_path)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for i, r in enumerate(rows):
        r["num_kv_admission_waits"] = [0, 5, 2, 0, 0, 1][i]
    assert set(rows[0]) <= set(StepMetrics.__struct_fields__)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main([str(run)]) == 0
    assert drawn[report.AFFINITY_PLOT[0]] == [
        ("first turns held for KV room (all pools)", [0, 5, 2, 0, 0, 1])]


def test_a_run_without_affinity_moves_has_no_affinity_plot(tmp_path) -> None:
    run = _run_dir(tmp_path)
    rows = [{**json.loads(x), "affinity_moves": [], "num_spilled_by_domain": {},
             "affinity_spills_by_domain": {}, "affinity_returns_by_domain": {}}
            for x in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert report.main([str(run)]) == 0
    assert not (run / "report" / report.AFFINITY_PLOT[0]).exists()
    assert "Online affinity" not in (run / "report" / "index.html").read_text()


def test_report_refuses_a_metrics_file_that_is_not_records_naming_the_file(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("[1, 2]\n")
    assert report.main([str(run)]) == 2
    assert "metrics.jsonl: line 1 is a JSON list, not an object" in capsys.readouterr().err
    (run / "metrics.jsonl").write_bytes(b'{"step": 1}\n\xff\xfe\n')
    assert report.main([str(run)]) == 2
    assert "metrics.jsonl: not UTF-8 text" in capsys.readouterr().err


def test_report_names_a_missing_run_folder_and_an_out_that_is_a_file(tmp_path, capsys):
    assert report.main([str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'nope'} does not exist" in err and "metrics.jsonl:" not in err
    (tmp_path / "plain").write_text("x")
    assert report.main([str(tmp_path / "plain")]) == 2
    assert f"{tmp_path / 'plain'} is not a folder" in capsys.readouterr().err
    run = _run_dir(tmp_path)
    assert report.main([str(run), "--out", str(tmp_path / "plain")]) == 2
    assert f"--out {tmp_path / 'plain'} is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "plain").read_text() == "x"


def test_eval_plot_draws_sampled_pass_at_1_with_its_interval_and_the_page_names_the_headline(
        tmp_path, monkeypatch) -> None:
    res = {"accuracy": 0.5, "ci95": [0.45, 0.55], "pass_at_1": 0.4, "pass_at_1_ci95": [0.35, 0.45],
           "pass_at_k": 0.4, "pass_k": 1, "majority_baseline": 0.3}
    rows = [{"step": s, "eval": [{"at_step": s, "domains": {"g": res}}]} for s in (0, 5)]
    saved: dict[str, list[str]] = {}

    def keep(fig, path) -> None:
        saved[path.name] = fig.axes[0].get_legend_handles_labels()[1]

    monkeypatch.setattr(report, "_save", keep)
    report.write_eval_plots(rows, tmp_path)
    labels = saved["eval_g.png"]
    assert {"greedy accuracy", "greedy 95% interval", "sampled pass@1",
            "sampled 95% interval"} <= set(labels)
    assert not any(lab.startswith("pass@") for lab in labels)  # pass@1 is drawn once
    run = _run_dir(tmp_path)
    (run / "summary.json").write_text(json.dumps({"eval": {"g": {
        "headline": "sampled", "first": 0.4, "last": 0.4}}}))
    (tmp_path / "out").mkdir()
    page = report.write_html(run, tmp_path / "out", [{"step": 1, "mode": "rollart"}])
    assert "Held-out evaluation (sampled pass@1)" in page.read_text()
