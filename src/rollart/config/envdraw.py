"""Draw a reasoning-gym domain's entries with its ``env_options``, in a child process with
deadlines, before anything starts.

Some values pass reasoning-gym's own config check and fail only when an entry is generated (a
fractional count, a data file that is not there, ``inf``), and every session of the run would
then fail; others make generation loop without end (a 1x1 grid asked for two distinct cells). A
session draws its entry when it opens (``rollart.envhost.families.rg_entry``), so the check
draws the same way, with the options as a session receives them (msgpack, as ``EnvOpen``
carries them), on several seeds (some generators fail on a share of seeds only, and the env
host's retries re-draw those).

The draws run in one child process (reasoning-gym is imported once), each under its own alarm
of ``DRAW_TIMEOUT_S`` seconds of the child's wall clock, so a generator that never ends is
stopped by the child itself, even if the parent is gone; what a generator prints cannot reach
validate's stdout (the resolved scenario). The child imports rollart and the libraries from the
interpreter's own paths and rollart's, never from the working directory or a scenario's
``run.local_module`` folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

#: seeds drawn per domain: refused only when every one fails
DRAW_SEEDS = (0, 1, 2, 3, 4)
#: wall seconds one domain's draws may take in the child (a bundled dataset draws an entry
#: in microseconds to milliseconds; a session that takes this long to open would stall its
#: trajectory)
DRAW_TIMEOUT_S = 10.0
#: wall seconds the child may take besides the draws (its interpreter and reasoning-gym's
#: import: ~2 s alone, more on a loaded machine)
START_TIMEOUT_S = 60.0
#: characters of an option's text a message quotes
QUOTE_CHARS = 200


class _DrawTimeout(BaseException):
    """The alarm: a BaseException, so a generator's own ``except Exception`` cannot swallow
    it."""


def draw_problems(domains: Sequence[tuple[str, Mapping[str, Any]]], *,
                  timeout_s: float = DRAW_TIMEOUT_S) -> list[str | None]:
    """Per ``(dataset, options)``: ``None`` when an entry can be drawn with ``options`` on one
    of ``DRAW_SEEDS``, else why not (every seed's draw failed: the first failure; the draws
    did not end within ``timeout_s`` seconds; or the check itself could not run, with the
    child's last error line). Identical pairs are drawn once."""
    unique = list(dict.fromkeys(msgspec.msgpack.encode([d, dict(o)]) for d, o in domains))
    payload = msgspec.msgpack.encode([unique, list(DRAW_SEEDS), timeout_s])
    root = str(Path(__file__).resolve().parents[2])  # the folder that holds ``rollart``
    # rollart's folder and the user's own PYTHONPATH, not this process's sys.path (which
    # holds a run.local_module's folder first)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH", "")) if p)}
    # -P: no working directory on the child's path (3.11+)
    cmd = [sys.executable, "-P", "-m", "rollart.config.envdraw"]
    limit = START_TIMEOUT_S + timeout_s * len(unique)
    proc: subprocess.Popen[bytes] | None = None
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)
        out, err = proc.communicate(payload, timeout=limit)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        problem = (f"the draw check did not finish within {limit:g} s (each domain's draws "
                   f"are limited to {timeout_s:g} s)")
        return [problem for _ in domains]
    finally:  # an interrupt, or an error here, leaves no child drawing on
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    verdicts = _verdicts(out)
    if verdicts is None or len(verdicts) != len(unique):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        problem = (f"the draw check could not run (its process exited with code "
                   f"{code}: {one_line(tail[0])})")
        return [problem for _ in domains]
    by_key = dict(zip(unique, verdicts, strict=True))
    return [by_key[msgspec.msgpack.encode([d, dict(o)])] for d, o in domains]


def _verdicts(out: bytes) -> list[str | None] | None:
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        got = msgspec.json.decode(lines[-1]) if lines else None
    except msgspec.DecodeError:
        return None
    return got if isinstance(got, list) else None


def one_line(text: str) -> str:
    """``text`` on one line, at most ``QUOTE_CHARS`` characters."""
    one = text.replace("\r", "\\r").replace("\n", "\\n")
    return one if len(one) <= QUOTE_CHARS else one[:QUOTE_CHARS] + "..."


def _draw(dataset: str, options: dict[str, Any], seeds: list[int], timeout_s: float
          ) -> str | None:
    from rollart.envhost.families import EnvSpecError, rg_entry

    def fire(signum: int, frame: Any) -> None:
        raise _DrawTimeout

    shown = one_line(repr(options))
    failures = []
    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        for seed in seeds:
            try:
                rg_entry(dataset, seed, options)
                return None
            except EnvSpecError as exc:  # the options themselves: no seed will do
                return one_line(exc.message)
            except (Exception, SystemExit) as exc:
                failures.append(one_line(f"{type(exc).__name__}: {exc}"))
    except _DrawTimeout:
        return (f"drawing an entry of rg:{dataset} with options {shown} did not finish "
                f"within {timeout_s:g} s (each session draws one when it opens)")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return (f"reasoning-gym cannot draw an entry with options {shown} (seeds "
            f"{seeds[0]}-{seeds[-1]} all failed, so every session would fail): {failures[0]}")


def main() -> None:
    """The child: reads ``[[msgpack([dataset, options]), ...], seeds, timeout_s]`` (msgpack)
    on stdin, writes the list of problems (``str | null`` each, JSON) as the last line of
    stdout."""
    pairs, seeds, timeout_s = msgspec.msgpack.decode(sys.stdin.buffer.read())
    # imported before any alarm: an alarm inside the first import would leave it half done
    # (and reasoning-gym's import alone takes seconds on a loaded machine)
    import reasoning_gym  # noqa: F401

    import rollart.envhost.families  # noqa: F401

    problems = []
    # a generator may print (``rg:bf`` does): keep it off the verdict's line
    with contextlib.redirect_stdout(io.StringIO()):
        for raw in pairs:
            dataset, options = msgspec.msgpack.decode(raw)
            problems.append(_draw(dataset, options, seeds, timeout_s))
    sys.stdout.write("\n" + msgspec.json.encode(problems).decode() + "\n")
    sys.stdout.flush()
    os._exit(0)  # nothing after the verdict (a generator's threads or exit handlers)


if __name__ == "__main__":
    main()
