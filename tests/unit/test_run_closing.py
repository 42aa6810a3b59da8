"""What `rollart run` says around its steps: the closing block, the ETA of each step line, and
the services as they start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from test_launcher_progress import metrics, scenario

from rollart.launcher.progress import Progress, StartProgress, duration, summary_block

SUMMARY = {
    "steps": 12, "mode": "rollart", "alpha": 1, "wall_time_s": 205.4,
    "generated_tokens": 1000, "wasted_share": 0.2,
    "wasted_share_by_reason": {"redundancy": 0.05, "stale": 0.15},
    "domains": {
        "arith": {"reward_first10_mean": 0.125, "reward_last10_mean": 0.5, "trained": 40},
        "guess": {"reward_first10_mean": 0.0, "reward_last10_mean": 0.25},
    },
    "eval": {"arith": {"first": 0.2, "last": 0.45, "last_ci95": [0.4, 0.5],
                       "majority_baseline": 0.1, "collapse": None}},
}


def test_the_closing_block_says_what_the_run_did_and_where_it_is() -> None:
    run = Path("runs/demo")
    lines = summary_block(SUMMARY, run, checkpoint=run / "checkpoints" / "step_000012",
                          resume="rollart run s.toml --resume runs/demo --steps N")
    assert lines == [
        "steps       12 in 3m25s (mode rollart, alpha 1)",
        "reward      (mean of the first -> last 10 steps) arith: 0.125 -> 0.500",
        "            guess: 0.000 -> 0.250",
        "eval        arith: 0.200 -> 0.450, 95% CI [0.400, 0.500] (majority baseline 0.100)",
        "waste       20% of 1000 generated tokens: stale 15%, redundancy 5%",
        "run folder  runs/demo  (metrics.jsonl, summary.json, logs/)",
        "checkpoint  runs/demo/checkpoints/step_000012",
        "report      rollart report runs/demo  (writes runs/demo/report/index.html)",
        "continue    rollart run s.toml --resume runs/demo --steps N  (N: the new total of "
        "steps)",
    ]


def test_a_run_that_never_stepped_still_says_where_its_folder_is() -> None:
    lines = summary_block({"steps": 0, "mode": "sync", "alpha": 0, "wall_time_s": 3.0,
                           "domains": {}, "eval": {}}, Path("r"), checkpoint=None, resume=None)
    assert lines[0] == "steps       0 in 3s (mode sync, alpha 0)"
    assert "checkpoint  none" in lines and not any(x.startswith("continue") for x in lines)
    assert not any(x.startswith(("reward", "eval", "waste")) for x in lines)


def test_rollart_run_ends_on_the_block(tmp_path, capsys) -> None:
    import argparse

    from rollart.launcher.run import print_closing

    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000002" / "COMPLETE").touch()
    (tmp_path / "checkpoints" / "latest").write_text("step_000002")
    args = argparse.Namespace(scenario=Path("s.toml"), steps=2, cache_dir=None, key_file=None,
                              cluster="local", insecure=False, checkpoint_on_interrupt=False)
    print_closing(SUMMARY, tmp_path, args)
    out = capsys.readouterr().out.rstrip().splitlines()
    assert "run summary" in out[0]
    assert out[-1] == (f"continue    rollart run s.toml --resume {tmp_path} --steps N  (N: the "
                       "new total of steps)")
    assert f"checkpoint  {tmp_path / 'checkpoints' / 'step_000002'}" in out


def test_each_step_line_has_an_eta(capsys) -> None:
    progress = Progress(scenario(), 4)
    for step, dt in ((1, 10.0), (2, 30.0)):
        progress.step(step, msgspec.structs.replace(metrics(step, None), step_time_s=dt))
    words = capsys.readouterr().out.split()
    assert "eta=30s" in words  # 3 steps left at 10 s
    assert "eta=40s" in words  # 2 left at (10 + 30) / 2
    assert duration(3725) == "1h02m" and duration(59.6) == "1m00s"


async def test_start_progress_names_each_ready_service_and_the_late_ones() -> None:
    notes: list[str] = []
    gate, late = asyncio.Event(), asyncio.Event()

    def note(text: str) -> None:
        notes.append(text)
        if "still starting" in text:
            late.set()

    class FakeSupervisor:
        async def start(self, name: str, argv: list[str], **kwargs) -> str:
            if name == "trainer":
                await gate.wait()
            return f"tcp://{name}"

    sup = FakeSupervisor()
    async with StartProgress(sup, note, every_s=0.01) as sp:
        assert await sup.start("reward", []) == "tcp://reward"
        trainer = asyncio.create_task(sup.start("trainer", []))
        await asyncio.wait_for(late.wait(), 120)  # the ticker's note, however loaded
        gate.set()
        assert await trainer == "tcp://trainer"
    assert notes[0].startswith("  reward ready (")
    assert any(n.startswith("  still starting (") and n.endswith("s): trainer") for n in notes)
    assert notes[-1].startswith("  trainer ready (") and sp.pending == {}


def test_the_closing_block_names_a_collapse_by_its_reasons() -> None:
    summary = {**SUMMARY, "eval": {"letters": {
        "first": 0.58, "last": 0.58, "last_ci95": [0.531, 0.627], "majority_baseline": 0.58,
        "collapse": {"reason": "few_distinct_answers",
                     "reasons": ["few_distinct_answers", "at_or_below_baseline"],
                     "top_answer": "1", "top_answer_share": 1.0}}}}
    lines = summary_block(summary, Path("runs/demo"), checkpoint=None, resume="r")
    assert ("eval        letters: 0.580 -> 0.580, 95% CI [0.531, 0.627] (majority baseline "
            "0.580); COLLAPSE: few_distinct_answers, at_or_below_baseline") in lines


def test_a_checkpoint_behind_the_last_step_says_which_steps_a_resume_runs_again() -> None:
    # A plain Ctrl-C after step 71 with checkpoints every 20 steps: the trainer rolls back.
    run = Path("runs/demo")
    summary = {**SUMMARY, "steps": 71}
    lines = summary_block(summary, run, checkpoint=run / "checkpoints" / "step_000040",
                          resume="r")
    at = lines.index("checkpoint  runs/demo/checkpoints/step_000040")
    assert lines[at + 1] == ("            a resume goes on from the end of step 40: steps "
                             "41-71 run again")
    one = summary_block({**SUMMARY, "steps": 41}, run,
                        checkpoint=run / "checkpoints" / "step_000040", resume="r")
    assert "            a resume goes on from the end of step 40: step 41 runs again" in one
    # a checkpoint at the last step: nothing runs again, nothing said
    done = summary_block(SUMMARY, run, checkpoint=run / "checkpoints" / "step_000012",
                         resume="r")
    assert not any("again" in x or "cannot be resumed" in x for x in done)
    # interrupted before the first checkpoint: nothing to resume from, and it says so
    none = summary_block({**SUMMARY, "steps": 2}, run, checkpoint=None, resume=None)
    at = lines.index("checkpoint  runs/demo/checkpoints/step_000040")
    assert ("            no checkpoint was written (trainer.checkpoint_every): this run cannot "
            "be resumed") in none


def test_the_header_counts_one_step_in_the_singular(capsys) -> None:
    from rollart.launcher.progress import plural

    assert plural(1, "step") == "1 step" and plural(2, "step") == "2 steps"
    assert plural(0, "step") == "0 steps"
    Progress(scenario(), 1)
    header = capsys.readouterr().out
    assert "· 1 step " in header and "1 steps" not in header
    Progress(scenario(), 3)
    assert "· 3 steps " in capsys.readouterr().out
