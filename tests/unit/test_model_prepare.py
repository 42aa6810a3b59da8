"""The run's model is prepared off the event loop: a signal can stop a long warm-up."""

from __future__ import annotations

import asyncio
import os
import subprocess

import pytest

from rollart.config import parse_scenario
from rollart.launcher.local import resolve_model
from rollart.launcher.modelbuild import prepare_model
from rollart.transport.errors import ConfigError

GUESS = ('[[pools]]\nname = "p"\n[[domains]]\nname = "g"\nenv = "game:GuessTheNumber-v0-easy"\n'
         'pool = "p"\nreward = "env_success"\n[[env_hosts]]\nname = "e"\n')


def _builders() -> list[str]:
    # This process's own model builders only: another test run on the machine has its own.
    out = subprocess.run(["ps", "-eo", "ppid=,args="], capture_output=True, text=True,
                         check=True)
    return [line for line in out.stdout.splitlines()
            if "rollart.launcher.modelbuild" in line and line.split()[0] == str(os.getpid())]


async def test_the_tiny_model_is_built_in_a_child_and_is_the_one_resolve_model_gives(tmp_path):
    sc = parse_scenario(GUESS + "[model]\ntiny_warmup = false\n", "s.toml")
    notes: list[str] = []
    got = await prepare_model(sc, "s.toml", tmp_path, resume=False, note=notes.append)
    assert got == resolve_model(sc, tmp_path) and (got / "config.json").exists()
    assert notes and "preparing the tiny model" in notes[0] and not _builders()
    # no warm-up: the note says what happens (a build, seconds), not a warm-up of minutes
    assert "warms it up" not in notes[0] and "tiny_warmup = false" in notes[0]
    assert "seconds" in notes[0]
    # the last note says the preparation is over, how long it took, and that it was built
    assert notes[-1].startswith("tiny model ready after ") and " s (built, now cached): " \
        in notes[-1] and notes[-1].endswith(str(got))
    again: list[str] = []
    assert await prepare_model(sc, "s.toml", tmp_path, resume=False, note=again.append) == got
    assert again[-1].startswith("tiny model ready after ")
    assert f" s (from the cache): {got}" in again[-1]


async def test_cancelling_the_wait_stops_a_long_warm_up(tmp_path):
    # 100000 demonstration games take minutes to play before any training starts
    sc = parse_scenario(GUESS + "[model]\ntiny_warmup_episodes = 100000\n", "s.toml")
    first_note = asyncio.Event()
    notes: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        first_note.set()

    task = asyncio.create_task(prepare_model(sc, "s.toml", tmp_path, resume=False, note=note,
                                             note_every_s=0.5))
    await first_note.wait()
    assert _builders()
    assert "a first run warms it up: minutes" in notes[0]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not _builders()
    assert not any(tmp_path.glob("tiny-*/config.json"))


async def test_a_local_path_without_a_checkpoint_is_refused_naming_the_file(tmp_path):
    sc = parse_scenario(GUESS + f'[model]\npath = "{tmp_path}"\n', "s.toml")
    with pytest.raises(ConfigError, match=r"^s\.toml: model\.path: .*no config\.json"):
        await prepare_model(sc, "s.toml", tmp_path, resume=False, note=print)


def test_the_waiting_note_says_the_warm_ups_step_and_the_time_left(tmp_path, monkeypatch):
    import logging
    import time

    from rollart.launcher.modelbuild import ProgressFile, progress_note

    path = tmp_path / "progress.json"
    assert progress_note(path, 31.4) == "still preparing the tiny model (31 s)"  # none yet
    clock = iter([100.0, 130.0, 160.0])
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    handler = ProgressFile(path)
    log = logging.getLogger("rollart.models.test")

    def emit(msg: str, **extra) -> None:
        handler.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, msg, (), None,
                                      extra=extra or None))

    emit("not cached: building tiny-abc and warming it up on 900 demonstrations")
    assert progress_note(path, 12) == ("still preparing the tiny model (12 s): not cached: "
                                       "building tiny-abc and warming it up on 900 "
                                       "demonstrations")
    emit("warm-up step 10/100, loss 2.000", progress=(10, 100))  # at 100 s: no rate yet
    assert progress_note(path, 40).endswith("warm-up step 10/100, loss 2.000")
    emit("warm-up step 20/100, loss 1.500", progress=(20, 100))  # 10 steps in 30 s
    assert progress_note(path, 70) == ("still preparing the tiny model (70 s): warm-up step "
                                       "20/100, loss 1.500; about 4 min left")  # 80 * 3 s
    emit("warm-up step 99/100, loss 0.500", progress=(99, 100))  # 89 steps in 60 s
    assert progress_note(path, 100).endswith("; about 1 s left")
    path.write_text("{half")  # never half a file in practice; still no crash
    assert progress_note(path, 5) == "still preparing the tiny model (5 s)"
    # a progress file that cannot be written never fails the build
    gone = ProgressFile(tmp_path / "no" / "such" / "dir" / "progress.json")
    gone.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, "x", (), None))
