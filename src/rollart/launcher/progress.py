"""Terminal progress of ``rollart run`` (rich): one line per step with the numbers that matter."""

from __future__ import annotations

import sys
import textwrap
from typing import Any

from rich.console import Console
from rich.table import Table

from rollart.config import Scenario


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
                          f"{planned_steps} steps")
        self._header_printed = False

    def note(self, text: str) -> None:
        self.console.print(f"[dim]{text}[/dim]")

    def step(self, step: int, metrics: Any) -> None:
        if not self.tty:
            for line in log_lines(step, self.planned, self.domains, metrics):
                self.console.print(line, markup=False, soft_wrap=True)
            return
        table = Table(show_header=not self._header_printed, box=None, pad_edge=False)
        for col in ["step", "ver", "reward", *self.domains, "rollout s", "train s", "sync s",
                    "stale", "abort", "fail", "waste", "lag p99 ms"]:
            table.add_column(col, justify="right", min_width=7)
        by_domain = metrics.reward_mean_by_domain
        table.add_row(
            f"{step}/{self.planned}", str(metrics.policy_version), f"{metrics.reward_mean:.3f}",
            *[f"{by_domain[d]:.3f}" if d in by_domain else "-" for d in self.domains],
            f"{metrics.rollout_time_s:.1f}", f"{metrics.train_time_s:.1f}",
            f"{metrics.weight_sync_exposed_s:.2f}", str(metrics.staleness_max),
            str(metrics.num_aborted), str(metrics.num_failed), waste_text(metrics),
            "-" if metrics.loop_lag_p99_ms is None else f"{metrics.loop_lag_p99_ms:.1f}",
        )
        self._header_printed = True
        self.console.print(table)

    def close(self) -> None:
        self.console.rule()


#: Columns of the output written to a file or pipe (a log).
LOG_WIDTH = 100


def log_lines(step: int, planned: int, domains: list[str], metrics: Any) -> list[str]:
    """One step's progress as ``key=value`` words (the table row's numbers, a domain's reward
    as ``reward.NAME``), wrapped at spaces under :data:`LOG_WIDTH` columns, continuation lines
    indented; a word longer than a line (a long domain name) is kept whole."""
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
             f"lag_p99_ms={'-' if lag is None else f'{lag:.1f}'}"]
    return textwrap.wrap(" ".join(words), width=LOG_WIDTH - 1, subsequent_indent="    ",
                         break_long_words=False, break_on_hyphens=False)


def waste_text(metrics: Any) -> str:
    """``"41% stale 38 red 3"``: wasted share of the step's generated tokens, then each
    reason's share in percent (``-`` when nothing was generated)."""
    generated = getattr(metrics, "buffer_generated_tokens", 0)
    if generated <= 0:
        return "-"
    by_reason = getattr(metrics, "wasted_tokens_by_reason", {})
    parts = [f"{100 * metrics.wasted_tokens / generated:.0f}%"]
    parts += [f"{_SHORT.get(k, k)} {100 * v / generated:.0f}"
              for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])]
    return " ".join(parts)


def _waste_word(metrics: Any) -> str:
    """:func:`waste_text` as one word: ``"41%(stale:38,red:3)"``."""
    head, *rest = waste_text(metrics).split(" ")
    pairs = [f"{k}:{v}" for k, v in zip(rest[::2], rest[1::2], strict=True)]
    return head + (f"({','.join(pairs)})" if pairs else "")


_SHORT = {"redundancy": "red", "unselected": "unsel", "shutdown": "shut"}


def waste_summary(rows: list[dict[str, Any]], weights: dict[str, float]) -> dict[str, Any]:
    """Run totals of waste and selection bias from ``metrics.jsonl`` rows (for summary.json).

    ``rows``: step metrics as dicts (``StepMetrics`` fields); ``weights``: each domain's
    configured ``weight``. Token counts add up over the run: ``generated_tokens ==
    trained_tokens + wasted_tokens + in_flight_tokens`` (in flight at the last step's end).
    Per domain: groups / trajectories started, finished and trained samples, the domain's share
    of trained samples against its configured share, mean generated tokens and turns of trained
    vs finished samples, and ``length_bias`` = trained mean / finished mean - 1.
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
