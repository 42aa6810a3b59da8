"""``rollart report RUN_DIR [--out DIR]``: plots of a run (finished or still running) as PNGs and
a one-page HTML that embeds them.

Reads ``RUN_DIR/metrics.jsonl`` (and ``summary.json`` when present) and writes, into ``DIR``
(default ``RUN_DIR/report``):

- ``reward.png``: mean batch reward per step, overall and per task domain;
- ``waste.png``: share of each step's generated tokens thrown away, stacked by reason;
- ``staleness.png``: max and mean staleness (versions) of each batch;
- ``step_time.png``: each step's wall time split into waiting for the batch, training, exposed
  weight sync and the rest (stacked bars, seconds);
- ``throughput.png``: generated and trained tokens per second of step wall time;
- ``signal.png``: per domain, the share of each batch's groups whose rewards were all equal
  (zero GRPO advantage: no gradient; a domain stuck at 1.0 cannot learn);
- ``eval_<domain>.png`` (runs with ``[eval] enabled``): per domain, held-out greedy accuracy
  with its 95% interval and pass@k at each evaluation's step, and the majority baseline (the
  best constant answer's accuracy on the same eval set) as a line;
- ``index.html``: the images and, from ``summary.json``, each domain's reward over its
  first and last 10 steps and trained share, and its held-out evaluation.

Exit codes: 0 written, 2 no metrics to plot (missing or empty ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path
from typing import Any

from rollart.filemodes import apply_umask, run_shares_with_group
from rollart.launcher.sinks import step_scalars

#: the PNGs a report holds, with their titles (in page order)
PLOTS = {
    "reward.png": "Reward per domain",
    "waste.png": "Wasted share of generated tokens, by reason",
    "staleness.png": "Staleness of each batch",
    "step_time.png": "Step time breakdown",
    "throughput.png": "Throughput",
    "signal.png": "Groups without learning signal (all rewards equal), per domain",
}


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    # A running run's last line may be half-written: read_jsonl leaves it out.
    from rollart.launcher.rundir import read_jsonl

    return read_jsonl(run_dir / "metrics.jsonl")


def _figure(title: str, ylabel: str) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")  # files only: never a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax = fig.axes[0]
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def write_plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Write :data:`PLOTS` for metrics ``rows`` into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    scal = [step_scalars(r) for r in rows]

    fig, ax = _figure(PLOTS["reward.png"], "mean reward")
    ax.plot(steps, [r["reward_mean"] for r in rows], color="black", lw=2, label="all")
    domains = sorted({d for r in rows for d in r.get("reward_mean_by_domain", {})})
    for d in domains:
        pts = [(r["step"], r["reward_mean_by_domain"][d]) for r in rows
               if d in r.get("reward_mean_by_domain", {})]
        ax.plot(*zip(*pts, strict=True), marker=".", label=d)
    _save(fig, out / "reward.png")

    fig, ax = _figure(PLOTS["waste.png"], "share of generated tokens")
    reasons = sorted({k for r in rows for k in r.get("wasted_tokens_by_reason", {})})
    if reasons:
        ax.stackplot(steps, [[s.get(f"waste/{k}", 0.0) for s in scal] for k in reasons],
                     labels=reasons, alpha=0.8)
    ax.set_ylim(0, 1)
    _save(fig, out / "waste.png")

    fig, ax = _figure(PLOTS["staleness.png"], "versions")
    ax.step(steps, [r["staleness_max"] for r in rows], where="mid", label="max")
    ax.plot(steps, [r["staleness_mean"] for r in rows], marker=".", label="mean")
    _save(fig, out / "staleness.png")

    fig, ax = _figure(PLOTS["step_time.png"], "seconds")
    parts = {
        "waiting for batch": [r["trainer_idle_s"] for r in rows],
        "training": [r["train_time_s"] for r in rows],
        "weight sync (exposed)": [r["weight_sync_exposed_s"] for r in rows],
    }
    parts["other"] = [max(0.0, r["step_time_s"] - sum(p[i] for p in parts.values()))
                      for i, r in enumerate(rows)]
    bottom = [0.0] * len(rows)
    for name, vals in parts.items():
        ax.bar(steps, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    _save(fig, out / "step_time.png")

    fig, ax = _figure(PLOTS["throughput.png"], "tokens / s")
    for key, label in (("throughput/generated_tokens_per_s", "generated"),
                       ("throughput/trained_tokens_per_s", "trained")):
        ax.plot(steps, [s.get(key, 0.0) for s in scal], marker=".", label=label)
    _save(fig, out / "throughput.png")

    fig, ax = _figure(PLOTS["signal.png"], "share of the domain's groups")
    for d in domains:
        pts = [(st, s[f"flat_group_share/{d}"]) for st, s in zip(steps, scal, strict=True)
               if f"flat_group_share/{d}" in s]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=".", label=d)
    ax.set_ylim(-0.05, 1.05)
    _save(fig, out / "signal.png")
    return [out / name for name in PLOTS] + write_eval_plots(rows, out)


def eval_points(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Per domain, ``(at_step, result)`` of each evaluation in ``rows``, by step."""
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for e in sorted((e for r in rows for e in r.get("eval", [])), key=lambda e: e["at_step"]):
        for d, res in e["domains"].items():
            if res.get("accuracy") is not None:
                out.setdefault(d, []).append((e["at_step"], res))
    return out


def write_eval_plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """``eval_<domain>.png`` per domain with evaluations in ``rows``; returns their paths."""
    paths = []
    for d, pts in sorted(eval_points(rows).items()):
        fig, ax = _figure(f"Held-out eval: {d}", "accuracy")
        steps = [s for s, _ in pts]
        ax.plot(steps, [r["accuracy"] for _, r in pts], marker="o", color="C0",
                label="greedy accuracy")
        ci = [(s, r["ci95"]) for s, r in pts if r.get("ci95")]
        if ci:
            ax.fill_between([s for s, _ in ci], [c[0] for _, c in ci], [c[1] for _, c in ci],
                            color="C0", alpha=0.2, label="95% interval")
        pk = [(s, r["pass_at_k"]) for s, r in pts if r.get("pass_at_k") is not None]
        if pk:
            ax.plot(*zip(*pk, strict=True), marker=".", ls="--", color="C2",
                    label=f"pass@{pts[-1][1].get('pass_k')}")
        base = next((r["majority_baseline"] for _, r in reversed(pts)
                     if r.get("majority_baseline") is not None), None)
        if base is not None:
            ax.axhline(base, color="C3", ls=":", lw=2, label=f"majority baseline {base:.3f}")
        ax.set_ylim(-0.05, 1.05)
        path = out / f"eval_{d}.png"
        _save(fig, path)
        paths.append(path)
    return paths


def _fmt(v: Any) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else html.escape(str(v))


def write_html(run_dir: Path, out: Path, rows: list[dict[str, Any]]) -> Path:
    """``out/index.html``: the plots (relative links) and the per-domain summary table."""
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    table = ""
    domains = summary.get("domains", {})
    if domains:
        cols = ["reward_first10_mean", "reward_last10_mean", "reward_change", "trained_share",
                "configured_share", "flat_group_share", "wasted_tokens"]
        head = "".join(f"<th>{c}</th>" for c in ["domain", *cols])
        body = "".join(
            "<tr><td>" + html.escape(name) + "</td>"
            + "".join(f"<td>{_fmt(d.get(c))}</td>" for c in cols) + "</tr>"
            for name, d in sorted(domains.items()))
        table = f"<h2>Domains</h2><table border=1 cellpadding=4><tr>{head}</tr>{body}</table>"
    evals = summary.get("eval", {})
    if evals:
        cols = ["first", "last", "last_ci95", "majority_baseline", "pass_at_k_last",
                "distinct_answer_share_last", "collapse"]
        head = "".join(f"<th>{c}</th>" for c in ["domain", *cols])
        body = "".join(
            "<tr><td>" + html.escape(name) + "</td>"
            + "".join(f"<td>{_fmt(d.get(c))}</td>" for c in cols) + "</tr>"
            for name, d in sorted(evals.items()))
        table += (f"<h2>Held-out evaluation (greedy accuracy)</h2><table border=1 "
                  f"cellpadding=4><tr>{head}</tr>{body}</table>")
    plots = {**PLOTS, **{f"eval_{d}.png": f"Held-out eval: {d}" for d in eval_points(rows)}}
    figs = "".join(f'<h2>{html.escape(title)}</h2><img src="{name}" alt="{html.escape(title)}">'
                   for name, title in plots.items())
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>rollart report: "
            f"{html.escape(run_dir.name)}</title></head><body><h1>rollart run "
            f"{html.escape(str(run_dir))}</h1><p>{len(rows)} steps; mode "
            f"{_fmt(summary.get('mode', rows[-1].get('mode')))}, wasted share "
            f"{_fmt(summary.get('wasted_share'))}</p>{table}{figs}</body></html>\n")
    path = out / "index.html"
    path.write_text(page)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollart report", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run folder (holds metrics.jsonl)")
    p.add_argument("--out", type=Path, help="where to write (default RUN_DIR/report)")
    args = p.parse_args(argv)
    try:
        rows = _rows(args.run_dir)
    except ValueError as exc:
        print(f"rollart report: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print(f"rollart report: {args.run_dir / 'metrics.jsonl'}: no step metrics to plot",
              file=sys.stderr)
        return 2
    out = args.out or args.run_dir / "report"
    # Part of the run folder: as private as the run made it (rollart.filemodes).
    apply_umask(run_shares_with_group(args.run_dir))
    write_plots(rows, out)
    page = write_html(args.run_dir, out, rows)
    print(f"rollart report: {len(rows)} steps -> {page}")
    return 0
