"""The report as text: Markdown (the table with the papers' numbers, the claims' verdicts, Optuna's pick,
the skipped runs and the plots), or its table alone as CSV or a LaTeX tabular."""

from __future__ import annotations

import csv
import io
import math
import re
from pathlib import Path

import yaml

from runner.report.claims import check_claims, paper_table
from runner.report.runs import REPLICATE_KEY, WALL_KEY, Report, Run
from runner.report.values import hashable, is_number, mean_std, show

FORMATS = {"markdown": "report.md", "csv": "report.csv", "latex": "report.tex"}
_TEX_ESCAPES = {"\\": r"\textbackslash{}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                **{c: "\\" + c for c in "&%$#_{}"}}  # fmt: skip


def markdown(report: Report, plots: list[Path] = ()) -> str:
    """The report as Markdown: a line of counts, the table, Optuna's pick, skipped runs, plots."""
    counts = {s: sum(r.status == s for r in report.runs) for s in ("ok", "pruned", "failed", "incomplete")}
    pruned = f"{counts['pruned']} pruned, " if counts["pruned"] else ""
    lines = [
        f"# {report.root}",
        "",
        f"{len(report.runs)} runs: {counts['ok']} completed, {pruned}{counts['failed']} failed, "
        f"{counts['incomplete']} incomplete. "
        + (f"Swept: {', '.join(report.swept)}. " if report.swept else "")
        + f"Mean ± std over seeds; best ({report.direction} {report.metric}) in bold.",
    ]
    wall = [r.summary[WALL_KEY] for g in report.groups for r in g.runs if is_number(r.summary.get(WALL_KEY))]
    if wall:
        lines[-1] += f" Wall time {sum(wall) / 60:.1f} min in all, {min(wall):.3g}-{max(wall):.3g} s per run."
    tested = tested_models(report)
    if tested:
        lines[-1] += f" {tested}"
    if report.groups:
        lines += ["", *table(report)]
    paper = paper_table(report)
    if paper:
        lines += ["", "The paper's numbers (its preset's `paper:`) for the rows that ran its setting:", ""]
        lines += paper
    claims = check_claims(report, report.claims)
    if claims:
        lines += ["", "Claims:"] + [f"- {verdict}: {line}" for verdict, line in claims]
    results = report.root / "optimization_results.yaml"
    if results.exists():  # written by the Optuna sweeper
        best = yaml.safe_load(results.read_text()) or {}
        if "best_params" in best:
            from runner.schema import objective_key  # what the search optimised: val/acc for test/acc

            params = " ".join(f"{k}={show(v)}" for k, v in best["best_params"].items())
            value = show(best.get("best_value"))
            lines += ["", f"Optuna best: {params} -> {objective_key(report.metric)} = {value}"]
    if report.skipped:
        lines += ["", "Skipped runs:"]
        for r in report.skipped:
            reason = {"failed": "error", "pruned": "pruned"}.get(r.status)  # the summary.json key saying why
            why = f": {r.summary[reason]}" if reason else " (no summary.json)"
            lines.append(f"- {_label(r, report)}: {r.status}{why}")
    if plots:
        lines += [""] + [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def tested_models(report: Report) -> str:
    """Which weights the runs' numbers are of (their `tested_model`: `train.select`, or a method's own
    rule), as a sentence; "" for runs that do not say."""
    rules = sorted({str(r.summary["tested_model"]) for g in report.groups for r in g.runs
                    if "tested_model" in r.summary})  # fmt: skip
    if not rules:
        return ""
    named = [
        "the last epoch's" if rule == "last" else f"the best epoch's by {rule.removeprefix('best:')} ({rule})"
        for rule in rules
    ]
    return f"Tested model: {' and '.join(named)}; a `_last` column is the last epoch's."


def table(report: Report) -> list[str]:
    """The table in Markdown: mean ± std per setting and column, the best setting's main metric in bold."""
    rows = _grid(report, lambda mean, std, n: mean_std(mean, std) if n else "-", lambda text: f"**{text}**")
    rows.insert(1, ["---"] * len(rows[0]))
    return ["| " + " | ".join(r) + " |" for r in rows]


def latex(report: Report) -> str:
    """The table as a LaTeX tabular (booktabs rules): $mean \\pm std$, the best setting's main metric in
    bold; parameter columns left-aligned, numbers right-aligned."""

    def cell(mean, std, n):
        return "$" + mean_std(mean, std).replace("±", r"\pm") + "$" if n else "--"

    rows = _grid(report, cell, lambda text: r"$\mathbf{" + text.strip("$") + "}$", label=_tex)
    align = "l" * len(report.swept) + "r" * (len(rows[0]) - len(report.swept))
    lines = [rf"\begin{{tabular}}{{{align}}}", r"\toprule", " & ".join(rows[0]) + r" \\", r"\midrule"]
    lines += [" & ".join(r) + r" \\" for r in rows[1:]]
    return "\n".join([*lines, r"\bottomrule", r"\end{tabular}"]) + "\n"


def csv_table(report: Report) -> str:
    """The table as CSV, for a spreadsheet: the same rows, numbers at full precision, each column's std
    beside its mean (`<key> std`, empty for one seed), empty cells where no run logged a value."""
    timed = _timed(report)
    header = [*report.swept, "seeds", *(c for key in report.columns for c in (key, f"{key} std"))]
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header + (["wall s"] if timed else []))
    for g in report.groups:
        row = [*(hashable(v) for v in g.params.values()), len(g.runs)]
        for key in report.columns:
            mean, std, n = g.stats(key)
            row += [mean if n else "", "" if math.isnan(std) else std]
        if timed:
            mean, _, n = g.stats(WALL_KEY)
            row.append(mean if n else "")
        writer.writerow(row)
    return out.getvalue()


def _grid(report: Report, cell, bold, label=str) -> list[list[str]]:
    """The table's cells, the header row first: per setting its parameter values, its number of seeds,
    `cell(mean, std, n)` per column (through `bold` for the best setting's main metric), and a last
    column `wall s`, the mean wall time of its runs, where runs recorded it. `label` escapes the names
    and parameter values."""
    best = report.best()
    timed = _timed(report)
    rows = [[label(h) for h in [*report.swept, "seeds", *report.columns] + (["wall s"] if timed else [])]]
    for g in report.groups:
        row = [label(show(v)) for v in g.params.values()] + [str(len(g.runs))]
        for key in report.columns:
            mean, std, n = g.stats(key)
            text = cell(mean, std, n)
            row.append(bold(text) if n and g is best and key == report.metric else text)
        if timed:
            mean, _, n = g.stats(WALL_KEY)
            row.append(f"{mean:.3g}" if n else cell(mean, math.nan, 0))
        rows.append(row)
    return rows


def _timed(report: Report) -> bool:
    """Whether the table ends in a `wall s` column: runs recorded their wall time, not already a column."""
    return WALL_KEY not in report.columns and any(g.stats(WALL_KEY)[2] for g in report.groups)


def _tex(text: str) -> str:
    """`text` with LaTeX's special characters escaped."""
    return re.sub(r"[\\&%$#_{}~^]", lambda m: _TEX_ESCAPES[m.group()], text)


def _label(run: Run, report: Report) -> str:
    """A run's dir (relative to the report's root) and its swept values."""
    name = str(run.dir.relative_to(report.root)) if run.dir != report.root else run.dir.name
    keys = [*report.swept, REPLICATE_KEY]
    values = " ".join(f"{k}={show(run.value(k))}" for k in keys if k in run.overrides)
    return f"{name} ({values})" if values else name


def render(report: Report, format: str) -> str:
    """The report as `format` prints it: all of it in Markdown; the table alone as CSV or LaTeX."""
    return {"markdown": markdown, "csv": csv_table, "latex": latex}[format](report)
