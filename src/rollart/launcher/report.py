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
  and sampled pass@1, each with its 95% interval, and pass@k (k > 1) at each evaluation's
  step, and the majority baseline (the best constant answer's accuracy on the same eval set)
  as a line;
- ``loss.png``, ``kl.png``, ``grad_norm.png``: the trainer's loss, KL to the reference policy
  and gradient norm of each step (``train_metrics``);
- ``entropy.png``: the policy's mean entropy per generated token (nats), overall and per domain;
- ``response_length.png``: per domain, mean generated tokens per trajectory;
- ``affinity.png`` (runs whose online affinity, ``[run.adaptive_affinity]``, moved a domain or
  held first turns for KV room): per domain, the new trajectories started away from its own
  pool in each step, a marker at each step where the domain spilled (up, with the pool it went
  to and how many times) and where it returned (down), and the first turns the KV working-set
  hold delayed per step; the page lists every move with its step and reason;
- ``index.html``: the images; from ``summary.json``, each domain's reward over its first and
  last 10 steps and trained share, its held-out evaluation, and every other summary field
  (dict values as tables).

The noisy per-step series (reward, loss, KL, gradient norm, entropy, response length) are drawn
raw as faint lines with their rolling mean (:func:`rolling_mean`, ``--smooth N`` points) on top.
A series the run did not record (from a trainer that does not report it, e.g. the simulated one)
has no plot: one line says which was skipped.

Exit codes: 0 written, 2 no metrics to plot (missing or empty ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollart.filemodes import apply_umask, run_shares_with_group
from rollart.launcher.cliargs import path_arg
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

#: the PNGs of per-step training series, drawn when the run recorded them: name -> (title, y
#: label, overall scalar or None, per-domain scalar prefix or None), names of ``step_scalars``
SERIES_PLOTS: dict[str, tuple[str, str, str | None, str | None]] = {
    "loss.png": ("Training loss", "loss", "train/loss", None),
    "kl.png": ("KL divergence to the reference policy", "KL (nats)", "train/kl", None),
    "grad_norm.png": ("Gradient norm", "L2 norm", "train/grad_norm", None),
    "entropy.png": ("Policy entropy per generated token", "nats", "entropy_mean", "entropy/"),
    "response_length.png": ("Mean response length per domain", "tokens per trajectory", None,
                            "response_len/"),
}

#: the online-affinity plot, drawn when a domain moved or spilled trajectories
AFFINITY_PLOT = ("affinity.png", "Online affinity per domain (\u25b2 spill, \u25bc return)")

#: default ``--smooth``: points in the rolling mean drawn over each noisy series
DEFAULT_SMOOTH = 5


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing rolling mean: element ``i`` is the mean of ``values[max(0, i - window + 1)
    : i + 1]`` (fewer points at the start, so the line begins at the first value).

    Raises:
        ValueError: ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"rolling mean window must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _noisy(ax: Any, steps: Sequence[int], values: Sequence[float], label: str, color: str,
           smooth: int, lw: float = 1.5) -> None:
    """The raw per-step line, faint, and its rolling mean of ``smooth`` points on top."""
    if smooth <= 1 or len(values) < 2:
        ax.plot(steps, values, marker=".", color=color, lw=lw, label=label)
        return
    ax.plot(steps, values, color=color, lw=0.8, alpha=0.3)
    ax.plot(steps, rolling_mean(values, smooth), color=color, lw=lw,
            label=f"{label} (mean of {smooth})")


def _series(scal: Sequence[dict[str, float]], steps: Sequence[int], key: str
            ) -> tuple[list[int], list[float]]:
    pts = [(st, s[key]) for st, s in zip(steps, scal, strict=True) if key in s]
    return [p[0] for p in pts], [p[1] for p in pts]


def series_plots(rows: list[dict[str, Any]]) -> dict[str, list[str]]:
    """Per :data:`SERIES_PLOTS` name, the ``step_scalars`` keys ``rows`` hold for it (the
    overall one first, then one per domain, sorted); names with none are left out."""
    keys = {k for r in rows for k in step_scalars(r)}
    out = {}
    for name, (_, _, overall, prefix) in SERIES_PLOTS.items():
        found = [overall] if overall in keys else []
        if prefix:
            found += sorted(k for k in keys if k.startswith(prefix))
        if found:
            out[name] = found
    return out


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


def write_plots(rows: list[dict[str, Any]], out: Path, *, smooth: int = DEFAULT_SMOOTH,
                note: Callable[[str], None] = print) -> list[Path]:
    """Write :data:`PLOTS`, the :data:`SERIES_PLOTS` the run recorded and the eval plots for
    metrics ``rows`` into ``out``; returns their paths. ``smooth``: points of the rolling mean
    over noisy series (1: raw lines only). ``note`` is told, one line each, which series
    plots were skipped (not recorded by the run)."""
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    scal = [step_scalars(r) for r in rows]

    fig, ax = _figure(PLOTS["reward.png"], "mean reward")
    _noisy(ax, steps, [r["reward_mean"] for r in rows], "all", "black", smooth, lw=2)
    domains = sorted({d for r in rows for d in r.get("reward_mean_by_domain", {})})
    for i, d in enumerate(domains):
        _noisy(ax, *_series(scal, steps, f"reward/{d}"), d, f"C{i}", smooth)
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

    found = series_plots(rows)
    for name, (title, ylabel, overall, prefix) in SERIES_PLOTS.items():
        if name not in found:
            want = " or ".join(x for x in (overall, prefix and f"{prefix}<domain>") if x)
            note(f"rollart report: {name} skipped: metrics.jsonl has no {want} series")
            continue
        fig, ax = _figure(title, ylabel)
        for i, key in enumerate(found[name]):
            label = "all" if key == overall else key.removeprefix(prefix or "")
            # a domain keeps its reward plot's colour across plots
            color = ("black" if key == overall else
                     f"C{domains.index(label)}" if label in domains else f"C{i}")
            _noisy(ax, *_series(scal, steps, key), label, color, smooth,
                   lw=2 if key == overall else 1.5)
        _save(fig, out / name)
    return ([out / name for name in PLOTS] + [out / name for name in found]
            + write_affinity_plot(rows, out) + write_eval_plots(rows, out))


def affinity_domains(rows: list[dict[str, Any]]) -> list[str]:
    """The domains online affinity moved or spilled trajectories of in ``rows``, sorted
    (none: the run had it off, or nothing saturated)."""
    return sorted({d for r in rows for key in ("num_spilled_by_domain",
                   "affinity_spills_by_domain", "affinity_returns_by_domain")
                   for d, v in r.get(key, {}).items() if v})


def write_affinity_plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """:data:`AFFINITY_PLOT` when :func:`affinity_domains` finds any or a step held first
    turns for KV room (``num_kv_admission_waits``); returns its path.

    Per domain: the trajectories started away from its pool per step (a line), a ``^``
    marker on it at each step with spills (labelled ``-> pool xN``) and a ``v`` marker at
    each step with returns (``xN`` when more than one)."""
    domains = affinity_domains(rows)
    held = [r.get("num_kv_admission_waits", 0) for r in rows]
    if not domains and not any(held):
        return []
    name, title = AFFINITY_PLOT
    fig, ax = _figure(title, "new trajectories per step")
    steps = [r["step"] for r in rows]
    for i, d in enumerate(domains):
        spilled = [r.get("num_spilled_by_domain", {}).get(d, 0) for r in rows]
        ax.plot(steps, spilled, marker=".", color=f"C{i}", label=f"{d}: spilled trajectories")
        ups = [(st, y, r["affinity_spills_by_domain"][d]) for st, y, r
               in zip(steps, spilled, rows, strict=True)
               if r.get("affinity_spills_by_domain", {}).get(d)]
        downs = [(st, y, r["affinity_returns_by_domain"][d]) for st, y, r
                 in zip(steps, spilled, rows, strict=True)
                 if r.get("affinity_returns_by_domain", {}).get(d)]
        for pts, marker, what in ((ups, "^", "spilled"), (downs, "v", "returned")):
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls="none", marker=marker,
                    ms=9, color=f"C{i}", label=f"{d}: {what}")
            for st, y, n in pts:
                text = (", ".join(f"-> {pool} x{k}" for pool, k in sorted(n.items()))
                        if isinstance(n, dict) else f"x{n}" if n > 1 else "")
                if text:
                    ax.annotate(text, (st, y), textcoords="offset points", fontsize=7,
                                xytext=(4, 6 if marker == "^" else -10), color=f"C{i}")
    if any(held):
        ax.plot(steps, held, marker="s", ls="--", color="k",
                label="first turns held for KV room (all pools)")
    ax.margins(y=0.2)  # room for the labels above the highest marker
    ax.set_ylim(bottom=0)
    path = out / name
    _save(fig, path)
    return [path]


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
                            color="C0", alpha=0.2, label="greedy 95% interval")
        # Sampled pass@1 with its own interval: what a run with the sampled headline is
        # judged by, so it is drawn as the greedy line is.
        p1 = [(s, r) for s, r in pts if r.get("pass_at_1") is not None]
        if p1:
            ax.plot([s for s, _ in p1], [r["pass_at_1"] for _, r in p1], marker="s",
                    color="C1", label="sampled pass@1")
            ci1 = [(s, r["pass_at_1_ci95"]) for s, r in p1 if r.get("pass_at_1_ci95")]
            if ci1:
                ax.fill_between([s for s, _ in ci1], [c[0] for _, c in ci1],
                                [c[1] for _, c in ci1], color="C1", alpha=0.2,
                                label="sampled 95% interval")
        pk = [(s, r["pass_at_k"]) for s, r in pts
              if r.get("pass_at_k") is not None and r.get("pass_k") != 1]
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


def _steps(n: int) -> str:
    # not progress.plural: that module brings rich, which the report does not need
    return f"{n} step" if n == 1 else f"{n} steps"


def _fmt(v: Any) -> str:
    """One value as HTML: a dict as a key / value table (nested dicts nested), a list of
    dicts as a table with a column per key, any other list comma-separated, a float to 3
    decimals, ``None`` as ``-``."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, dict):
        if not v:
            return "-"
        body = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{_fmt(x)}</td></tr>"
                       for k, x in v.items())
        return f"<table border=1 cellpadding=3>{body}</table>"
    if isinstance(v, list):
        if v and all(isinstance(x, dict) for x in v):
            cols = list(dict.fromkeys(k for x in v for k in x))
            head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
            body = "".join("<tr>" + "".join(f"<td>{_fmt(x.get(c))}</td>" for c in cols)
                           + "</tr>" for x in v)
            return f"<table border=1 cellpadding=3><tr>{head}</tr>{body}</table>"
        return ", ".join(_fmt(x) for x in v) if v else "-"
    return html.escape(str(v))


def write_html(run_dir: Path, out: Path, rows: list[dict[str, Any]]) -> Path:
    """``out/index.html``: the plots (relative links), the per-domain summary and evaluation
    tables and the rest of ``summary.json`` (dict values as tables)."""
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
        # first / last / last_ci95 are the run's headline (``[eval] headline``).
        judged = sorted({d.get("headline", "greedy") for d in evals.values()})
        what = " / ".join("sampled pass@1" if h == "sampled" else "greedy accuracy"
                          for h in judged)
        table += (f"<h2>Held-out evaluation ({html.escape(what)})</h2><table border=1 "
                  f"cellpadding=4><tr>{head}</tr>{body}</table>")
    rest = {k: v for k, v in summary.items() if k not in ("domains", "eval")}
    if rest:
        table += f"<h2>Run summary</h2>{_fmt(rest)}"
    moves = [{"step": r["step"], "move": mv} for r in rows for mv in r.get("affinity_moves", [])]
    if moves:
        table += f"<h2>Online affinity moves</h2>{_fmt(moves)}"
    plots = {**PLOTS, **{name: SERIES_PLOTS[name][0] for name in series_plots(rows)},
             **(dict([AFFINITY_PLOT]) if affinity_domains(rows) else {}),
             **{f"eval_{d}.png": f"Held-out eval: {d}" for d in eval_points(rows)}}
    figs = "".join(f'<h2>{html.escape(title)}</h2><img src="{name}" alt="{html.escape(title)}">'
                   for name, title in plots.items())
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>rollart report: "
            f"{html.escape(run_dir.name)}</title></head><body><h1>rollart run "
            f"{html.escape(str(run_dir))}</h1><p>{_steps(len(rows))}; mode "
            f"{_fmt(summary.get('mode', rows[-1].get('mode')))}, wasted share "
            f"{_fmt(summary.get('wasted_share'))}</p>{table}{figs}</body></html>\n")
    path = out / "index.html"
    path.write_text(page)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rollart report", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("run_dir", type=path_arg, help="a run folder (holds metrics.jsonl)")
    p.add_argument("--out", type=path_arg, help="where to write (default RUN_DIR/report)")
    p.add_argument("--smooth", type=int, default=DEFAULT_SMOOTH, metavar="N",
                   help="points in the rolling mean drawn over each noisy per-step series "
                        f"(1: raw lines only; default {DEFAULT_SMOOTH})")
    args = p.parse_args(argv)
    if args.smooth < 1:
        p.error(f"--smooth: must be >= 1, got {args.smooth}")
    if not args.run_dir.is_dir():
        what = "is not a folder" if args.run_dir.exists() else "does not exist"
        print(f"rollart report: {args.run_dir} {what} (give a run folder, which holds "
              "metrics.jsonl)", file=sys.stderr)
        return 2
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        print(f"rollart report: --out {args.out} is a file, not a folder", file=sys.stderr)
        return 2
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
    write_plots(rows, out, smooth=args.smooth)
    page = write_html(args.run_dir, out, rows)
    print(f"rollart report: {_steps(len(rows))} -> {page}")
    return 0
