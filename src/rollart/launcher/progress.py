"""Terminal progress of ``rollart run`` (rich): one line per step with the numbers that matter."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rollart.config import Scenario
from rollart.trainer.checkpoint import checkpoint_step


class Progress:
    """Prints the run header, service notes, and a row per training step.

    Rows show: step, policy version, reward per task domain, rollout / train / weight-sync
    (exposed) seconds, max staleness, aborted and failed trajectories, the share of the
    step's generated tokens wasted, by reason (``stale``, ``redundancy``, ...), and the
    controller's event-loop lag p99 (ms; ``-`` when not monitored).

    On a terminal a row is a table row; written to a file or pipe (a log) it is the same
    numbers as ``key=value`` words wrapped under ``LOG_WIDTH`` columns (:func:`log_lines`):
    a table as wide as every column would not fit a log viewer, and rich at its assumed 80
    columns would drop the last columns.
    """

    def __init__(self, scenario: Scenario, planned_steps: int) -> None:
        self.tty = sys.stdout.isatty()
        self.console = Console(highlight=False, width=None if self.tty else LOG_WIDTH)
        self.domains = [d.name for d in scenario.domains]
        self.planned = planned_steps
        run = scenario.run
        self.console.rule(f"rollart · mode {run.mode} · alpha {run.alpha} · "
                          f"batch {run.batch_size} (group {run.group_size} + {run.redundancy}) · "
                          f"{plural(planned_steps, 'step')}")
        self._header_printed = False
        self._step_times: list[float] = []

    def eta(self, step: int, metrics: Any) -> str:
        """Time left at the mean step time so far (this process's steps), as ``"3m05s"``;
        ``"-"`` on the last step."""
        self._step_times.append(getattr(metrics, "step_time_s", 0.0) or 0.0)
        left = self.planned - step
        if left <= 0:
            return "-"
        return duration(left * sum(self._step_times) / len(self._step_times))

    def note(self, text: str) -> None:
        self.console.print(f"[dim]{text}[/dim]")

    def step(self, step: int, metrics: Any) -> None:
        eta = self.eta(step, metrics)
        if not self.tty:
            for line in log_lines(step, self.planned, self.domains, metrics, eta):
                self.console.print(line, markup=False, soft_wrap=True)
            return
        table = Table(show_header=not self._header_printed, box=None, pad_edge=False)
        for col in ["step", "ver", "reward", *self.domains, "rollout s", "train s", "sync s",
                    "stale", "abort", "fail", "waste", "lag p99 ms", "eta"]:
            table.add_column(col, justify="right", min_width=7)
        by_domain = metrics.reward_mean_by_domain
        table.add_row(
            f"{step}/{self.planned}", str(metrics.policy_version), f"{metrics.reward_mean:.3f}",
            *[f"{by_domain[d]:.3f}" if d in by_domain else "-" for d in self.domains],
            f"{metrics.rollout_time_s:.1f}", f"{metrics.train_time_s:.1f}",
            f"{metrics.weight_sync_exposed_s:.2f}", str(metrics.staleness_max),
            str(metrics.num_aborted), str(metrics.num_failed), waste_text(metrics),
            "-" if metrics.loop_lag_p99_ms is None else f"{metrics.loop_lag_p99_ms:.1f}", eta,
        )
        self._header_printed = True
        self.console.print(table)

    def close(self) -> None:
        self.console.rule()


#: Columns of the output written to a file or pipe (a log).
LOG_WIDTH = 100


def log_lines(step: int, planned: int, domains: list[str], metrics: Any,
              eta: str = "-") -> list[str]:
    """One step's progress as ``key=value`` words (the table row's numbers, a domain's reward
    as ``reward.NAME``, ``eta``: the time left), wrapped at spaces under :data:`LOG_WIDTH`
    columns, continuation lines indented; a word longer than a line (a long domain name) is
    kept whole."""
    by_domain = metrics.reward_mean_by_domain
    lag = metrics.loop_lag_p99_ms
    words = [f"step={step}/{planned}", f"ver={metrics.policy_version}",
             f"reward={metrics.reward_mean:.3f}",
             *[f"reward.{d}={by_domain[d]:.3f}" if d in by_domain else f"reward.{d}=-"
               for d in domains],
             f"rollout_s={metrics.rollout_time_s:.1f}", f"train_s={metrics.train_time_s:.1f}",
             f"sync_s={metrics.weight_sync_exposed_s:.2f}", f"stale={metrics.staleness_max}",
             f"abort={metrics.num_aborted}", f"fail={metrics.num_failed}",
             f"waste={_waste_word(metrics)}",
             f"lag_p99_ms={'-' if lag is None else f'{lag:.1f}'}", f"eta={eta}"]
    return textwrap.wrap(" ".join(words), width=LOG_WIDTH - 1, subsequent_indent="    ",
                         break_long_words=False, break_on_hyphens=False)


def plural(n: int, word: str) -> str:
    """``"1 step"``, ``"2 steps"``: ``n`` and ``word`` (a regular noun), pluralised."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def duration(seconds: float) -> str:
    """``"45s"``, ``"3m05s"``, ``"2h04m"``: a duration in seconds for a person."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def step_waste(metrics: Any) -> tuple[float, dict[str, float], int] | None:
    """A step's waste: ``(share, share_by_reason, carried_tokens)``, or ``None`` when the step
    settled no token.

    A token is *settled* in the step it is trained or wasted; ``share = wasted_tokens /
    (trained_tokens + wasted_tokens)``, in [0, 1] (each settled token is trained or wasted for
    exactly one reason: ``rollart.controller.buffer.core``). Dividing by the step's own generated
    tokens instead is not bounded: a step may settle tokens generated before it (in flight at
    the previous step's end, or held in the checkpoint a run resumed from), which
    ``carried_tokens = max(0, settled - buffer_generated_tokens)`` counts apart. Over a steady
    stretch of steps nothing is carried and the share is that of the generated tokens."""
    wasted = getattr(metrics, "wasted_tokens", 0)
    settled = wasted + getattr(metrics, "trained_tokens", 0)
    if settled <= 0:
        return None
    by_reason = getattr(metrics, "wasted_tokens_by_reason", {})
    carried = max(0, settled - getattr(metrics, "buffer_generated_tokens", 0))
    return wasted / settled, {k: v / settled for k, v in by_reason.items()}, carried


def _tokens(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def waste_text(metrics: Any) -> str:
    """``"41% stale 38 red 3"``: :func:`step_waste`'s share of the tokens the step settled,
    then each reason's share in percent, then ``"+12.3k carried"`` when the step settled
    tokens generated before it (``-`` when it settled none)."""
    waste = step_waste(metrics)
    if waste is None:
        return "-"
    share, by_reason, carried = waste
    parts = [f"{100 * share:.0f}%"]
    parts += [f"{_SHORT.get(k, k)} {100 * v:.0f}"
              for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])]
    return " ".join(parts) + (f" +{_tokens(carried)} carried" if carried else "")


def _waste_word(metrics: Any) -> str:
    """:func:`waste_text` as one word: ``"41%(stale:38,red:3)"``, then ``"+12.3k_carried"``."""
    head, _, carried = waste_text(metrics).partition(" +")
    head, *rest = head.split(" ")
    pairs = [f"{k}:{v}" for k, v in zip(rest[::2], rest[1::2], strict=True)]
    return (head + (f"({','.join(pairs)})" if pairs else "")
            + (f"+{carried.replace(' ', '_')}" if carried else ""))


_SHORT = {"redundancy": "red", "unselected": "unsel", "shutdown": "shut"}


def waste_summary(rows: list[dict[str, Any]], weights: dict[str, float]) -> dict[str, Any]:
    """Run totals of waste and selection bias from ``metrics.jsonl`` rows (for summary.json).

    ``rows``: step metrics as dicts (``StepMetrics`` fields); ``weights``: each domain's
    configured ``weight``. Token counts add up over the run: ``generated_tokens ==
    trained_tokens + wasted_tokens + in_flight_tokens`` (in flight at the last step's end).
    Per domain: groups admitted (``groups_started``), trajectories ``started``, ``finished``
    and ``trained`` (samples), the domain's share of trained samples against its configured
    share, mean generated tokens and turns of trained vs finished samples, and
    ``length_bias`` = trained mean / finished mean - 1.
    """
    generated = sum(r.get("buffer_generated_tokens", 0) for r in rows)
    reasons: dict[str, int] = {}
    domains: dict[str, dict[str, Any]] = {}
    for r in rows:
        for k, v in r.get("wasted_tokens_by_reason", {}).items():
            reasons[k] = reasons.get(k, 0) + v
        for name, d in r.get("by_domain", {}).items():
            acc = domains.setdefault(name, {"wasted_tokens": {}})
            for k, v in d.items():
                if k == "wasted_tokens":
                    for reason, n in v.items():
                        acc["wasted_tokens"][reason] = acc["wasted_tokens"].get(reason, 0) + n
                else:
                    acc[k] = acc.get(k, 0) + v
    wasted = sum(reasons.values())
    trained_all = sum(d.get("trained", 0) for d in domains.values())
    total_w = sum(weights.values()) or 1.0
    for name, d in domains.items():
        share = weights.get(name, 0.0) / total_w
        d["configured_share"] = round(share, 6)
        d["trained_share"] = round(d.get("trained", 0) / trained_all, 6) if trained_all else 0.0
        d["trained_share_vs_configured"] = (round(d["trained_share"] / share, 6)
                                            if share else None)
        for what, count in (("trained", "trained"), ("finished", "finished")):
            n = d.get(count, 0)
            d[f"mean_generated_{what}"] = round(d.get(f"{what}_tokens", 0) / n, 3) if n else None
            d[f"mean_turns_{what}"] = round(d.get(f"{what}_turns", 0) / n, 3) if n else None
        nt, nf = d.get("trained", 0), d.get("finished", 0)
        ft = d.get("finished_tokens", 0)
        d["length_bias"] = (round((d.get("trained_tokens", 0) / nt) / (ft / nf) - 1, 6)
                            if nt and nf and ft else None)
    return {
        "generated_tokens": generated,
        "trained_tokens": sum(r.get("trained_tokens", 0) for r in rows),
        "wasted_tokens": wasted,
        "in_flight_tokens": rows[-1].get("in_flight_tokens", 0) if rows else 0,
        "wasted_share": round(wasted / generated, 6) if generated else 0.0,
        "wasted_tokens_by_reason": dict(sorted(reasons.items())),
        "wasted_share_by_reason": {k: round(v / generated, 6) if generated else 0.0
                                   for k, v in sorted(reasons.items())},
        "domains": dict(sorted(domains.items())),
    }


def failure_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Run totals of failures from ``metrics.jsonl`` rows (for summary.json): failed
    trajectories by reason, invalid worker replies and the workers quarantined, in order."""
    reasons: dict[str, int] = {}
    for r in rows:
        for k, v in r.get("num_failed_by_reason", {}).items():
            reasons[k] = reasons.get(k, 0) + v
    return {
        "failed_by_reason": dict(sorted(reasons.items())),
        "num_invalid_replies": sum(r.get("num_invalid_replies", 0) for r in rows),
        "quarantined_workers": [w for r in rows for w in r.get("quarantined_workers", [])],
    }


def _collapse_words(collapse: Any) -> str:
    # summary.json keeps the numbers; the closing block names the reasons only
    if not collapse:
        return ""
    reasons = collapse.get("reasons") if isinstance(collapse, dict) else None
    return f"; COLLAPSE: {', '.join(reasons) if reasons else collapse}"


def _num(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _ci(ci: Any) -> str:
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and None not in ci:
        return f", 95% CI [{ci[0]:.3f}, {ci[1]:.3f}]"
    if isinstance(ci, (int, float)) and not isinstance(ci, bool):
        return f" ± {ci:.3f}"
    return ""


def summary_block(summary: dict[str, Any], run_dir: Path, *, checkpoint: Path | None,
                  resume: str | None) -> list[str]:
    """The lines that end ``rollart run``, from ``summary.json``'s dict
    (``rollart.launcher.rundir.write_summary``): steps and wall time, each domain's mean reward
    over its first -> last ``SUMMARY_WINDOW`` steps, held-out evaluation first -> last where
    ``summary["eval"]`` has it, waste by reason (share of the generated tokens), then where the
    run folder, the newest checkpoint and the report are, and the commands that continue the run
    (``resume``, with ``N`` for the new total steps; ``None``: no checkpoint to continue from)
    and write its report. A checkpoint older than the last step done gets a line saying
    which steps a resume runs again."""
    lines = [f"steps       {summary.get('steps', 0)} in {duration(summary.get('wall_time_s', 0))}"
             f" (mode {summary.get('mode')}, alpha {summary.get('alpha')})"]
    domains = summary.get("domains", {})
    first_key = next((k for d in domains.values() for k in d
                      if k.startswith("reward_first") and k.endswith("_mean")), None)
    if first_key is not None:
        window = first_key.removeprefix("reward_first").removesuffix("_mean")
        last_key = f"reward_last{window}_mean"
        for i, (name, d) in enumerate(sorted(domains.items())):
            if first_key in d:
                head = f"reward      (mean of the first -> last {window} steps) " if i == 0 \
                    else " " * 12
                lines.append(f"{head}{name}: {_num(d[first_key])} -> {_num(d.get(last_key))}")
    for i, (name, e) in enumerate(sorted((summary.get("eval") or {}).items())):
        base = e.get("majority_baseline")
        kind = "sampled pass@1 " if e.get("headline") == "sampled" else ""
        lines.append(f"{'eval        ' if i == 0 else ' ' * 12}{name}: {kind}"
                     f"{_num(e.get('first'))} -> "
                     f"{_num(e.get('last'))}{_ci(e.get('last_ci95'))}"
                     + ("" if base is None else f" (majority baseline {base:.3f})")
                     + _collapse_words(e.get("collapse")))
    if summary.get("generated_tokens"):
        by_reason = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(
            summary.get("wasted_share_by_reason", {}).items(), key=lambda kv: -kv[1]))
        lines.append(f"waste       {100 * summary.get('wasted_share', 0.0):.0f}% of "
                     f"{summary['generated_tokens']} generated tokens"
                     + (f": {by_reason}" if by_reason else ""))
    lines += [f"run folder  {run_dir}  (metrics.jsonl, summary.json, logs/)",
              f"checkpoint  {checkpoint if checkpoint is not None else 'none'}"]
    done = summary.get("steps", 0)
    at = checkpoint_step(checkpoint) if checkpoint is not None else None
    if at is not None and at < done:
        # Steps after the newest checkpoint (a plain interrupt, a failure) are rolled back
        # with the trainer on resume: said here, or "steps 71" reads as where it goes on.
        again = f"step {done} runs" if at + 1 == done else f"steps {at + 1}-{done} run"
        lines.append(f"{'':12}a resume goes on from the end of step {at}: {again} again")
    elif checkpoint is None and done:
        lines.append(f"{'':12}no checkpoint was written (trainer.checkpoint_every): this run "
                     "cannot be resumed")
    lines.append(f"report      rollart report {run_dir}  "
                 f"(writes {run_dir / 'report' / 'index.html'})")
    if resume is not None:
        lines.append(f"continue    {resume}  (N: the new total of steps)")
    return lines


def print_summary_block(lines: list[str], console: Console | None = None) -> None:
    """Print :func:`summary_block`'s lines under a rule, to stdout (with the step table)."""
    console = console or Console(highlight=False, width=None if sys.stdout.isatty()
                                 else LOG_WIDTH)
    console.rule("run summary")
    for line in lines:
        console.print(line, markup=False, soft_wrap=True)


class StartProgress:
    """Says what happens while a supervisor's services start: each one as it is ready, and
    every ``every_s`` seconds the ones still starting (vLLM workers and the trainer take a
    minute or two on a loaded machine; silence would read like a hang).

    Wraps ``sup.start`` (``Supervisor`` / ``RaySupervisor``: ``async start(name, argv, ...)
    -> address``) on that instance; use as an async context manager around the starts.
    """

    def __init__(self, sup: Any, note: Any, every_s: float = 20.0) -> None:
        self.sup, self.note, self.every_s = sup, note, every_s
        self.pending: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self._ticker: asyncio.Task | None = None
        start = sup.start

        async def announced(name: str, *args: Any, **kwargs: Any) -> str:
            self.pending[name] = time.perf_counter()
            try:
                address = await start(name, *args, **kwargs)
            finally:
                self.pending.pop(name, None)
            self.note(f"  {name} ready ({time.perf_counter() - self.t0:.0f} s)")
            return address

        sup.start = announced

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            if self.pending:
                self.note(f"  still starting ({time.perf_counter() - self.t0:.0f} s): "
                          f"{', '.join(sorted(self.pending))}")

    async def __aenter__(self) -> StartProgress:
        self._ticker = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        assert self._ticker is not None
        self._ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._ticker
