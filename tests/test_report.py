"""`runner-report` on hand-made run dirs: grouping, mean ± std, best row, skipped runs, plots, the table
as CSV and LaTeX."""

import csv
import gc
import io
import json
import logging
import re
import shutil
import statistics
import traceback
import weakref
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_cli_here
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from runner.compose import CONF_DIR, compose
from runner.faults import OutOfMemory
from runner.report import (
    SweepSummary,
    build_report,
    check_claims,
    csv_table,
    latex,
    load_claims,
    main,
    markdown,
)
from runner.sweeper import Pruned

PNG = b"\x89PNG\r\n\x1a\n"


def make_run(path: Path, overrides: list[str], summary: dict | None, curve: list[float] = (), config=None):
    """A run dir as the runner leaves it: Hydra's overrides, the resolved config, summary and metrics."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    cfg = config or {"seed": 0, "train": {"lr": 0.1, "epochs": len(curve)}, "model": {"name": "mlp"}}
    (path / "config.yaml").write_text(yaml.safe_dump(cfg))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    records = [{"step": i, "epoch": i + 1, "train/loss": 1 / (i + 1), "test/acc": acc}
               for i, acc in enumerate(curve)]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def grid(root: Path) -> dict:
    """A 2 x 2 sweep (lr x model) over 3 seeds, job dirs numbered as Hydra does; returns accs per cell."""
    accs, job = {}, 0
    for lr in (0.1, 0.05):
        for model in ("mlp", "cnn"):
            for seed in range(3):
                acc = 0.5 + lr + (0.2 if model == "cnn" else 0) + 0.01 * seed * (1 + job % 2)
                accs.setdefault((lr, model), []).append(acc)
                overrides = [f"train.lr={lr}", f"model={model}", f"seed={seed}"]
                make_run(root / str(job), overrides, {"test/acc": acc, "test/loss": 1 - acc, "epoch": 2},
                         [acc - 0.1, acc])  # fmt: skip
                job += 1
    return accs


def table_rows(text: str) -> list[list[str]]:
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def mean_std(cell: str) -> tuple[float, float]:
    mean, _, std = cell.strip("*").partition(" ± ")
    return float(mean), float(std) if std else float("nan")


def test_groups_by_swept_parameters_with_mean_std_over_seeds(tmp_path):
    accs = grid(tmp_path)
    report = build_report(tmp_path, metric="test/acc:max")
    assert report.swept == ["train.lr", "model"]  # seed is the replicate, not a parameter
    text = markdown(report)
    rows = table_rows(text)
    assert len(rows) == 4
    for lr_cell, model, n, acc_cell, loss_cell in rows:
        values = accs[(float(lr_cell), model)]
        assert n == "3"
        mean, std = mean_std(acc_cell)
        assert mean == pytest.approx(statistics.mean(values), abs=5e-5)
        assert std == pytest.approx(statistics.stdev(values), abs=5e-5)
        assert mean_std(loss_cell)[0] == pytest.approx(1 - statistics.mean(values), abs=5e-4)
    # Sorted numerically (0.05 before 0.1), then by name; the best (max) mean is the only bold cell.
    assert [(r[0], r[1]) for r in rows] == [("0.05", "cnn"), ("0.05", "mlp"), ("0.1", "cnn"), ("0.1", "mlp")]
    best = max(accs, key=lambda k: statistics.mean(accs[k]))
    assert [r[3].startswith("**") for r in rows] == [(float(r[0]), r[1]) == best for r in rows]
    assert text.count("**") == 2


def test_wall_time_column_is_the_mean_of_the_settings_runs_and_the_sweep_total_is_stated(tmp_path):
    walls = {0.1: [10.0, 14.0], 0.2: [3.0, 5.0]}
    job = 0
    for lr, times in walls.items():
        for seed, t in enumerate(times):
            summary = {"test/acc": lr, "time/total_s": t}
            make_run(tmp_path / str(job), [f"train.lr={lr}", f"seed={seed}"], summary)
            job += 1
    make_run(tmp_path / "9", ["train.lr=0.3", "seed=0"], {"test/acc": 0.3})  # an older run without it
    text = markdown(build_report(tmp_path, metric="test/acc"))
    header = [ln for ln in text.splitlines() if ln.startswith("|")][0]
    assert header.rstrip(" |").endswith("wall s")
    assert [(r[0], r[-1]) for r in table_rows(text)] == [("0.1", "12"), ("0.2", "4"), ("0.3", "-")]
    assert "Wall time 0.5 min in all, 3-14 s per run." in text


def test_min_direction_marks_the_lowest_mean(tmp_path):
    accs = grid(tmp_path)
    report = build_report(tmp_path, metric="test/loss:min")
    assert report.columns == ["test/loss", "test/acc"]
    (bold,) = [r for r in table_rows(markdown(report)) if r[3].startswith("**")]
    best = max(accs, key=lambda k: statistics.mean(accs[k]))  # loss = 1 - acc
    assert (float(bold[0]), bold[1]) == best == (0.1, "cnn")


def test_failed_and_incomplete_runs_are_listed_not_averaged(tmp_path):
    make_run(tmp_path / "0", ["train.lr=0.1", "seed=0"], {"test/acc": 0.9})
    make_run(tmp_path / "1", ["train.lr=0.1", "seed=1"], {"test/acc": 0.8})
    make_run(tmp_path / "2", ["train.lr=0.1", "seed=2"], {"error": "RuntimeError: CUDA out of memory"})
    make_run(tmp_path / "3", ["train.lr=0.2", "seed=0"], None)  # killed: no summary.json
    report = build_report(tmp_path, metric="test/acc")
    text = markdown(report)
    (row,) = table_rows(text)
    assert row[:2] == ["0.1", "2"] and mean_std(row[2])[0] == pytest.approx(0.85)
    assert "4 runs: 2 completed, 1 failed, 1 incomplete" in text
    assert "- 2 (train.lr=0.1 seed=2): failed: RuntimeError: CUDA out of memory" in text
    assert "- 3 (train.lr=0.2 seed=0): incomplete (no summary.json)" in text


def test_cli_writes_table_and_plots_next_to_the_runs(tmp_path, capsys):
    grid(tmp_path)
    main([str(tmp_path), "--metric", "test/acc"])
    out = capsys.readouterr().out
    assert len(table_rows(out)) == 4  # the table is printed too
    md = (tmp_path / "report.md").read_text()
    plots = ["report_train.lr.png", "report_model.png", "report_curves.png"]
    for name in plots:
        assert (tmp_path / name).read_bytes()[:8] == PNG
        assert f"]({name})" in md


def test_csv_and_latex_have_the_markdown_tables_rows_and_columns(tmp_path, capsys):
    accs = grid(tmp_path)
    md = table_rows(markdown(build_report(tmp_path, metric="test/acc")))
    main([str(tmp_path), "--metric", "test/acc", "--format", "csv"])
    printed = capsys.readouterr().out  # the table alone: `runner-report DIR --format csv > table.csv`
    assert (tmp_path / "report.csv").read_text() == printed and (tmp_path / "report.md").exists()
    header, *rows = csv.reader(io.StringIO(printed))
    assert header == ["train.lr", "model", "seeds", "test/acc", "test/acc std", "test/loss", "test/loss std"]
    assert [r[:3] for r in rows] == [r[:3] for r in md]
    for row, md_row in zip(rows, md):
        values = accs[(float(row[0]), row[1])]  # at full precision, the std beside the mean
        expected = (statistics.mean(values), statistics.stdev(values))
        assert (float(row[3]), float(row[4])) == pytest.approx(expected)
        assert mean_std(md_row[3]) == pytest.approx((float(row[3]), float(row[4])), abs=5e-5)

    main([str(tmp_path), "--metric", "test/acc", "--format", "latex"])
    printed = capsys.readouterr().out
    assert (tmp_path / "report.tex").read_text() == printed
    lines = printed.splitlines()
    head = r"train.lr & model & seeds & test/acc & test/loss \\"
    assert lines[:4] == [r"\begin{tabular}{llrrr}", r"\toprule", head, r"\midrule"]  # booktabs rules
    assert lines[-2:] == [r"\bottomrule", r"\end{tabular}"]
    body = [line.removesuffix(r" \\").split(" & ") for line in lines[4:-2]]
    assert [r[:3] for r in body] == [r[:3] for r in md]
    for row, md_row in zip(body, md):
        for cell, md_cell in zip(row[3:], md_row[3:]):
            math_ = md_cell.strip("*").replace(" ± ", r" \pm ")
            assert cell == (rf"$\mathbf{{{math_}}}$" if md_cell.startswith("**") else f"${math_}$")


def test_latex_escapes_and_both_formats_mark_missing_values(tmp_path):
    make_run(tmp_path / "0", ["method.loss=balanced_softmax"], {"test/acc": 0.5, "time/total_s": 3.0})
    make_run(tmp_path / "1", ["method.loss=ce"], {"test/acc": 0.7, "test/loss": 0.9})
    report = build_report(tmp_path, metric="test/acc")
    tex = latex(report).splitlines()
    assert tex[2] == r"method.loss & seeds & test/acc & test/loss & wall s \\"
    assert tex[4:6] == [
        r"balanced\_softmax & 1 & $0.5000$ & -- & 3 \\",
        r"ce & 1 & $\mathbf{0.7000}$ & $0.9000$ & -- \\",
    ]
    assert list(csv.reader(io.StringIO(csv_table(report)))) == [
        ["method.loss", "seeds", "test/acc", "test/acc std", "test/loss", "test/loss std", "wall s"],
        ["balanced_softmax", "1", "0.5", "", "", "", "3.0"],  # one seed: no std
        ["ce", "1", "0.7", "", "0.9", "", ""],
    ]


def test_exponent_notation_is_a_number(tmp_path):
    for job, lr in enumerate(["1e-3", "0.01", "1e-1"]):
        make_run(tmp_path / str(job), [f"train.lr={lr}"], {"test/acc": 0.5 + job / 10})
    report = build_report(tmp_path, metric="test/acc")
    assert [g.params["train.lr"] for g in report.groups] == [0.001, 0.01, 0.1]
    assert not list(tmp_path.glob("report*"))  # build_report only reads


def test_run_dirs_in_natural_order_and_a_single_run_dir(tmp_path):
    for job in (10, 9, 2):
        make_run(tmp_path / str(job), [f"seed={job}"], {"test/acc": job / 100})
    report = build_report(tmp_path, metric="test/acc")
    assert [r.dir.name for r in report.runs] == ["2", "9", "10"]
    assert report.swept == [] and len(report.groups) == 1 and len(report.groups[0].runs) == 3
    single = build_report(tmp_path / "9", metric="test/acc")
    assert len(single.runs) == 1 and single.best() is None


def test_default_metric_is_the_task_metric(tmp_path):
    make_run(tmp_path / "0", ["train.lr=0.1"], {"test/acc": 0.9, "test/loss": 0.3})
    make_run(tmp_path / "1", ["train.lr=0.2"], {"test/acc": 0.7, "test/loss": 0.2})
    report = build_report(tmp_path)  # no method: runner/tasks/classify.py, metric (test/acc, max)
    assert (report.metric, report.direction) == ("test/acc", "max")
    assert table_rows(markdown(report))[0][2] == "**0.9000**"


def test_optuna_results_are_quoted(tmp_path):
    make_run(tmp_path / "0", ["train.lr=0.0123456"], {"test/acc": 0.9, "val/acc": 0.95})
    make_run(tmp_path / "1", ["train.lr=0.2"], {"test/acc": 0.7, "val/acc": 0.75})
    results = {"name": "optuna", "best_params": {"train.lr": 0.0123456}, "best_value": 0.95}
    (tmp_path / "optimization_results.yaml").write_text(yaml.safe_dump(results))
    text = markdown(build_report(tmp_path, metric="test/acc"))
    assert "Optuna best: train.lr=0.01235 -> val/acc = 0.95" in text  # a search selects on val/acc


@pytest.mark.parametrize(
    "args,expected",
    [
        (["{root}/nowhere"], "no such directory"),
        (["{root}/empty"], "no runs found"),
        (["{root}/runs", "--metric", "test/f1"], "metric 'test/f1' is in no summary.json; keys: test/acc"),
        (["{root}/runs", "--metric", "test/acc:up"], "must be max or min"),
        (
            ["{root}/gone"],
            "task 'gone' is no registered task (classify, clustering, covering, hashing, "
            "longtail, noisy_labels); pass --metric KEY[:max|min]",
        ),  # fmt: skip
        (
            ["{root}/runs", "--columns", "test/acc,tset/loss"],
            "--columns tset/loss: in no summary.json; choices: test/acc, test/loss",
        ),  # fmt: skip
        (
            ["{root}/runs", "--by", "seed,bogus"],
            "--by bogus: in no run's overrides or config; choices: model, seed, or a dotted key",
        ),  # fmt: skip
    ],
)
def test_bad_input_is_one_line(tmp_path, capsys, args, expected):
    (tmp_path / "empty").mkdir()
    make_run(tmp_path / "runs" / "0", [], {"test/acc": 0.9, "test/loss": 0.3, "note": "x"})
    make_run(tmp_path / "gone" / "0", [], {"test/acc": 0.9}, config={"method": {"name": "x", "task": "gone"}})
    (tmp_path / "runs" / "report.md").write_text("an earlier report\n")
    with pytest.raises(SystemExit) as exit_:
        main([a.format(root=tmp_path) for a in args])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "runs" / "report.md").read_text() == "an earlier report\n"  # nothing overwritten
    assert not list((tmp_path / "runs").glob("*.png"))


def test_callback_records_a_failed_job_and_logs_its_traceback(tmp_path, capsys):
    """One line on the console; the traceback in the job's log file alone."""
    run_dir = tmp_path / "3"
    run_dir.mkdir()
    hydra = {"mode": RunMode.MULTIRUN, "job": {"num": 3, "name": "cli"},
             "overrides": {"task": ["train.lr=9"]}, "runtime": {"output_dir": str(run_dir)}}  # fmt: skip
    try:
        raise RuntimeError("loss is nan")
    except RuntimeError as e:
        failed = JobReturn(status=JobStatus.FAILED, _return_value=e)
    job_log = logging.FileHandler(run_dir / "cli.log")  # what Hydra's job logging gives the root logger
    logging.getLogger().addHandler(job_log)
    try:
        SweepSummary().on_job_end(OmegaConf.create({"hydra": hydra}), failed)
        assert json.loads((run_dir / "summary.json").read_text()) == {"error": "RuntimeError: loss is nan"}
        line = f"#3 failed  train.lr=9: RuntimeError: loss is nan (log: {run_dir}/cli.log)\n"
        assert capsys.readouterr().out == line
        written = (run_dir / "cli.log").read_text()
        assert (
            written.startswith("job 3 failed: loss is nan\nTraceback")
            and 'raise RuntimeError("loss' in written
        )

        # A single run (no hydra.job.num) reports its own failure: the callback leaves it alone.
        (run_dir / "summary.json").unlink()
        single = {"mode": RunMode.RUN, "runtime": {"output_dir": str(run_dir)}}
        SweepSummary().on_job_end(OmegaConf.create({"hydra": single}), failed)
        assert not (run_dir / "summary.json").exists() and (run_dir / "cli.log").read_text() == written
    finally:
        logging.getLogger().removeHandler(job_log)
        job_log.close()


def test_a_failed_jobs_frames_let_go_of_its_tensors(tmp_path):
    """Hydra keeps a failed job's exception until the sweep's batch ends; the next jobs need the memory."""

    def train():
        activations = torch.ones(1000)
        held.append(weakref.ref(activations))
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")
        except torch.OutOfMemoryError as e:
            raise OutOfMemory("ran out of CUDA memory") from e

    held = []
    try:
        train()
    except OutOfMemory as e:
        failed = JobReturn(status=JobStatus.FAILED, _return_value=e)
    hydra = {
        "mode": RunMode.MULTIRUN,
        "job": {"num": 0, "name": "cli"},
        "runtime": {"output_dir": str(tmp_path)},
    }
    gc.collect()
    assert held[0]() is not None  # the traceback's frame holds it
    SweepSummary().on_job_end(OmegaConf.create({"hydra": hydra}), failed)
    gc.collect()
    assert held[0]() is None
    assert "train" in "".join(traceback.format_exception(failed._return_value))  # the lines stay


def test_a_pruned_trial_is_recorded_counted_and_listed_not_averaged(tmp_path, caplog):
    make_run(tmp_path / "0", ["train.lr=0.1"], {"test/acc": 0.9, "val/acc": 0.9})
    make_run(tmp_path / "1", ["train.lr=0.0001"], None)  # stopped by the search's pruner (runner.sweeper)
    hydra = {"mode": RunMode.MULTIRUN, "job": {"num": 1}, "runtime": {"output_dir": str(tmp_path / "1")}}
    stopped = Pruned("trial 1 stopped at epoch 1: val/acc=0.1")
    pruned = JobReturn(status=JobStatus.FAILED, _return_value=stopped)
    with caplog.at_level(logging.INFO, logger="runner.report"):
        SweepSummary().on_job_end(OmegaConf.create({"hydra": hydra}), pruned)
    summary = json.loads((tmp_path / "1" / "summary.json").read_text())
    assert summary == {"pruned": "trial 1 stopped at epoch 1: val/acc=0.1"}  # no error: not a failure
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.exc_info is None  # no traceback
    text = markdown(build_report(tmp_path, metric="test/acc"))
    assert "2 runs: 1 completed, 1 pruned, 0 failed, 0 incomplete." in text
    assert "- 1 (train.lr=0.0001): pruned: trial 1 stopped at epoch 1: val/acc=0.1" in text
    assert len(table_rows(text)) == 1


# ------------------------------------------------------------------- the papers' numbers and the claims


def preset_run(path: Path, overrides: list[str], summary: dict) -> None:
    """A run dir of `runner` with these overrides: Hydra's composed config (with the preset's `paper:`)
    under .hydra/, the runner's own config.yaml (without it, as the runner saves it), the summary."""
    composed = compose(overrides)
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    OmegaConf.save(composed, path / ".hydra" / "config.yaml")
    saved = OmegaConf.to_container(composed)
    saved.pop("paper", None)
    (path / "config.yaml").write_text(yaml.safe_dump(saved))
    (path / "summary.json").write_text(json.dumps(summary))


def tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of `text`: its rows below the header, cells stripped."""
    blocks = re.findall(r"(?:^\|.*\|\n)+", text, re.M)
    return [[[c.strip() for c in ln.strip("|").split("|")] for ln in b.splitlines()[2:]] for b in blocks]


def test_paper_column_and_difference_for_the_rows_that_ran_the_presets_setting(tmp_path):
    """A DB-OT sweep over the training loss on the CIFAR-10-LT preset: only the DB-OT-loss row at the
    preset's own imbalance ran the setting of the paper's numbers; a device override does not matter."""
    preset = "dbot_cifar10_lt"
    paper = yaml.safe_load((CONF_DIR / "experiment" / f"{preset}.yaml").read_text())["paper"]
    assert paper["test/acc"]["value"] == 0.819  # Table 1: 81.9 %, the runner logs fractions
    accs = {("dbot", 200): [0.80, 0.83], ("ce", 200): [0.70, 0.72], ("dbot", 100): [0.85, 0.86]}
    job = 0
    for (loss, imbalance), values in accs.items():
        for seed, acc in enumerate(values):
            overrides = [f"+experiment={preset}", f"method.loss={loss}", "hardware=cpu", f"seed={seed}"]
            overrides += [f"dataset.imbalance={imbalance}"] if imbalance != 200 else []
            preset_run(tmp_path / str(job), overrides, {"test/acc": acc, "uniform/argmax/few": acc - 0.2})
            job += 1
    report = build_report(tmp_path, metric="test/acc")
    assert report.swept == ["method.loss", "dataset.imbalance"]
    main_table, paper_table = tables(markdown(report))
    assert len(main_table) == 3
    rows = {row[2]: row for row in paper_table}
    assert list(rows) == list(paper) and {(r[0], r[1]) for r in paper_table} == {("dbot", "200")}
    mean = statistics.mean(accs[("dbot", 200)])
    _, _, _, ours, value, diff, source = rows["test/acc"]
    assert mean_std(ours) == pytest.approx((mean, statistics.stdev(accs[("dbot", 200)])), abs=5e-5)
    assert (float(value), source) == (0.819, paper["test/acc"]["table"])
    assert float(diff) == pytest.approx(mean - 0.819, abs=5e-5) and diff.startswith("-")
    few = rows["uniform/argmax/few"]
    assert float(few[5]) == pytest.approx(mean - 0.2 - paper["uniform/argmax/few"]["value"], abs=5e-5)
    assert rows["lt/sinkhorn/all"][3:6] == ["-", "0.895", "-"]  # a number the runs did not log


def test_the_report_says_which_model_its_numbers_are_of(tmp_path):
    for job, (rule, acc) in enumerate([("best:val/acc", 0.8), ("best:val/acc", 0.7)]):
        summary = {"test/acc": acc, "test/acc_last": acc - 0.1, "tested_model": rule, "tested_epoch": 3}
        make_run(tmp_path / str(job), [f"seed={job}"], summary)
    text = markdown(build_report(tmp_path, metric="test/acc"))
    said = "Tested model: the best epoch's by val/acc (best:val/acc); a `_last` column is the last epoch's."
    assert said in text
    make_run(tmp_path / "2", ["seed=2"], {"test/acc": 0.9, "tested_model": "last"})
    assert "Tested model: the best epoch's by val/acc (best:val/acc) and the last epoch's;" in markdown(
        build_report(tmp_path, metric="test/acc")
    )


def test_claims_about_a_cpu_study_hold_or_fail_with_their_numbers(tmp_path):
    # sym 0.5 (the preset's rate): CSOT 0.94 >= CE 0.81 + 0.7 x (clean CE 0.96 - 0.81) = 0.915: holds;
    # sym 0.8: CSOT 0.79 >= CE 0.65 + 0.15 = 0.80: fails
    accs = {("csot", None): [0.95, 0.93], ("ce", None): [0.80, 0.82], ("ce", 0): [0.97, 0.95],
            ("csot", 0.8): [0.80, 0.78], ("ce", 0.8): [0.66, 0.64]}  # fmt: skip
    for job, ((method, rate), seed) in enumerate((key, s) for key in accs for s in range(2)):
        overrides = [f"+method={method}", "+experiment=csot_digits", f"seed={seed}"]
        overrides += [] if rate is None else [f"dataset.label_noise.rate={rate}"]
        preset_run(tmp_path / "csot" / str(job), overrides, {"test/acc": accs[method, rate][seed]})
    (gap, gap_line), (margin, margin_line) = check_claims(
        build_report(tmp_path / "csot", metric="test/acc"), load_claims()
    )
    assert (gap, margin) == ("holds", "fails")
    assert "CSOT closes at least 70% of the gap between CE on the noisy labels and CE on clean" in gap_line
    kind, rate = "dataset.label_noise.kind=symmetric", "dataset.label_noise.rate"
    assert gap_line.endswith(
        f"[{kind} {rate}=0.5 method=csot] 0.94 >= test/acc [{kind} {rate}=0.5 method=ce] 0.81 + 0.7 x "
        f"(test/acc [{kind} {rate}=0 method=ce] 0.96 - 0.81) = 0.915"
    )
    assert "at least 15 points above CE at 80% symmetric noise (csot_digits; issue 24)" in margin_line
    assert margin_line.endswith("method=ce] 0.65 + 0.15 = 0.8")
    shutil.rmtree(tmp_path / "csot" / "4")  # no clean-label CE row: the gap cannot be measured
    shutil.rmtree(tmp_path / "csot" / "5")
    (gap, gap_line), _ = check_claims(build_report(tmp_path / "csot", metric="test/acc"), load_claims())
    assert gap == "untested" and gap_line.endswith(f"0 rows with {kind} {rate}=0 method=ce (need 1)")

    shares = {"sensitivity": [0.30, 0.34], "random": [0.10, 0.08]}  # 0.32 >= 4 x 0.09 = 0.36: fails
    for job, (selector, seed) in enumerate((m, s) for m in shares for s in range(2)):
        overrides = ["+experiment=pwc_digits", f"method.selector={selector}", f"seed={seed}"]
        preset_run(tmp_path / "pwc" / str(job), overrides, {"cover/missing_share": shares[selector][seed]})
    text = markdown(build_report(tmp_path / "pwc", metric="cover/missing_share"))
    claims = text.split("Claims:\n")[1].splitlines()
    assert claims == [
        "- fails: sensitivity picks at least 4x random's share of zeros (zeros at 0.5% of dev) (pwc_digits; "
        "issue 3): cover/missing_share [method.dev_share=0.005 method.selector=sensitivity] 0.32 >= "
        "cover/missing_share [method.dev_share=0.005 method.selector=random] 0.09 x 4 = 0.36",
        "- untested: ctrans picks at least 4x random's share of zeros (zeros at 0.5% of dev) (pwc_digits; "
        "issue 3): 0 rows with method.dev_share=0.005 method.selector=ctrans (need 1)",
    ]
    assert "The paper's numbers" not in text  # a CPU study has no `paper:` block


def test_a_claim_is_not_checked_on_runs_off_the_presets_recipe(tmp_path):
    """One epoch of a 120-epoch study at chance accuracy "held" a claim; now the report says why not."""
    epochs = compose(["+experiment=csot_digits"]).train.epochs
    for job, (method, acc) in enumerate([("csot", 0.11), ("ce", 0.10)]):
        overrides = [f"+method={method}", "+experiment=csot_digits", "train.epochs=1"]
        preset_run(tmp_path / str(job), overrides, {"test/acc": acc})
    verdicts = check_claims(build_report(tmp_path, metric="test/acc"), load_claims())
    assert verdicts and {verdict for verdict, _ in verdicts} == {"not comparable"}
    assert all(line.endswith(f"(csot_digits; issue 24): 1 of {epochs} epochs") for _, line in verdicts[1:])
    text = markdown(build_report(tmp_path, metric="test/acc"))
    assert "- not comparable: CSOT closes at least 70% of the gap" in text and "holds" not in text


def test_claims_file_names_existing_presets_and_is_well_formed():
    ops = {">=", ">", "<=", "<"}
    for preset, claims in load_claims().items():
        assert (CONF_DIR / "experiment" / f"{preset}.yaml").exists(), preset
        for claim in claims:
            assert claim["op"] in ops and claim["claim"] and claim["source"], claim
            assert {"left", "right"} <= set(claim) and "metric" in claim["left"], claim
            for side in (claim["left"], claim["right"]):
                assert side.get("stat", "mean") in {"mean", "min", "max"}, claim


def test_help_opens_with_the_name_and_a_line_per_config_group():
    out = run_cli_here(["--help"], CONF_DIR.parent).stdout
    assert out.startswith("runner: ") and "powered by Hydra" not in out
    intro, usage = out.split("\nUsage:\n")
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
    groups += [f"hydra/{p.name}" for p in (CONF_DIR / "hydra").iterdir() if p.name != "help"]
    for group in groups:
        assert re.search(rf"^  {re.escape(group)} +\S", intro, re.M), group
    for shown in ("runner -m ", "+experiment=", "+debug=smoke", "runner-report"):
        assert shown in usage.split("\n\n")[0], shown


def test_every_paper_scale_preset_has_a_paper_block_of_values_and_tables():
    """The GPU presets carry the paper's numbers (some none: a comment says why); the CPU studies none."""
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        preset = yaml.safe_load(path.read_text())
        gpu = {"override /hardware": "auto"} in preset["defaults"]  # paper scale: CUDA where visible
        # pwc_optimality: the paper's Fig. 3 at the paper's own size, which is a CPU run
        assert ("paper" in preset) == (gpu or path.stem == "pwc_optimality"), path.name
        for metric, entry in (preset.get("paper") or {}).items():
            assert set(entry) == {"value", "table"} and isinstance(entry["value"], float), (path.name, metric)
            assert entry["table"].startswith(("Table ", "Fig. ")), (path.name, metric)
            level1 = re.match(r"hash/\w+/k1-d(\d+)/", metric)  # [11]'s row is named by its width
            assert not level1 or int(level1.group(1)) in preset["method"]["level1_d"], (path.name, metric)


def test_groups_by_a_given_key_such_as_the_runs_name(tmp_path):
    for job, (name, acc) in enumerate([("base", 0.5), ("base", 0.7), ("ours", 0.8), ("ours", 0.9)]):
        config = {"seed": job, "name": name, "logger": {"tags": [name]}, "model": {"name": "mlp"}}
        make_run(tmp_path / str(job), [f"seed={job}"], {"test/acc": acc}, config=config)
    for by, groups in ((["name"], ["base", "ours"]), (["logger.tags"], ["['base']", "['ours']"])):
        rows = table_rows(markdown(build_report(tmp_path, metric="test/acc:max", by=by)))
        assert [(r[0], r[1]) for r in rows] == [(groups[0], "2"), (groups[1], "2")]
        assert [mean_std(r[2])[0] for r in rows] == pytest.approx([0.6, 0.85])
