"""`runner-report` on hand-made run dirs: grouping, mean ± std, best row, skipped runs, plots."""

import json
import logging
import statistics
from pathlib import Path

import pytest
import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.types import RunMode
from omegaconf import OmegaConf

from runner.report import SweepSummary, build_report, main, markdown

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
    report = build_report(tmp_path)  # no method: tasks/classify.py, METRIC = (test/acc, max)
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
        (["{root}/gone"], "task 'gone' has no tasks/gone.py with a METRIC; pass --metric KEY[:max|min]"),
        (["{root}/runs", "--columns", "test/acc,tset/loss"], "--columns tset/loss: in no summary.json; "
         "choices: test/acc, test/loss"),  # fmt: skip
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


def test_callback_records_a_failed_job_and_logs_its_traceback(tmp_path, caplog):
    run_dir = tmp_path / "3"
    run_dir.mkdir()
    hydra = {"mode": RunMode.MULTIRUN, "job": {"num": 3}, "runtime": {"output_dir": str(run_dir)}}
    try:
        raise RuntimeError("loss is nan")
    except RuntimeError as e:
        failed = JobReturn(status=JobStatus.FAILED, _return_value=e)
    with caplog.at_level(logging.ERROR, logger="runner.report"):
        SweepSummary().on_job_end(OmegaConf.create({"hydra": hydra}), failed)
    assert json.loads((run_dir / "summary.json").read_text()) == {"error": "RuntimeError: loss is nan"}
    (record,) = caplog.records
    assert "job 3 failed: loss is nan" in record.getMessage() and record.exc_info[1] is failed._return_value

    # A single run (no hydra.job.num) reports its own failure: the callback leaves it alone.
    (run_dir / "summary.json").unlink()
    single = {"mode": RunMode.RUN, "runtime": {"output_dir": str(run_dir)}}
    SweepSummary().on_job_end(OmegaConf.create({"hydra": single}), failed)
    assert not (run_dir / "summary.json").exists() and len(caplog.records) == 1
