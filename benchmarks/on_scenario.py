"""``--scenario FILE``: a comparing benchmark on REAL services instead of the simulator.

``modes``, ``env_tail`` and ``affinity`` take ``--scenario FILE``: each variant they compare
(a mode, an env-latency setting, a pool layout) is the scenario at ``FILE`` changed in one
place, trained through ``rollart.launcher.local.open_cluster`` (its pools of local vLLM
workers or the addresses of running ones, its env hosts and reward service as real
processes), one cluster per variant and seed, never two at once. Step and rollout times are
seconds of wall clock, the mean over the steps after the first (a warm-up: engine compile,
first weight version). Same table and JSON as the simulated run (``"simulated": false``); with
``--seeds`` >= 2 every ratio gets a 95% interval (one seed: none, ``[null, null]``).

    python -m benchmarks.NAME --scenario FILE [--seeds N] [--cache-dir DIR] [--quick]
        [--json OUT] [--seed S] [benchmark's own options]

``--quick`` trains 3 steps per variant (the first is a warm-up), otherwise the scenario's own
``run.steps``; ``--steps N`` (>= 2) sets it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import emit

#: steps per variant with ``--quick`` (the first is left out of every mean)
QUICK_STEPS = 3


def train(scenario: Any, run_dir: Path, cache_dir: Path,
          source: str | None = None) -> list[dict[str, Any]]:
    """Train ``scenario.run.steps`` steps of a validated ``rollart.config.Scenario`` on real
    services; one dict per step (``benchmarks.real_engine.run_mode``'s rows: seconds of wall
    clock, token counts). ``source``: the scenario file a ConfigError about the scenario's
    fields names (e.g. a ``model.path`` that is no checkpoint). Raises what ``open_cluster``
    raises (ConfigError, ProcessFailedError, ...), and SystemExit(143) after stopping the
    cluster on SIGTERM (``rollart.launcher.sigterm``)."""
    from benchmarks.real_engine import run_mode
    from rollart.launcher.sigterm import run_stopping_on_sigterm

    return run_stopping_on_sigterm(run_mode(scenario, run_dir, cache_dir, source))


def mean_after_first(steps: list[dict[str, Any]], key: str) -> float:
    """Mean of ``key`` over ``steps[1:]`` (seconds). Raises ValueError with fewer than two
    steps."""
    if len(steps) < 2:
        raise ValueError(f"need at least 2 steps to leave out the warm-up, got {len(steps)}")
    return statistics.fmean(s[key] for s in steps[1:])


def steps_for(quick: bool, base: Any, args: argparse.Namespace | None) -> int:
    """Steps per variant: ``--steps`` if given, else ``QUICK_STEPS`` with ``--quick``, else
    the scenario's own ``run.steps``."""
    steps = getattr(args, "steps", None)
    return steps if steps is not None else QUICK_STEPS if quick else base.run.steps


def scenario_main(name: str, argv: list[str] | None, simulated: Callable[[list[str]], dict],
                  on_scenario: Callable[..., dict],
                  add_args: Callable[[argparse.ArgumentParser], None] | None = None) -> dict:
    """Entry point of a benchmark with ``--scenario``: without it, ``simulated(rest_argv)``;
    with it, ``on_scenario(path, quick, seed, num_seeds=, cache_dir=, run_dir=, args=)`` in a
    temporary run directory, its result emitted. ``add_args`` adds the benchmark's own
    scenario options (parsed into ``args``). Exits with status 2 on bad arguments and on a
    ``ConfigError`` or ``ValueError`` the benchmark raises about the scenario or its options
    (an unreadable or invalid scenario, a model path that is not a local checkpoint, a layout
    the scenario cannot give), with its message and no traceback."""
    from rollart.config import ConfigError

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--scenario", type=Path, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache/rollart"))
    known, rest = parser.parse_known_args(argv)
    if known.scenario is None:
        if "-h" in rest or "--help" in rest:
            print(f"(real services: `python -m benchmarks.{name} --scenario FILE --help` lists "
                  "--scenario, --seeds, --cache-dir, --steps and this benchmark's own options)")
        # --seeds belongs to the simulated run too (benchmarks.common.parse_args)
        return simulated(rest if known.seeds is None else [*rest, "--seeds", str(known.seeds)])
    if known.seeds is None:
        known.seeds = 1
    if known.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {known.seeds}")
    common = argparse.ArgumentParser(prog=f"python -m benchmarks.{name} --scenario FILE")
    # parsed above; declared again so that --help lists them
    common.add_argument("--scenario", metavar="FILE", help="scenario TOML: pools of local "
                        "workers or addresses of running ones, envs, rewards")
    common.add_argument("--seeds", type=int, metavar="N", help="seeds per variant (default "
                        "1: no interval; each costs one cluster start per variant)")
    common.add_argument("--cache-dir", metavar="DIR", help="model cache (default .cache/rollart)")
    common.add_argument("--quick", action="store_true")
    common.add_argument("--json", type=Path, default=None)
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--steps", type=int, default=None,
                        help="steps per variant, the first a warm-up (default: 3 with --quick, "
                        "else the scenario's run.steps)")
    if add_args is not None:
        add_args(common)
    args = common.parse_args(rest)
    if args.steps is not None and args.steps < 2:
        common.error(f"--steps must be >= 2 (the first is a warm-up), got {args.steps}")
    try:
        with tempfile.TemporaryDirectory(prefix=f"rollart-{name}-") as tmp:
            res = on_scenario(known.scenario, args.quick, args.seed, num_seeds=known.seeds,
                              cache_dir=known.cache_dir, run_dir=Path(tmp), args=args)
    except (ConfigError, ValueError) as exc:
        common.error(str(exc))
    emit(res, args.json)
    return res
