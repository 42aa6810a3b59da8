"""Terminal progress of ``rollart run`` (rich): one line per step with the numbers that matter."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from rollart.config import Scenario


class Progress:
    """Prints the run header, service notes, and a row per training step.

    Rows show: step, policy version, reward per task domain, rollout / train / weight-sync
    (exposed) seconds, max staleness, aborted and failed trajectories, the controller's
    event-loop lag p99 (ms; ``-`` when not monitored).
    """

    def __init__(self, scenario: Scenario, planned_steps: int) -> None:
        self.console = Console(highlight=False)
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
        table = Table(show_header=not self._header_printed, box=None, pad_edge=False)
        for col in ["step", "ver", "reward", *self.domains, "rollout s", "train s", "sync s",
                    "stale", "abort", "fail", "lag p99 ms"]:
            table.add_column(col, justify="right", min_width=7)
        by_domain = metrics.reward_mean_by_domain
        table.add_row(
            f"{step}/{self.planned}", str(metrics.policy_version), f"{metrics.reward_mean:.3f}",
            *[f"{by_domain[d]:.3f}" if d in by_domain else "-" for d in self.domains],
            f"{metrics.rollout_time_s:.1f}", f"{metrics.train_time_s:.1f}",
            f"{metrics.weight_sync_exposed_s:.2f}", str(metrics.staleness_max),
            str(metrics.num_aborted), str(metrics.num_failed),
            "-" if metrics.loop_lag_p99_ms is None else f"{metrics.loop_lag_p99_ms:.1f}",
        )
        self._header_printed = True
        self.console.print(table)

    def close(self) -> None:
        self.console.rule()
