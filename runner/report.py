"""`runner-report PATH`: the runs under a run or multirun dir as a Markdown table and PNG plots.

A run is a Hydra job dir (`.hydra/overrides.yaml`) with the runner's resolved `config.yaml`, its
`summary.json` and its per-epoch `metrics.jsonl`. The parameters that differ between runs are the swept
ones; runs that differ only in `seed` are replicates of one setting. Written into PATH:

    report.md                    one row per setting: mean ± std over its seeds, the best setting in bold
    report.csv | report.tex      with --format csv | latex: the same table, for a spreadsheet | a paper
    report_<param>.png           the main metric against each swept parameter
    report_curves.png            learning curves (mean ± std over seeds) from metrics.jsonl

The main metric and its direction are the task's `metric`, or the preset's top-level `metric`. Failed
runs (`summary.json` holding an `error`), trials an Optuna pruner stopped (`pruned`) and incomplete ones
(no `summary.json`: killed, still running) are listed, never averaged.
`SweepSummary` is the Hydra callback that prints the same table at the end of every multirun.

Beside the runs, the papers: a row that ran a paper preset's setting (`paper_setting`) gets the preset's
`paper:` numbers and the difference (ours - paper); the claims of conf/claims.yaml about the preset a
sweep ran (the CPU studies) are checked on its rows and printed as holds / fails with the numbers.
"""

from __future__ import annotations

import argparse
import atexit
import csv
import functools
import io
import json
import logging
import math
import operator
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from runner.configs import TASKS
from runner.schema import ConfigError, main_metric

log = logging.getLogger(__name__)

REPLICATE_KEY = "seed"
WALL_KEY = "time/total_s"  # written by the CLI into every summary.json: the job's wall time
MAX_EXTRA_COLUMNS = 4
_SKIP_DIRS = {".hydra", ".submitit", "wandb", "checkpoints"}
CLAIMS_FILE = Path(__file__).resolve().parents[1] / "conf" / "claims.yaml"
# Overrides that say where or how a run ran, not what it measures: with them a run still ran its preset.
SETTING_FREE = (
    "seed", "experiment", "name", "hydra", "hardware", "logger", "dataset.root", "dataset.download",
    "dataset.imagenet_val", "model.pretrained", "method.base_checkpoint", "train.progress",
    "train.checkpoint", "train.checkpoint_every_minutes", "train.resume", "train.eval_batch_size",
)  # fmt: skip
_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}
_TEX_ESCAPES = {"\\": r"\textbackslash{}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                **{c: "\\" + c for c in "&%$#_{}"}}  # fmt: skip
FORMATS = {"markdown": "report.md", "csv": "report.csv", "latex": "report.tex"}


@dataclass
class Run:
    dir: Path
    overrides: dict[str, str]  # key -> value, as given on the command line (or chosen by the sweeper)
    config: dict
    summary: dict | None  # None: no summary.json yet
    paper: dict = field(default_factory=dict)  # its preset's `paper:` block: {metric: {value, table}}

    @property
    def status(self) -> str:
        if self.summary is None:
            return "incomplete"
        if "pruned" in self.summary:  # stopped early by the search (runner.sweeper): partial metrics
            return "pruned"
        return "failed" if "error" in self.summary else "ok"

    def value(self, key: str):
        """The run's value of a (possibly swept) key: its override, else its resolved config value."""
        if key in self.overrides:
            return _parse_scalar(self.overrides[key])
        return _at(self.config, key)


@dataclass
class Group:
    """The runs of one setting of the swept parameters (its seeds)."""

    params: dict
    runs: list[Run] = field(default_factory=list)

    def stats(self, key: str) -> tuple[float, float, int]:
        """(mean, sample std, count) of a summary value over the group's runs; std is nan for one run."""
        values = [float(r.summary[key]) for r in self.runs if _is_number(r.summary.get(key))]
        if not values:
            return math.nan, math.nan, 0
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else math.nan
        return mean, math.sqrt(var), len(values)


@dataclass
class Report:
    root: Path
    runs: list[Run]
    swept: list[str]  # swept parameters (seed excluded)
    groups: list[Group]  # settings with at least one completed run, sorted by parameter values
    metric: str
    direction: str  # "max" | "min"
    columns: list[str]  # summary keys tabled, the main metric first
    claims: dict = field(default_factory=dict)  # {preset name: [claim, ...]}, as in conf/claims.yaml

    @property
    def skipped(self) -> list[Run]:
        return [r for r in self.runs if r.status != "ok"]

    def best(self) -> Group | None:
        scored = [g for g in self.groups if g.stats(self.metric)[2]]
        if len(scored) < 2:
            return None
        pick = max if self.direction == "max" else min
        return pick(scored, key=lambda g: g.stats(self.metric)[0])


# ----------------------------------------------------------------------------------------- reading


def find_runs(root: Path) -> list[Run]:
    """Every run dir under `root` (itself included), in natural order of their paths."""
    runs = []
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        if (here / ".hydra" / "overrides.yaml").exists():
            runs.append(load_run(here))
    return sorted(runs, key=lambda r: _natural_key(str(r.dir.relative_to(root))))


def load_run(run_dir: Path) -> Run:
    overrides = {}
    for item in yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []:
        key, eq, value = str(item).partition("=")
        overrides[key.lstrip("+~")] = value if eq else "(deleted)"
    config_path = run_dir / "config.yaml"  # the validated config; Hydra's own copy if the job died before
    if not config_path.exists():
        config_path = run_dir / ".hydra" / "config.yaml"
    config = (yaml.safe_load(config_path.read_text()) if config_path.exists() else None) or {}
    composed = run_dir / ".hydra" / "config.yaml"  # Hydra's composed config holds the preset's `paper:`
    paper = config.get("paper")
    if not paper and composed.exists():
        paper = (yaml.safe_load(composed.read_text()) or {}).get("paper")
    summary_path = run_dir / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    except json.JSONDecodeError:  # cut off mid-write
        summary = None
    return Run(run_dir, overrides, config, summary, paper or {})


def task_metric(config: dict) -> tuple[str, str]:
    """The task's main metric `(key, "max" | "min")` for a run config."""
    from runner.task import task_named

    task = (config.get("method") or {}).get("task", "classify")
    if task not in TASKS:
        choices = ", ".join(TASKS)
        raise ValueError(f"task {task!r} is no registered task ({choices}); pass --metric KEY[:max|min]")
    return main_metric(config, task_named(task).metric)


def build_report(
    root, metric: str | None = None, columns: list[str] | None = None, claims=CLAIMS_FILE, by=None
) -> Report:
    """Read, group and order the runs under `root`. `metric` is `KEY` or `KEY:max|min`; `claims` the
    claims file to check; `by` the keys that make a group (default: the swept ones), e.g. the runs'
    `name` or `logger.tags` across several sweeps."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: no such directory")
    runs = find_runs(root)
    if not runs:
        raise ValueError(f"{root}: no runs found (a run dir holds .hydra/overrides.yaml)")
    done = [r for r in runs if r.status == "ok"]
    keys = list(dict.fromkeys(k for r in runs for k in r.overrides))
    swept = [k for k in keys if k != REPLICATE_KEY and len({_hashable(r.value(k)) for r in runs}) > 1]
    if by:
        swept = list(by)

    if metric is None:
        key, direction = task_metric((done or runs)[0].config)
    else:
        key, _, direction = metric.partition(":")
        direction = direction or "max"
        if direction not in ("max", "min"):
            raise ValueError(f"--metric {metric}: the direction after ':' must be max or min")
    numeric = list(dict.fromkeys(k for r in done for k in r.summary if _is_number(r.summary[k])))
    if done and not any(key in r.summary for r in done):
        raise ValueError(f"metric {key!r} is in no summary.json; keys: {', '.join(numeric)}")
    unknown = [c for c in columns or () if done and c not in numeric]
    if unknown:
        raise ValueError(f"--columns {','.join(unknown)}: in no summary.json; choices: {', '.join(numeric)}")

    groups: dict[tuple, Group] = {}
    for r in done:
        params = {k: r.value(k) for k in swept}
        groups.setdefault(tuple(_hashable(v) for v in params.values()), Group(params)).runs.append(r)
    ordered = sorted(groups.values(), key=lambda g: [_sort_key(v) for v in g.params.values()])

    if columns is None:  # the main metric, then its siblings (test/acc -> test/loss, ...)
        prefix = key.split("/")[0] + "/" if "/" in key else None
        siblings = [k for k in numeric if prefix and k.startswith(prefix) and k != key]
        columns = [key, *siblings[:MAX_EXTRA_COLUMNS]]
    elif key not in columns:
        columns = [key, *columns]
    return Report(root, runs, swept, ordered, key, direction, columns, load_claims(claims))


# -------------------------------------------------------------------------------------- the table


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
    wall = [r.summary[WALL_KEY] for g in report.groups for r in g.runs if _is_number(r.summary.get(WALL_KEY))]
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

            params = " ".join(f"{k}={_show(v)}" for k, v in best["best_params"].items())
            value = _show(best.get("best_value"))
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
    rows = _grid(report, lambda mean, std, n: _mean_std(mean, std) if n else "-", lambda text: f"**{text}**")
    rows.insert(1, ["---"] * len(rows[0]))
    return ["| " + " | ".join(r) + " |" for r in rows]


def latex(report: Report) -> str:
    """The table as a LaTeX tabular (booktabs rules): $mean \\pm std$, the best setting's main metric in
    bold; parameter columns left-aligned, numbers right-aligned."""

    def cell(mean, std, n):
        return "$" + _mean_std(mean, std).replace("±", r"\pm") + "$" if n else "--"

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
        row = [*(_hashable(v) for v in g.params.values()), len(g.runs)]
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
        row = [label(_show(v)) for v in g.params.values()] + [str(len(g.runs))]
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


# ------------------------------------------------------------------------------ the papers' numbers


def paper_setting(run: Run) -> bool:
    """Whether `run` ran the setting its preset's `paper:` numbers are for: the method the preset is named
    after (csot_cifar10: csot; hier_hash_imagenet32_npairs: hier_hash), and every override that changes
    what is measured (all but `SETTING_FREE`) at the value the preset itself gives that key."""
    experiment, method = run.value("experiment"), run.value("method")
    if not run.paper or not isinstance(experiment, str) or not experiment.startswith(f"{method}_"):
        return False
    preset = _preset(experiment, method if "method" in run.overrides else None)
    return preset is not None and all(
        _same(run.value(key), _at(preset, key))
        for key in run.overrides
        if not any(key == k or key.startswith(k + ".") for k in SETTING_FREE)
    )


@functools.cache
def _preset(experiment: str, method: str | None) -> dict | None:
    """The config `+experiment=NAME` composes to (after `+method=` where the run gave one)."""
    from runner.compose import compose

    overrides = ([f"+method={method}"] if method else []) + [f"+experiment={experiment}"]
    try:
        return OmegaConf.to_container(compose(overrides), resolve=True)
    except Exception as e:  # renamed or removed since the sweep ran: its runs get no paper numbers
        log.warning("runner-report: no paper numbers for +experiment=%s: %s", experiment, e)
        return None


def paper_table(report: Report) -> list[str]:
    """Per row that ran a paper preset's setting and per metric of its `paper:` block: ours (mean ± std
    over seeds), the paper's value, ours - paper, and the paper's table; [] when no row did."""
    header = [*report.swept, "metric", "ours", "paper", "ours - paper", "source"]
    rows = []
    for g in report.groups:
        if not paper_setting(g.runs[0]):
            continue
        for metric, entry in g.runs[0].paper.items():
            mean, std, n = g.stats(metric)
            value = float(entry["value"])
            ours, diff = ("-", "-") if n == 0 else (_mean_std(mean, std), f"{mean - value:+.4g}")
            params = [_show(v) for v in g.params.values()]
            rows.append([*params, metric, ours, _show(value), diff, entry["table"]])
    if not rows:
        return []
    return ["| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows]]


# ------------------------------------------------------------------------------------------- claims


def load_claims(path=CLAIMS_FILE) -> dict:
    """{preset name: [claim, ...]} from a claims file (conf/claims.yaml describes the format)."""
    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ValueError(f"--claims {path}: {e.strerror}") from None


def check_claims(report: Report, claims: dict) -> list[tuple[str, str]]:
    """(verdict, line) per claim about a preset the report's runs ran: verdict holds | fails | untested
    (a side has no row, or several) | not comparable (the runs leave the preset's recipe: its epochs, its
    data), the line the claim with its numbers or how the runs differ."""
    out = []
    experiments = dict.fromkeys(g.runs[0].value("experiment") for g in report.groups)
    for experiment in experiments:
        rows = [g for g in report.groups if g.runs[0].value("experiment") == experiment]
        off_recipe = _off_recipe(rows, _preset(experiment, None)) if isinstance(experiment, str) else None
        for claim in claims.get(experiment, []) if isinstance(experiment, str) else ():
            head = f"{claim['claim']} ({experiment}; {claim.get('source', 'no source')})"
            if off_recipe:
                out.append(("not comparable", f"{head}: {off_recipe}"))
                continue
            when = claim.get("when") or {}
            (left, left_text), (right, right_text) = (_side(claim[s], when, rows) for s in ("left", "right"))
            if left is None or right is None:
                out.append(("untested", f"{head}: {left_text if left is None else right_text}"))
                continue
            verdict = "holds" if _OPS[claim["op"]](left, right) else "fails"
            out.append((verdict, f"{head}: {left_text} {claim['op']} {right_text}"))
    return out


def _off_recipe(rows: list[Group], preset: dict | None) -> str | None:
    """How the runs of `rows` leave their preset's recipe, whose claims hold of it alone (fewer epochs,
    another dataset, a subset of it: a smoke run at chance accuracy "held" a claim); None if they follow
    it."""
    if preset is None:
        return None
    recipe = {"epochs": preset["train"]["epochs"], "dataset": preset["dataset"]["name"],
              "max_train": preset["dataset"].get("max_train", 0)}  # fmt: skip
    for run in (r for g in rows for r in g.runs):
        ran = {"epochs": _at(run.config, "train.epochs"), "dataset": _at(run.config, "dataset.name"),
               "max_train": _at(run.config, "dataset.max_train")}  # fmt: skip
        if ran["epochs"] is not None and ran["epochs"] != recipe["epochs"]:
            return f"{ran['epochs']} of {recipe['epochs']} epochs"
        if ran["dataset"] is not None and ran["dataset"] != recipe["dataset"]:
            return f"dataset {ran['dataset']}, not {recipe['dataset']}"
        if ran["max_train"] and ran["max_train"] != recipe["max_train"]:
            return f"{ran['max_train']} training samples (dataset.max_train), not all"
    return None


def _side(side: dict, when: dict, rows: list[Group]) -> tuple[float | None, str]:
    """A claim's side: (value, how it was computed), or (None, why it could not be)."""
    if "gap" in side:
        return _gap_side(side, {**when, **(side.get("when") or {})}, rows)
    times, plus = float(side.get("times", 1)), float(side.get("plus", 0))
    if "metric" not in side:
        return plus, _show(plus)
    when = {**when, **(side.get("when") or {})}
    picked = " ".join(f"{k}={_show(v)}" for k, v in when.items())
    matches = [g for g in rows if all(_same(r.value(k), v) for r in g.runs for k, v in when.items())]
    if len(matches) != 1:
        return None, f"{len(matches)} rows with {picked or 'any setting'} (need 1)"
    metric, stat = side["metric"], side.get("stat", "mean")
    values = [float(r.summary[metric]) for r in matches[0].runs if _is_number(r.summary.get(metric))]
    if not values:
        return None, f"no {metric} in the runs with {picked}"
    value = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}[stat]
    text = f"{'' if stat == 'mean' else stat + ' '}{metric}" + (f" [{picked}]" if picked else "")
    text += f" {value:.4g}" + (f" x {_show(times)}" if times != 1 else "")
    text += f" {'+-'[plus < 0]} {_show(abs(plus))}" if plus else ""
    if times != 1 or plus:
        text += f" = {value * times + plus:.4g}"
    return value * times + plus, text


def _gap_side(side: dict, when: dict, rows: list[Group]) -> tuple[float | None, str]:
    """The point the fraction `gap` of the way from the side `from` to the side `to` (e.g. from CE on
    noisy labels to CE on clean ones): from + gap x (to - from)."""
    (low, low_text), (high, high_text) = (_side(side[end], when, rows) for end in ("from", "to"))
    if low is None or high is None:
        return None, low_text if low is None else high_text
    gap = float(side["gap"])
    value = low + gap * (high - low)
    return value, f"{low_text} + {_show(gap)} x ({high_text} - {low:.4g}) = {value:.4g}"


def _mean_std(mean: float, std: float) -> str:
    """Four significant digits of the mean; the std to the same decimal place."""
    digits = 3 - math.floor(math.log10(abs(mean))) if mean and math.isfinite(mean) else 4
    digits = min(max(digits, 0), 8)
    return f"{mean:.{digits}f}" + ("" if math.isnan(std) else f" ± {std:.{digits}f}")


# ------------------------------------------------------------------------------------------ plots


def plot(report: Report, out: Path) -> list[Path]:
    """Write the PNGs into `out`; return their paths."""
    from runner.plots import DPI, new_figure

    written = []
    for param in report.swept:
        fig, ax = new_figure((5, 3.6))
        _plot_against(ax, report, param)
        path = out / f"report_{_slug(param)}.png"
        fig.savefig(path, dpi=DPI)
        written.append(path)
    curves = [(g, _curves(g, report.metric)) for g in report.groups]
    if any(c for _, c in curves):
        fig, axes = new_figure((10, 3.6), 1, 2)
        best = report.best()
        for g, per_key in curves:
            label = _params_label(g.params) or "all runs"
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
    values = sorted({_hashable(g.params[param]) for g in report.groups}, key=_sort_key)
    numeric = all(_is_number(v) for v in values)
    position = {v: (float(v) if numeric else i) for i, v in enumerate(values)}
    lines: dict[tuple, list] = {}
    for g in report.groups:
        lines.setdefault(tuple(_hashable(g.params[k]) for k in others), []).append(g)
    as_lines = len(lines) <= 8 and max(len(gs) for gs in lines.values()) > 1  # else a scatter (Optuna)
    for rest, gs in lines.items() if as_lines else [((), report.groups)]:
        gs = sorted(gs, key=lambda g: position[_hashable(g.params[param])])
        x = [position[_hashable(g.params[param])] for g in gs]
        stats = [g.stats(report.metric) for g in gs]
        label = _params_label(dict(zip(others, rest))) if as_lines else None
        ax.errorbar(x, [s[0] for s in stats], yerr=[0 if math.isnan(s[1]) else s[1] for s in stats],
                    marker="o", capsize=3, ls="-" if as_lines else "none", label=label or None)  # fmt: skip
    if numeric and min(position.values()) > 0 and max(position.values()) / min(position.values()) >= 10:
        ax.set_xscale("log")
    if not numeric:
        ax.set_xticks(list(position.values()), [_show(v) for v in values])
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
                   if _is_number(rec.get(key))] for h in histories]  # fmt: skip
        series = [s for s in series if s]
        if not series:
            continue
        n = min(len(s) for s in series)  # runs cut short: the common prefix
        values = np.array([[v for _, v in s[:n]] for s in series], dtype=float)
        std = values.std(0, ddof=1) if len(values) > 1 else np.zeros(n)  # as in the table
        out[key] = (np.array([e for e, _ in series[0][:n]], dtype=float), values.mean(0), std)
    return out


# ------------------------------------------------------------------------------------------ helpers


def _parse_scalar(text: str):
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            number = float(value)
            return number if math.isfinite(number) else value
        except ValueError:
            pass
    return value


def _at(config: dict, key: str):
    """`config`'s value at a dotted key; a config group (model=cnn) gives its name."""
    node = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node = node.get("name")
    return node


def _same(a, b) -> bool:
    if _is_number(a) and _is_number(b):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return _hashable(a) == _hashable(b)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _hashable(v):
    return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v


def _sort_key(v):
    return (0, float(v), "") if _is_number(v) else (1, 0.0, str(v))


def _show(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _natural_key(text: str) -> list:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _params_label(params: dict) -> str:
    return ", ".join(f"{k}={_show(v)}" for k, v in params.items())


def _label(run: Run, report: Report) -> str:
    """A run's dir (relative to the report's root) and its swept values."""
    name = str(run.dir.relative_to(report.root)) if run.dir != report.root else run.dir.name
    keys = [*report.swept, REPLICATE_KEY]
    values = " ".join(f"{k}={_show(run.value(k))}" for k in keys if k in run.overrides)
    return f"{name} ({values})" if values else name


# ------------------------------------------------------------------------------- entry points


def write_report(
    root,
    metric: str | None = None,
    columns: list[str] | None = None,
    out=None,
    claims=CLAIMS_FILE,
    format: str = "markdown",
    by=None,
) -> Report:
    """Build the report for `root`, write report.md and the plots into `out` (default: `root`), and with
    `format` csv or latex the table as report.csv or report.tex too."""
    report = build_report(root, metric, columns, claims, by)
    out = Path(out) if out is not None else report.root
    out.mkdir(parents=True, exist_ok=True)
    plots = plot(report, out) if report.groups else []
    (out / "report.md").write_text(markdown(report, plots))
    if format != "markdown":
        (out / FORMATS[format]).write_text(render(report, format))
    return report


def render(report: Report, format: str) -> str:
    """The report as `format` prints it: all of it in Markdown; the table alone as CSV or LaTeX."""
    return {"markdown": markdown, "csv": csv_table, "latex": latex}[format](report)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="runner-report",
        description="Table (mean ± std over seeds) and plots of every run under a run or multirun dir.",
    )
    parser.add_argument("path", type=Path, help="a run dir, or a multirun dir holding run dirs")
    parser.add_argument("--metric", help="KEY or KEY:max|min (default: the task's main metric)")
    parser.add_argument("--columns", help="comma-separated summary keys to table (default: the metric's kin)")
    parser.add_argument("--out", type=Path, help="where to write report.md and the PNGs (default: PATH)")
    parser.add_argument("--by", help="comma-separated keys to group by (default: the swept ones; e.g. name)")
    parser.add_argument(
        "--format",
        choices=list(FORMATS),
        default="markdown",
        help="what to print: the Markdown report, or its table as CSV or a LaTeX tabular (also written "
        "to report.csv / report.tex)",
    )
    parser.add_argument(
        "--claims", type=Path, default=CLAIMS_FILE, help="the claims to check (conf/claims.yaml)"
    )
    args = parser.parse_args(argv)
    columns = [c for c in args.columns.split(",") if c] if args.columns else None
    try:
        by = [k for k in args.by.split(",") if k] if args.by else None
        report = write_report(args.path, args.metric, columns, args.out, args.claims, args.format, by)
    except ValueError as e:
        parser.exit(2, f"runner-report: error: {e}\n")
    except OSError as e:  # a read-only or full place to write to
        parser.exit(
            2,
            f"runner-report: error: cannot write {e.filename} ({e.strerror}); give --out a writable folder\n",
        )
    out = args.out or args.path
    print(render(report, args.format), end="")
    written = ", ".join(str(out / FORMATS[f]) for f in dict.fromkeys(["markdown", args.format]))
    print(f"wrote {written} and the plots", file=sys.stderr)  # stdout: the report alone, to redirect
    if not report.groups:
        sys.exit(1)


def print_sweep_summary(sweep_dir) -> None:
    """The table of a finished (or failed) multirun, printed at its end; never raises."""
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # the sweep is over; composing a preset (paper numbers) needs Hydra
    try:
        text = markdown(build_report(sweep_dir))
    except Exception as e:  # a summary must not mask the sweep's own outcome
        print(f"runner: no sweep summary for {sweep_dir}: {e}", file=sys.stderr)
        return
    print(f"\n{text}\nPlots and report.md: runner-report {sweep_dir}", flush=True)


class SweepSummary(Callback):
    """Hydra callback (hydra.callbacks in conf/config.yaml): record failed and pruned jobs (the search
    stopped them: runner.sweeper) in their summary.json, summarize each multirun.

    Hydra's sweepers run every job of a batch, then raise the first failure, so `on_multirun_end` never
    runs after a failed job: the summary is printed at exit instead, after Hydra's own error report.
    """

    def on_multirun_start(self, config, **kwargs) -> None:
        atexit.register(print_sweep_summary, Path(config.hydra.sweep.dir))

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        from runner.faults import JobFailed
        from runner.sweeper import Pruned
        from runner.track import log_to_file

        if job_return.status != JobStatus.FAILED or config.hydra.mode != RunMode.MULTIRUN:
            return  # a single run reports its own failure
        error = job_return._return_value  # the exception; `.return_value` would re-raise it
        error = error.cause if isinstance(error, JobFailed) else error
        path = Path(config.hydra.runtime.output_dir) / "summary.json"
        summary = json.loads(path.read_text()) if path.exists() else {}
        num, overrides = (
            config.hydra.job.num,
            " ".join(OmegaConf.select(config, "hydra.overrides.task") or []),
        )
        if isinstance(error, Pruned):  # the search stopped a trial falling behind: no failure
            log.info("job %s: %s", num, error)
            print(f"#{num} pruned  {overrides}: {error}")
            summary["pruned"] = str(error)
        else:  # one line here; the traceback (unless a bad value's one line says it all) in the job's log
            log_file = Path(config.hydra.runtime.output_dir) / f"{config.hydra.job.name}.log"
            log_to_file(log, logging.ERROR, "job %s failed: %s", num, error,
                        exc_info=None if isinstance(error, ConfigError) else error)  # fmt: skip
            summary["error"] = f"{type(error).__name__}: {error}"  # what runner-report lists it by
            print(f"#{num} failed  {overrides}: {summary['error']} (log: {log_file})")
        path.write_text(json.dumps(summary, indent=2) + "\n")
        _release_frames(error)


def _release_frames(error: BaseException | None) -> None:
    """Clear the local variables of the frames in `error`'s traceback and its causes' (the lines stay).
    Hydra holds a failed job's exception until the sweep's batch ends: its frames would keep the job's
    model and tensors, a GPU's memory among them, while the next jobs run (after an out-of-memory stop,
    into the same error)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


if __name__ == "__main__":
    main()
