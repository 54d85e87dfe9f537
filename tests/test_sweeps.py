"""Multiruns end to end: a 2 x 2 grid over seeds then `runner-report`, a failing job, an Optuna search
and its pruning, and the shipped sweep and launcher presets."""

import contextlib
import dataclasses
import json
import re
import statistics
from pathlib import Path

import optuna
import pytest
import yaml
from conftest import quick_first, run_cli_here, summaries
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from omegaconf import open_dict
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from test_report import PNG, mean_std, table_rows

import runner.tasks.classify
from runner import sweeper
from runner.checks import ConfigError
from runner.compose import CONF_DIR, compose, launch_overrides, preflight
from runner.overrides import canonical
from runner.report import main as report_main
from runner.validate import validate

FAST = ["logger=none", "train.epochs=1", "train.progress=false"]


@pytest.mark.slow
def test_2x2_multirun_over_seeds_then_report(cli, tmp_path, capsys):
    sweep = tmp_path / "grid"
    grid = ["train.lr=0.05,0.1", "train.batch_size=32,64", "seed=0,1"]
    proc = cli("-m", *FAST, *grid, f"hydra.sweep.dir={sweep}")
    runs = summaries(sweep)
    assert len(runs) == 8
    accs: dict[tuple, list] = {}
    for run_dir, summary in runs.items():
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        accs.setdefault((cfg["train"]["lr"], cfg["train"]["batch_size"]), []).append(summary["test/acc"])
        assert cfg["logger"]["group"] == f"{tmp_path.name}/grid"  # one W&B group per sweep: its dir
    assert "8 runs: 8 completed" in proc.stdout  # the summary printed at the end of the multirun

    report_main([str(sweep)])
    rows = table_rows(capsys.readouterr().out)
    assert len(rows) == 4 and {(float(r[0]), int(r[1])) for r in rows} == set(accs)
    for lr, batch, n, acc in (row[:4] for row in rows):
        values = accs[(float(lr), int(batch))]
        assert n == "2"
        assert mean_std(acc) == pytest.approx((statistics.mean(values), statistics.stdev(values)), abs=5e-5)
    best = max(accs, key=lambda k: statistics.mean(accs[k]))
    assert [r[3].startswith("**") for r in rows] == [(float(r[0]), int(r[1])) == best for r in rows]
    md = (sweep / "report.md").read_text()
    for name in ("report_train.lr.png", "report_train.batch_size.png", "report_curves.png"):
        assert (sweep / name).read_bytes()[:8] == PNG and f"]({name})" in md


@pytest.mark.slow
def test_a_failed_job_is_reported_and_the_others_summarized(cli, tmp_path):
    sweep = tmp_path / "mixed"
    # cifar10 is not on disk and download is off: that job fails while loading data.
    proc = cli("-m", *FAST, "dataset=cifar10,digits", f"hydra.sweep.dir={sweep}", check=False)
    assert proc.returncode == 1  # the sweep's outcome is not hidden
    assert (sweep / "1" / "summary.json").exists()  # the job after the failure ran
    failed = json.loads((sweep / "0" / "summary.json").read_text())
    assert failed["error"].startswith("ConfigError: cifar10 not found")
    assert "job 0 failed: cifar10 not found" in (sweep / "0" / "cli.log").read_text()
    out = proc.stdout
    assert "2 runs: 1 completed, 1 failed" in out and "| digits | 1 |" in out
    assert "- 0 (dataset=cifar10): failed: ConfigError: cifar10 not found" in out


def test_optuna_search_of_4_trials_reports_its_best_parameters(cli_here, tmp_path):
    sweep = tmp_path / "study"
    proc = cli_here("-m", "+sweep=erm", *FAST, "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sweep}")
    assert "direction maximize" in proc.stdout  # test/acc: the task's METRIC direction
    log = proc.stdout + proc.stderr
    assert "\x1b[" not in log and "setup plugin" not in log  # no Optuna colour codes, no alembic noise
    trials = {}
    for run_dir, summary in summaries(sweep).items():
        overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
        params = dict(o.split("=", 1) for o in overrides if o.startswith(("train.lr=", "train.batch_size=")))
        trials[run_dir.name] = (summary["val/acc"], params)  # the search selects on val, never on test
    assert len(trials) == 4
    best_acc = max(acc for acc, _ in trials.values())
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(best_acc)
    assert set(results["best_params"]) == {"train.lr", "train.weight_decay", "train.batch_size"}
    reported = {k: str(v) for k, v in results["best_params"].items() if k != "train.weight_decay"}
    assert (best_acc, reported) in trials.values()  # the best parameters are those of a best trial
    assert f"-> val/acc = {best_acc:.4g}" in proc.stdout  # quoted in the printed summary


def test_optuna_direction_follows_the_task_metric(monkeypatch):
    assert "hydra.sweeper.direction=maximize" in launch_overrides(["-m", "hydra/sweeper=optuna"])
    loss_task = dataclasses.replace(runner.tasks.classify.TASK, metric=("test/loss", "min"))
    monkeypatch.setattr(runner.tasks.classify, "TASK", loss_task)
    assert "hydra.sweeper.direction=minimize" in launch_overrides(["-m", "+sweep=erm"])
    given = launch_overrides(["-m", "hydra/sweeper=optuna", "hydra.sweeper.direction=maximize"])
    assert not any(o.startswith("hydra.sweeper.direction") for o in given)  # the user's word wins
    assert not any("direction" in o for o in launch_overrides(["-m", "seed=0,1"]))  # basic sweeper: none
    assert launch_overrides(["seed=1"]) == []  # a single run needs nothing added
    # A failed or diverged trial does not end an Optuna search (the sweeper's default: any failure does).
    assert "hydra.sweeper.max_failure_rate=1.0" in launch_overrides(["-m", "hydra/sweeper=optuna"])
    given = launch_overrides(["-m", "hydra/sweeper=optuna", "hydra.sweeper.max_failure_rate=0.2"])
    assert not any(o.startswith("hydra.sweeper.max_failure_rate") for o in given)


def test_search_space_in_hydras_sweep_syntax():
    space, fixed = sweeper.search_space([
        "train.lr=interval(0.01, 0.5)",
        "train.lr=tag(log, interval(0.01, 0.5))",  # a later override of a key wins (the command line's)
        "train.batch_size=tag(int, interval(16, 128))",
        "train.epochs=range(1, 10, 2)",  # stop excluded, as in a grid
        "train.momentum=range(0.25, 1, 0.25)",
        "model=mlp,cnn",
        "method.eps=choice(0.1, 1)",
        "seed=3",
    ])  # fmt: skip
    assert space == {
        "train.lr": FloatDistribution(0.01, 0.5, log=True),
        "train.batch_size": IntDistribution(16, 128),
        "train.epochs": IntDistribution(1, 9, step=2),
        "train.momentum": FloatDistribution(0.25, 0.75, step=0.25),
        "model": CategoricalDistribution(["mlp", "cnn"]),
        "method.eps": CategoricalDistribution([0.1, 1]),
    }
    assert fixed == {"seed": "3"}  # the same in every trial


@contextlib.contextmanager
def as_job(num: int):
    """Inside Hydra's job `num` of a multirun, as the basic launcher runs it (in this process)."""
    cfg = _hydra_compose([])
    with open_dict(cfg):
        cfg.hydra.job.num = num
    before = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(cfg)
    try:
        yield
    finally:
        HydraConfig.instance().cfg = before


def test_report_stops_a_trial_below_the_median_of_the_finished_ones():
    """The call the tracker makes for every metrics row: the running job's trial learns its objective per
    epoch, and stops (Pruned) when it falls below the median of finished trials at that epoch, unless
    that is its last epoch (stopping it there saves nothing)."""
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    good, bad, short = study.ask(), study.ask(), study.ask()
    jobs = {0: (good, 2), 1: (bad, 2), 2: (short, 1)}  # by job number: (trial, last epoch)
    with as_job(0), sweeper.running(jobs, "val/acc"):
        for epoch, acc in enumerate([0.6, 0.8], 1):
            sweeper.report({"step": epoch - 1, "epoch": epoch, "train/loss": 1.0, "val/acc": acc})
    study.tell(good, 0.8)
    with as_job(1), sweeper.running(jobs, "val/acc"):
        sweeper.report({"step": 0, "test/acc": 0.1})  # no epoch, no objective: not the trial's
        with pytest.raises(sweeper.Pruned, match="trial 1 stopped at epoch 1: val/acc=0.2$"):
            sweeper.report({"step": 0, "epoch": 1, "val/acc": 0.2})
    study.tell(bad, state=optuna.trial.TrialState.PRUNED)
    with as_job(2), sweeper.running(jobs, "val/acc"):
        sweeper.report({"epoch": 1, "val/acc": 0.2})  # as low, but its last epoch: it finishes
    assert [t.intermediate_values for t in study.trials] == [{1: 0.6, 2: 0.8}, {1: 0.2}, {1: 0.2}]
    with as_job(1):
        sweeper.report({"epoch": 2, "val/acc": 0.0})  # after the batch (or outside a search): nothing


def test_a_trial_falling_behind_is_pruned_after_its_first_epoch(tmp_path):
    sweep, db = tmp_path / "pruned", tmp_path / "study.db"
    # TPE's random start with seed 10 asks lr 0.1, then 1e-4 (far slower: behind after epoch 1), then 0.1.
    search = ["hydra/sweeper=optuna", "hydra.sweeper.sampler.seed=10", "hydra.sweeper.n_trials=3",
              "hydra.sweeper.pruners.median.n_startup_trials=1", "train.lr=choice(0.1, 1e-4)",
              f"hydra.sweeper.storage=sqlite:///{db}", "hydra.sweeper.study_name=s"]  # fmt: skip
    args = ["-m", "logger=none", "train.epochs=3", "train.progress=false",
            *search, f"hydra.sweep.dir={sweep}"]  # fmt: skip
    proc = run_cli_here(args, tmp_path)
    lrs, epochs = {}, {}
    for run_dir in sorted(p for p in sweep.iterdir() if p.is_dir()):
        overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
        lrs[run_dir.name] = float(next(o for o in overrides if o.startswith("train.lr=")).split("=")[1])
        epochs[run_dir.name] = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert lrs == {"0": 0.1, "1": 1e-4, "2": 0.1}
    assert epochs == {"0": 3, "1": 1, "2": 3}  # stopped after its first epoch
    pruned = json.loads((sweep / "1" / "summary.json").read_text())
    assert list(pruned) == ["pruned"] and pruned["pruned"].startswith("trial 1 stopped at epoch 1: val/acc=")
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{db}")
    assert [t.state.name for t in study.trials] == ["COMPLETE", "PRUNED", "COMPLETE"]  # pruned, not failed
    assert "3 trials: 2 complete, 1 pruned, 0 failed" in proc.stdout  # the sweeper's count
    assert "3 runs: 2 completed, 1 pruned, 0 failed, 0 incomplete" in proc.stdout  # the sweep's summary
    assert "- 1 (train.lr=0.0001): pruned: trial 1 stopped at epoch 1: val/acc=" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["+method=dbot_cluster", "method.eps=interval(-1, 0.5)"], "method.eps=-1.0 is out of range"),
        (["+method=dbot_cluster", "method.tau=interval(0.1, 1.5)"], "method.tau=1.5 is out of range"),
        (["train.batch_size=tag(int, interval(0, 64))"], "train.batch_size=0 is out of range"),
        (["train.batch_size=interval(16, 64)"], "bad value for train.batch_size"),  # floats: tag it int
        (["hydra/sweeper=optuna", "train.lr=choice(0.1, nan)"], "train.lr=nan: must be a finite number"),
        (["train.epochs=range(0, 3)"], "train.epochs=0 is out of range"),
    ],
)
def test_search_spaces_are_checked_at_every_value_and_both_ends(args, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        preflight(["-m", *args])


def test_search_spaces_of_a_sweep_config_are_checked_too(monkeypatch):
    """Search spaces set in the sweeper's `params` (conf/sweep/*.yaml) are checked like those given on the
    command line, which win over them for the same key."""
    import runner.compose

    compose_hydra = runner.compose.compose_hydra

    def with_params(overrides):
        cfg = compose_hydra(overrides)
        cfg.hydra.sweeper.params = {"train.lr": "interval(-1, 0.5)", "train.momentum": "choice(0.5, 1.5)"}
        return cfg

    monkeypatch.setattr(runner.compose, "compose_hydra", with_params)
    with pytest.raises(ConfigError, match=re.escape("train.lr=-1.0 is out of range")):
        preflight(["-m", "hydra/sweeper=optuna"])
    with pytest.raises(ConfigError, match=re.escape("train.momentum=1.5 is out of range")):
        preflight(["-m", "hydra/sweeper=optuna", "train.lr=interval(0.01, 0.5)"])
    preflight(["hydra/sweeper=optuna"])  # a single run ignores search spaces
    monkeypatch.undo()
    valid = ["method.tau=interval(0, 0.9)", "train.batch_size=tag(int, interval(8, 64))"]
    preflight(["-m", "+method=dbot_cluster", *valid])


def _hydra_compose(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=canonical(overrides), return_hydra_config=True)


SWEEPS = sorted(p.stem for p in (CONF_DIR / "sweep").glob("*.yaml"))


@pytest.mark.parametrize("name", quick_first(SWEEPS, lambda _: "search space"))
def test_sweep_search_space_names_real_keys_with_valid_bounds(name):
    """conf/sweep/NAME.yaml searches method NAME: every key exists, every choice and bound validates."""
    has_method = (CONF_DIR / "method" / f"{name}.yaml").exists()
    base = [f"+sweep={name}"] + ([f"+method={name}"] if has_method else [])
    cfg = _hydra_compose(base)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper")
    params = cfg.hydra.sweeper.params
    assert params, f"conf/sweep/{name}.yaml has no search space"
    for key, spec in params.items():
        (override,) = OverridesParser.create().parse_overrides([f"{key}={spec}"])
        if override.value_type == ValueType.INTERVAL_SWEEP:
            values = [override.value().start, override.value().end]
        else:
            values = list(override.sweep_iterator())
        for value in values:
            validate(compose([*base, f"{key}={value}"]))  # ConfigError: unknown key, value out of range


def test_slurm_gpu_launcher_preset():
    launcher = _hydra_compose(["hydra/launcher=slurm_gpu"]).hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.gpus_per_node, launcher.tasks_per_node, launcher.partition) == (1, 1, "gpu")
    assert launcher.max_num_timeout > 0  # requeued jobs resume from checkpoints/last.pt
    assert launcher.signal_delay_s >= 60  # time for a step and a checkpoint before the time limit


@pytest.mark.slow
def test_wandb_runs_of_a_sweep_share_a_group(cli, tmp_path):
    from test_cli import wandb_records

    sweep = tmp_path / "wb"
    cli("-m", "logger=wandb", *FAST[1:], "seed=0,1", f"hydra.sweep.dir={sweep}", timeout=600)
    groups = []
    for log_file in sorted(Path(sweep).glob("*/wandb/offline-run-*/run-*.wandb")):
        groups += [r.run.run_group for r in wandb_records(log_file) if r.WhichOneof("record_type") == "run"]
    assert len(groups) >= 2 and set(groups) == {f"{tmp_path.name}/wb"}


def test_a_grid_gets_the_sweeper_that_starts_its_first_job_at_once():
    assert "hydra/sweeper=grid" in launch_overrides(["-m", "seed=0,1"])
    assert not any("sweeper=" in o for o in launch_overrides(["-m", "+sweep=erm"]))  # Optuna's own
    asked = launch_overrides(["-m", "hydra/sweeper=basic", "seed=0,1"])  # Hydra's own, asked for
    assert "hydra/sweeper=grid" not in asked
    assert _hydra_compose(["hydra/sweeper=grid"]).hydra.sweeper.max_batch_size is None  # one batch: all jobs


@pytest.mark.parametrize("batch", [None, 8])
def test_a_50_job_sweep_composes_no_other_job_before_its_first(tmp_path, monkeypatch, capsys, batch):
    """Hydra's basic sweeper composed every job of a batch before launching its first (2,000 seeds: 4
    minutes of nothing); the grid sweeper composes each as it starts (the preflight checked them all).
    Ctrl-C in job 3 then says how many jobs of the sweep ended."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    import runner.cli

    composed, at_start = [], []
    load_sweep_config = ConfigLoaderImpl.load_sweep_config

    def counted(self, *args, **kwargs):
        composed.append(1)
        return load_sweep_config(self, *args, **kwargs)

    def job(cfg, cleanup, preset_note):  # the job's own work left out: what is measured is Hydra's
        at_start.append(len(composed))
        if len(at_start) == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(ConfigLoaderImpl, "load_sweep_config", counted)
    monkeypatch.setattr(runner.cli, "_run", job)
    monkeypatch.setattr(sweeper, "progress", sweeper.Progress())
    batches = [f"hydra.sweeper.max_batch_size={batch}"] if batch else []
    with pytest.raises(SystemExit) as stop:
        runner.cli.run_in_process(["-m", "seed=range(0,50)", "logger=none", f"hydra.sweep.dir={tmp_path}",
                                   *batches])  # fmt: skip
    assert stop.value.code == 130 and at_start == [1, 2, 3, 4]  # each job composed as it starts, no other
    assert "(the whole sweep, 3 of 50 jobs ended:" in capsys.readouterr().err


@pytest.mark.parametrize("args,says", [
    (["seed=0,0"], "seed=0,0 lists seed=0 twice: the sweep would run the same job twice"),
    (["seed=0,1", "train.lr=0.1,1e-1"], "train.lr=0.1,1e-1 lists train.lr=0.1 twice"),
])  # fmt: skip
def test_a_grid_that_repeats_a_job_is_refused(args, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        preflight(["-m", *args])
    preflight(["-m", "seed=0,1", "train.lr=0.1,1"])  # other values: other jobs


def test_a_search_space_without_multirun_is_refused():
    says = "+sweep=erm is a search space: add -m (runner -m +sweep=erm"
    with pytest.raises(ConfigError, match=re.escape(says)):
        preflight(["+sweep=erm"])


def test_ctrl_c_between_jobs_says_how_many_ended(tmp_path, monkeypatch, capsys):
    """A Ctrl-C outside any job (here as job #2's end is recorded): which jobs ended, of how many."""
    import runner.cli
    from runner.report.callback import SweepSummary

    def record(self, config, job_return, **kwargs):
        if config.hydra.job.num == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(runner.cli, "_run", lambda cfg, cleanup, preset_note: None)
    monkeypatch.setattr(SweepSummary, "on_job_end", record)
    monkeypatch.setattr(sweeper, "progress", sweeper.Progress())
    with pytest.raises(SystemExit) as stop:
        runner.cli.run_in_process(["-m", "seed=range(0,5)", "logger=none", f"hydra.sweep.dir={tmp_path}"])
    says = f"runner: interrupted after 3 of 5 jobs; its command line with hydra.sweep.dir={tmp_path} runs"
    assert stop.value.code == 130 and says in capsys.readouterr().err
