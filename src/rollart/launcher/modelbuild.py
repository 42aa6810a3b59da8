"""The policy checkpoint of a run, prepared off the event loop.

Building the embedded tiny model (``model.path = "tiny"``) runs its supervised warm-up the
first time (``model.tiny_warmup``: minutes on a CPU; without it, seconds; cached after). Run
on the event loop, it would leave the loop deaf to SIGTERM / Ctrl-C and the user without a
line of progress for that long. So it runs in a child
process (``python -m rollart.launcher.modelbuild``, the scenario on its stdin as JSON: a fresh
interpreter, so a driver script needs no ``__main__`` guard) that the caller awaits: a cancelled
wait (a signal, the end of a driver script) terminates the child, and a progress note is given
every ``note_every_s`` seconds: what the child last reported (a cache miss, the warm-up's
optimizer step out of its total and loss, from ``rollart.models``' INFO records, written to a
progress file) and, once the warm-up has taken steps, an estimate of the time left; a last
note says when it is ready, how long it took and whether it came from the cache. A local
checkpoint directory is only checked for its ``config.json``, on the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import msgspec

from rollart.config import Scenario, in_file
from rollart.transport.errors import ConfigError

#: seconds between two "still preparing" notes
NOTE_EVERY_S = 30.0


class _Job(msgspec.Struct, frozen=True):
    scenario: Scenario
    source: str
    cache_dir: str
    resume: bool
    result: str
    #: where the child writes its newest progress (``ProgressFile``)
    progress: str = ""


class _Result(msgspec.Struct, frozen=True):
    kind: str  # "ok" (value: the path), "error" (a ConfigError's message), "crash" (traceback)
    value: str
    #: "ok" only: the checkpoint was in the cache before the child started (not built)
    cached: bool = False


class ProgressFile(logging.Handler):
    """Keeps ``path`` holding the newest INFO record of ``rollart.models`` as JSON:
    ``message``, and for the warm-up's records (``record.progress = (step, total)``)
    ``step``, ``total`` and ``eta_s`` (seconds left at the rate since its first record)."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.INFO)
        self.path = path
        self._first: tuple[float, int] | None = None  # (time, step) of the first step record

    def emit(self, record: logging.LogRecord) -> None:
        out: dict[str, object] = {"message": record.getMessage()}
        progress = getattr(record, "progress", None)
        if progress is not None:
            step, total = progress
            now = time.monotonic()
            if self._first is None:
                self._first = (now, step)
            t0, s0 = self._first
            out.update(step=step, total=total)
            if step > s0:
                out["eta_s"] = (now - t0) / (step - s0) * (total - step)
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(out))
            os.replace(tmp, self.path)  # the parent never reads half a file
        except OSError:  # progress is a courtesy: never a reason for the build to fail
            pass


def progress_note(path: Path, elapsed_s: float) -> str:
    """The "still preparing" line: elapsed seconds and what the child last reported
    (``ProgressFile``), if anything yet."""
    text = f"still preparing the tiny model ({elapsed_s:.0f} s)"
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return text
    if not isinstance(got, dict) or not isinstance(got.get("message"), str):
        return text
    text += f": {got['message']}"
    eta = got.get("eta_s")
    if isinstance(eta, int | float):
        text += f"; about {eta / 60:.0f} min left" if eta >= 90 else f"; about {eta:.0f} s left"
    return text


def ready_note(scenario: Scenario, path: Path, elapsed_s: float, *, cached: bool) -> str:
    """The line said when the tiny model's preparation ends: how long it took (s), whether
    it came from the cache or was built (and warmed up), and where it is."""
    if cached:
        how = "from the cache"
    else:
        how = ("built and warmed up" if scenario.model.tiny_warmup else "built") + ", now cached"
    return f"tiny model ready after {elapsed_s:.0f} s ({how}): {path}"


def main() -> int:
    """Child process: read a `_Job` from stdin, resolve the model, write a `_Result`."""
    from rollart.launcher.local import resolve_model

    job = msgspec.json.decode(sys.stdin.buffer.read(), type=_Job)
    if job.progress:
        models = logging.getLogger("rollart.models")
        models.setLevel(logging.INFO)
        models.addHandler(ProgressFile(Path(job.progress)))
    cache = Path(job.cache_dir)
    # The cache entry's name is known only once the demonstrations that key it are played:
    # what was there before tells a cache hit from a build.
    try:
        before = {p.name for p in cache.glob("tiny-*")}
    except OSError:  # an unreadable cache: the build says why; the note only errs on "built"
        before = set()
    try:
        path = resolve_model(job.scenario, cache, resume=job.resume)
        out = _Result("ok", str(path), cached=path.name in before)
    except ConfigError as exc:
        out = _Result("error", str(in_file(job.source, exc)))
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        out = _Result("crash", traceback.format_exc())
    Path(job.result).write_bytes(msgspec.json.encode(out))
    return 0


def preparing_note(scenario: Scenario, cache_dir: Path) -> str:
    """The line said when the tiny model's preparation starts (whether the cache holds it is
    known only once the child has played the demonstrations that key it): what a first run
    costs, which depends on ``model.tiny_warmup`` (a supervised warm-up takes minutes on a
    CPU; without it the model is only built from its seed, in seconds)."""
    if scenario.model.tiny_warmup:
        cost = "from the cache if built before, else a first run warms it up: minutes"
    else:
        cost = "tiny_warmup = false: built without a warm-up, seconds; cached after"
    return f"preparing the tiny model under {cache_dir} ({cost})"


async def prepare_model(scenario: Scenario, source: str, cache_dir: Path, *, resume: bool,
                        note: Callable[[str], None],
                        note_every_s: float = NOTE_EVERY_S) -> Path:
    """The checkpoint directory the services load (`rollart.launcher.local.resolve_model`),
    the tiny model built in a child process.

    Raises:
        ConfigError: about ``model.*`` (naming ``source``), or the child ended without a result.
        RuntimeError: the build raised something else (its traceback in the message).
        asyncio.CancelledError: the wait was cancelled; the child is terminated first.
    """
    from rollart.launcher.local import resolve_model

    if scenario.model.path != "tiny":
        try:
            return resolve_model(scenario, cache_dir, resume=resume)
        except ConfigError as exc:
            raise in_file(source, exc) from None
    with tempfile.TemporaryDirectory(prefix="rollart-model-") as tmp:
        result = Path(tmp) / "result.json"
        progress = Path(tmp) / "progress.json"
        job = _Job(scenario, source, str(cache_dir), resume, str(result), str(progress))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollart.launcher.modelbuild", stdin=asyncio.subprocess.PIPE)
        t0 = time.monotonic()
        note(preparing_note(scenario, cache_dir))
        try:
            assert proc.stdin is not None
            proc.stdin.write(msgspec.json.encode(job))
            await proc.stdin.drain()
            proc.stdin.close()
            ended = asyncio.ensure_future(proc.wait())
            while True:
                done, _ = await asyncio.wait({ended}, timeout=note_every_s)
                if done:
                    break
                note(progress_note(progress, time.monotonic() - t0))
        except BaseException:
            if proc.returncode is None:
                proc.terminate()
                await asyncio.shield(proc.wait())
            raise
        if not result.exists():
            raise ConfigError(f"{source}: model: the process preparing the tiny model ended "
                              f"without a result (exit code {proc.returncode})")
        out = msgspec.json.decode(result.read_bytes(), type=_Result)
    if out.kind == "ok":
        # after the "still preparing" lines, the one that says they are over
        note(ready_note(scenario, Path(out.value), time.monotonic() - t0, cached=out.cached))
        return Path(out.value)
    if out.kind == "error":
        raise ConfigError(out.value)
    raise RuntimeError(f"preparing the tiny model failed:\n{out.value}")


if __name__ == "__main__":
    sys.exit(main())
