"""Step metrics where people look: TensorBoard event files (default) and Weights & Biases.

:func:`step_scalars` flattens one ``metrics.jsonl`` row (a ``StepMetrics`` as a dict) into
named scalars; :class:`TensorBoardSink` writes them with TensorBoard's own event writer (the
``tensorboard`` package: no torch, no TensorFlow in the controller); :class:`WandbSink` logs
them to W&B when the scenario enables it and ``wandb`` is installed (not a dependency).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rollart.transport.errors import ConfigError

log = logging.getLogger(__name__)

#: per-step scalars taken as they are from a metrics row (seconds, counts, versions)
_PLAIN = (
    "reward_mean", "num_samples", "step_time_s", "rollout_time_s", "train_time_s",
    "trainer_idle_s", "weight_sync_total_s", "weight_sync_exposed_s", "staleness_max",
    "staleness_mean", "num_aborted", "num_failed", "num_retries", "num_rerouted",
    "num_generated_tokens", "wasted_tokens", "trained_tokens", "in_flight_tokens",
    "response_len_kept_mean", "response_len_all_mean", "num_turns_mean", "policy_version",
    "loop_lag_p99_ms", "loop_lag_max_ms", "num_prefix_resends",
    "num_window_waits", "entropy_mean", "num_kv_admission_waits", "kv_admission_wait_s",
    "num_prefix_evicted_turns",
)


def step_scalars(row: dict[str, Any]) -> dict[str, float]:
    """Named scalars of one step's metrics row.

    Names: the ``StepMetrics`` field for plain numbers (``reward_mean``, ``step_time_s``, ...);
    ``reward/<domain>`` (mean reward of the batch's samples of a domain); ``waste/<reason>`` and
    ``waste/total`` (share of the step's generated tokens, 0..1); ``throughput/
    generated_tokens_per_s`` and ``throughput/trained_tokens_per_s`` (tokens over the step's
    wall time; generated: without those a resume's checkpoint carried over);
    ``train/<name>`` (the trainer's metrics); ``trained_share/<domain>`` (the domain's share
    of the batch's samples); ``flat_group_share/<domain>`` (share of the
    domain's groups in the batch whose rewards are all equal: no GRPO gradient);
    ``response_len/<domain>`` (mean generated tokens per trajectory of the domain's samples);
    ``entropy_mean`` and ``entropy/<domain>`` (the policy's mean entropy per generated token,
    nats); ``spilled/<domain>`` and ``affinity_moves`` (online affinity: trajectories started
    away from the domain's pool, moves of domains between pools), ``affinity_spills/<domain>``
    and ``affinity_returns/<domain>`` (the domain's moves away from its pool, to any pool, and
    back).
    ``None`` values are left out; a row's evaluations are :func:`eval_scalars`' (they belong
    to the step each started after, not to this one).
    """
    out: dict[str, float] = {}
    for k in _PLAIN:
        v = row.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    for d, v in row.get("reward_mean_by_domain", {}).items():
        out[f"reward/{d}"] = float(v)
    generated = row.get("buffer_generated_tokens", 0)
    if generated:
        for reason, n in row.get("wasted_tokens_by_reason", {}).items():
            out[f"waste/{reason}"] = n / generated
        out["waste/total"] = row.get("wasted_tokens", 0) / generated
    dt = row.get("step_time_s") or 0.0
    if dt > 0:
        # a resumed run's first step: the carried tokens were generated before this process
        own = row.get("num_generated_tokens", 0) - row.get("carried_generated_tokens", 0)
        out["throughput/generated_tokens_per_s"] = own / dt
        out["throughput/trained_tokens_per_s"] = row.get("trained_tokens", 0) / dt
    for k, v in row.get("train_metrics", {}).items():
        out[f"train/{k}"] = float(v)
    flat = row.get("flat_groups_by_domain", {})
    for d, g in row.get("groups_by_domain", {}).items():
        if g:
            out[f"flat_group_share/{d}"] = flat.get(d, 0) / g
    n = row.get("num_samples") or 0
    if n:
        for d, c in row.get("by_domain", {}).items():
            out[f"trained_share/{d}"] = c.get("trained", 0) / n
    for d, v in row.get("response_len_mean_by_domain", {}).items():
        out[f"response_len/{d}"] = float(v)
    for d, v in row.get("entropy_by_domain", {}).items():
        out[f"entropy/{d}"] = float(v)
    if "affinity_moves" in row:  # online affinity: spills per domain, moves in the step
        for d, v in row.get("num_spilled_by_domain", {}).items():
            out[f"spilled/{d}"] = float(v)
        out["affinity_moves"] = float(len(row["affinity_moves"]))
        for d, to in row.get("affinity_spills_by_domain", {}).items():
            out[f"affinity_spills/{d}"] = float(sum(to.values()))
        for d, v in row.get("affinity_returns_by_domain", {}).items():
            out[f"affinity_returns/{d}"] = float(v)
    return out


#: per-domain numbers of an evaluation record written as scalars
_EVAL_KEYS = ("accuracy", "pass_at_1", "pass_at_k", "distinct_answer_share",
              "majority_baseline", "reward_mean", "response_len_mean")


def eval_scalars(record: dict[str, Any]) -> dict[str, float]:
    """Named scalars of one evaluation record (an item of a metrics row's ``eval``; write them
    at its ``at_step``): ``eval/<domain>/<name>`` for ``accuracy``, ``pass_at_1``,
    ``pass_at_k``, ``distinct_answer_share``, ``majority_baseline``, ``reward_mean``,
    ``response_len_mean``, and ``eval/<domain>/ci95_lo`` / ``ci95_hi`` (the accuracy's 95%
    interval); ``None`` values are left out."""
    out: dict[str, float] = {}
    for d, res in record.get("domains", {}).items():
        for k in _EVAL_KEYS:
            v = res.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"eval/{d}/{k}"] = float(v)
        ci = res.get("ci95")
        if ci:
            out[f"eval/{d}/ci95_lo"], out[f"eval/{d}/ci95_hi"] = float(ci[0]), float(ci[1])
    return out


class TensorBoardSink:
    """Appends each step's scalars to an event file under ``logdir`` (a new file per process,
    as TensorBoard expects; a resumed run's steps continue in a second file)."""

    def __init__(self, logdir: str | Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(logdir), flush_secs=10)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        # Generated protobuf classes, made at import: invisible to a type checker.
        proto = summary_pb2.Summary  # pyright: ignore[reportAttributeAccessIssue]
        summary = proto(value=[proto.Value(tag=k, simple_value=v)
                               for k, v in sorted(scalars.items())])
        event = event_pb2.Event  # pyright: ignore[reportAttributeAccessIssue]
        self._writer.add_event(event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Logs each step's scalars to a W&B run (``wandb.init(project, dir=run_dir, config)``).

    Raises:
        ConfigError: ``wandb`` is not installed (the scenario asked for it).
    """

    def __init__(self, project: str, run_dir: Path, config: dict[str, Any]) -> None:
        try:
            # optional (only when output.wandb is set), so absent where pyright runs
            import wandb  # pyright: ignore[reportMissingImports]
        except ImportError:
            raise ConfigError("output.wandb: true, but the wandb package is not installed "
                              "(pip install wandb), or set it false") from None

        self._run = wandb.init(project=project, dir=str(run_dir), config=config,
                               name=run_dir.name)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()
