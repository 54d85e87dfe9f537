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
`SweepSummary` (callback.py) is the Hydra callback that prints the same table at the end of every multirun.

Beside the runs, the papers: a row that ran a paper preset's setting (`paper_setting`) gets the preset's
`paper:` numbers and the difference (ours - paper); the claims of conf/claims.yaml about the preset a
sweep ran (the CPU studies) are checked on its rows and printed as holds / fails with the numbers.

The modules: runs.py reads and groups the runs, render.py writes the table (Markdown, CSV, LaTeX),
claims.py compares with the papers and checks the claims, plots.py draws, callback.py is the sweep's
callback, command.py the `runner-report` command; values.py reads, compares and shows the runs' values.
"""

from runner.report.callback import SweepSummary, cancel_sweep_summary, print_sweep_summary
from runner.report.claims import SETTING_FREE, check_claims, paper_setting, paper_table
from runner.report.command import main, write_report
from runner.report.plots import plot
from runner.report.render import FORMATS, csv_table, latex, markdown, render, table, tested_models
from runner.report.runs import (
    CLAIMS_FILE,
    REPLICATE_KEY,
    WALL_KEY,
    Group,
    Report,
    Run,
    build_report,
    find_runs,
    load_claims,
    load_run,
    task_metric,
)

__all__ = [
    "CLAIMS_FILE",
    "FORMATS",
    "REPLICATE_KEY",
    "SETTING_FREE",
    "WALL_KEY",
    "Group",
    "Report",
    "Run",
    "SweepSummary",
    "build_report",
    "cancel_sweep_summary",
    "check_claims",
    "csv_table",
    "find_runs",
    "latex",
    "load_claims",
    "load_run",
    "main",
    "markdown",
    "paper_setting",
    "paper_table",
    "plot",
    "print_sweep_summary",
    "render",
    "table",
    "task_metric",
    "tested_models",
    "write_report",
]
