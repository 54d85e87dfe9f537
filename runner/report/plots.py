"""The report's PNGs: the main metric against each swept parameter, and the learning curves (mean ± std over
seeds) from the runs' metrics.jsonl, drawn in the runner's one figure style (`runner.plots`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from runner.report.runs import Group, Report
from runner.report.values import hashable, is_number, params_label, show, slug, sort_key


def plot(report: Report, out: Path) -> list[Path]:
    """Write the PNGs into `out`; return their paths."""
    from runner.plots import DPI, new_figure

    written = []
    for param in report.swept:
        fig, ax = new_figure((5, 3.6))
        _plot_against(ax, report, param)
        path = out / f"report_{slug(param)}.png"
        fig.savefig(path, dpi=DPI)
        written.append(path)
    curves = [(g, _curves(g, report.metric)) for g in report.groups]
    if any(c for _, c in curves):
        fig, axes = new_figure((10, 3.6), 1, 2)
        best = report.best()
        for g, per_key in curves:
            label = params_label(g.params) or "all runs"
            for ax, key in zip(axes, ("train/loss", report.metric)):
                if key in per_key:
                    x, mean, std = per_key[key]
                    (line,) = ax.plot(x, mean, label=label, lw=2.2 if g is best else 1.2,
                                      marker="o" if len(x) <= 20 else None, ms=3)  # fmt: skip
                    ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2, lw=0)
        for ax, key in zip(axes, ("train/loss", report.metric)):
            ax.set(xlabel="epoch", ylabel=key, title=key)
        if 1 < len(curves) <= 10:
            axes[1].legend(fontsize=7)
        path = out / "report_curves.png"
        fig.savefig(path, dpi=DPI)
        written.append(path)
    return written


def _plot_against(ax, report: Report, param: str) -> None:
    """Mean ± std of the metric against `param`; one line per setting of the other swept parameters."""
    others = [k for k in report.swept if k != param]
    values = sorted({hashable(g.params[param]) for g in report.groups}, key=sort_key)
    numeric = all(is_number(v) for v in values)
    position = {v: (float(v) if numeric else i) for i, v in enumerate(values)}
    lines: dict[tuple, list] = {}
    for g in report.groups:
        lines.setdefault(tuple(hashable(g.params[k]) for k in others), []).append(g)
    as_lines = len(lines) <= 8 and max(len(gs) for gs in lines.values()) > 1  # else a scatter (Optuna)
    for rest, gs in lines.items() if as_lines else [((), report.groups)]:
        gs = sorted(gs, key=lambda g: position[hashable(g.params[param])])
        x = [position[hashable(g.params[param])] for g in gs]
        stats = [g.stats(report.metric) for g in gs]
        label = params_label(dict(zip(others, rest))) if as_lines else None
        ax.errorbar(x, [s[0] for s in stats], yerr=[0 if math.isnan(s[1]) else s[1] for s in stats],
                    marker="o", capsize=3, ls="-" if as_lines else "none", label=label or None)  # fmt: skip
    if numeric and min(position.values()) > 0 and max(position.values()) / min(position.values()) >= 10:
        ax.set_xscale("log")
    if not numeric:
        ax.set_xticks(list(position.values()), [show(v) for v in values])
    ax.set(xlabel=param, ylabel=report.metric, title=f"{report.metric} vs {param}")
    if as_lines and others:
        ax.legend(fontsize=7)


def _curves(group: Group, metric: str) -> dict:
    """{key: (epochs, mean, std)} over the group's runs, for train/loss and the metric, where logged."""
    import numpy as np

    out = {}
    histories = []
    for r in group.runs:
        path = r.dir / "metrics.jsonl"
        if path.exists():
            histories.append([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    for key in ("train/loss", metric):
        series = [[(rec.get("epoch", rec.get("step", i)), rec[key]) for i, rec in enumerate(h)
                   if is_number(rec.get(key))] for h in histories]  # fmt: skip
        series = [s for s in series if s]
        if not series:
            continue
        n = min(len(s) for s in series)  # runs cut short: the common prefix
        values = np.array([[v for _, v in s[:n]] for s in series], dtype=float)
        std = values.std(0, ddof=1) if len(values) > 1 else np.zeros(n)  # as in the table
        out[key] = (np.array([e for e, _ in series[0][:n]], dtype=float), values.mean(0), std)
    return out
