"""`runner-report PATH`: write report.md (and report.csv / report.tex) and the plots, print the report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from runner.report.plots import plot
from runner.report.render import FORMATS, markdown, render
from runner.report.runs import CLAIMS_FILE, Report, build_report


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
