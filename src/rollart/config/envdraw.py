"""Draw a reasoning-gym domain's first entries with its ``env_options``, in a child process
with a deadline, before anything starts.

Some values pass reasoning-gym's own config check and fail only when an entry is generated (a
fractional count, a data file that is not there), and every session of the run would then
fail; others make generation loop without end (a 1x1 grid asked for two distinct cells). A
session draws its entry when it opens (``rollart.envhost.families.rg_entry``), so the check
draws the same way, on several seeds (some generators fail on a share of seeds only, and the
env host's retries re-draw those), in a child process: a draw that does not end is stopped at
the deadline instead of hanging ``rollart validate``, and what a generator prints cannot reach
validate's stdout (the resolved scenario).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

#: seeds drawn per domain: refused only when every one fails
DRAW_SEEDS = (0, 1, 2, 3, 4)
#: wall seconds the draws of one domain may take, the child's interpreter start included
#: (a bundled dataset draws an entry in microseconds to milliseconds; a session that takes
#: this long to open its entry would stall its trajectory)
DRAW_TIMEOUT_S = 20.0


def draw_problems(domains: Sequence[tuple[str, Mapping[str, Any]]], *,
                  timeout_s: float = DRAW_TIMEOUT_S) -> list[str | None]:
    """Per ``(dataset, options)``: ``None`` when an entry can be drawn with ``options`` on one
    of ``DRAW_SEEDS``, else why not (every seed's draw failed: the first failure; or the draws
    did not end within ``timeout_s`` seconds). The domains draw in parallel, one child
    process each. Options that JSON cannot carry as they are (TOML dates) are not drawn
    (``None``)."""
    procs: list[subprocess.Popen[bytes] | None] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    for dataset, options in domains:
        payload = msgspec.json.encode([dataset, dict(options), list(DRAW_SEEDS)])
        if msgspec.json.decode(payload) != [dataset, dict(options), list(DRAW_SEEDS)]:
            procs.append(None)
            continue
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "rollart.config.envdraw", payload.decode()],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env=env))
    try:
        return _verdicts(domains, procs, timeout_s)
    finally:  # an interrupt, or an error here, leaves no child drawing on
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


def _verdicts(domains: Sequence[tuple[str, Mapping[str, Any]]],
              procs: Sequence[subprocess.Popen[bytes] | None],
              timeout_s: float) -> list[str | None]:
    deadline = time.monotonic() + timeout_s
    out: list[str | None] = []
    for (dataset, options), proc in zip(domains, procs, strict=True):
        if proc is None:
            out.append(None)
            continue
        try:
            # the deadline is shared: a child that ended while an earlier one was awaited is
            # read in full (it has exited: its pipe ends)
            left = None if proc.poll() is not None else max(0.5, deadline - time.monotonic())
            stdout, _ = proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out.append(f"drawing an entry of rg:{dataset} with options {dict(options)} did not "
                       f"finish within {timeout_s:g} s (each session draws one when it opens)")
            continue
        lines = stdout.decode(errors="replace").strip().splitlines()
        try:
            verdict = msgspec.json.decode(lines[-1]) if lines else None
        except msgspec.DecodeError:
            verdict = None
        if not isinstance(verdict, dict) or "problem" not in verdict:
            # the child died without a verdict (killed, out of memory): not the options' fault
            # as far as can be told here; the env host reports what sessions meet
            out.append(None)
            continue
        out.append(verdict["problem"])
    return out


def _draw(dataset: str, options: dict[str, Any], seeds: list[int]) -> str | None:
    from rollart.envhost.families import EnvSpecError, rg_entry

    failures = []
    for seed in seeds:
        try:
            rg_entry(dataset, seed, options)
            return None
        except EnvSpecError as exc:  # the options themselves: no seed will do
            return exc.message
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
    return (f"reasoning-gym cannot draw an entry with options {options} (seeds "
            f"{seeds[0]}-{seeds[-1]} all failed, so every session would fail): {failures[0]}")


def main() -> None:
    """The child: reads ``[dataset, options, seeds]`` (JSON, its one argument), writes
    ``{"problem": str | null}`` as the last line of stdout."""
    dataset, options, seeds = msgspec.json.decode(sys.argv[1])
    # a generator may print (``rg:bf`` does): keep it off the verdict's line
    with contextlib.redirect_stdout(io.StringIO()):
        problem = _draw(dataset, options, seeds)
    sys.stdout.write("\n" + msgspec.json.encode({"problem": problem}).decode() + "\n")


if __name__ == "__main__":
    main()
