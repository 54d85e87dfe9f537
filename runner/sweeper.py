"""The runner's sweepers: `GridSweeper` (the default, `hydra/sweeper=grid`: every combination of the
swept values, the first job started at once) and `hydra/sweeper=optuna`: an Optuna (>= 4) study over a
multirun, one trial per job, with pruning. `progress` counts the jobs of the sweep this process runs.

The search space is Hydra's sweep syntax, from `hydra.sweeper.params` (conf/sweep/*.yaml) and the
command line (which wins for the same key):

    choice(a, b, ...)            categorical (so is a comma list, and shuffle(range(...)))
    interval(lo, hi)             float, uniform; tag(log, interval(...)): log-uniform
    tag(int, interval(lo, hi))   int (tag(int, log, ...): log-uniform)
    range(start, stop[, step])   the range's values as an int (or float) grid, stop excluded
    any other value              fixed in every trial

Pruning: the tracker hands every metrics row to `report`. In a job this process runs (Hydra's basic
launcher) that tells the job's trial the search's objective at the row's epoch and raises `Pruned` when
the pruner (`hydra.sweeper.pruner`) says the trial falls behind. The exception ends the job; the sweeper
tells Optuna the trial was pruned (not failed), `runner.report.SweepSummary` records it in the job's
summary.json. Jobs in other processes (joblib, Slurm) are not pruned.

Hydra instantiates sweepers only from its `hydra_plugins` namespace: conf/hydra/sweeper/optuna.yaml names
`hydra_plugins.runner_optuna_sweeper.OptunaSweeper`, this class under that name (grid.yaml likewise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer, ValueType
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from runner.checks import ConfigError, check_choice, check_range
from runner.schema import objective_key

log = logging.getLogger(__name__)

PRUNERS = {"median": "MedianPruner", "hyperband": "HyperbandPruner", "none": "NopPruner"}

# Job number -> (its trial, its last epoch or None, the objective key) for the batch this process runs.
_running: dict[int, tuple] = {}


@dataclasses.dataclass
class Progress:
    """The sweep this process runs, for the line a Ctrl-C prints: its dir and how many jobs it holds (None
    before a sweeper knows), how many have ended (`runner.cli` counts them)."""

    sweep_dir: str | None = None
    jobs: int | None = None
    ended: int = 0

    def __str__(self) -> str:
        return f"{self.ended} of {self.jobs} jobs" if self.jobs is not None else f"{self.ended} jobs"


progress = Progress()


class GridSweeper(Sweeper):
    """Hydra's basic sweeper (every combination of the swept values, `max_batch_size` jobs launched at a
    time; null: all in one batch) without its check of every job before each batch: that composed each
    job again (0.13 s a job: a 2,000-job sweep started its first job after 4 minutes), where the runner's
    preflight (`runner.compose.preflight`) has already checked them all. As Hydra's, a failed job does
    not stop the sweep: the first failure is raised once every batch has run."""

    def __init__(self, max_batch_size: int | None, params: DictConfig | None) -> None:
        self.max_batch_size = max_batch_size
        self.params = OmegaConf.to_container(params) if params else {}

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> list:
        # Hydra's plugin scan loads its modules again: the class of this moment, not one of an import's.
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        params = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        batches = BasicSweeper.split_arguments(parser.parse_overrides(params), self.max_batch_size)
        progress.sweep_dir, progress.jobs = self.config.hydra.sweep.dir, sum(map(len, batches))
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns, first_job = [], 0
        for batch in batches:
            returns.append(self.launcher.launch(batch, initial_job_idx=first_job))
            first_job += len(batch)
        for ret in (ret for batch in returns for ret in batch):
            _ = ret.return_value  # raises the first failed job's error
        return returns


class Pruned(Exception):
    """Raised by `report` inside a job whose trial the pruner stops: the job ends here."""


def report(metrics: Mapping) -> None:
    """Tell the running job's trial the search's objective in `metrics` (a metrics row) at its `epoch`;
    raise Pruned when the pruner then stops the trial, unless at its last epoch (stopping it there saves
    nothing and loses its result). A no-op outside a search, in a job another process runs, and for a row
    without both (a task that logs its objective only at the end is never pruned)."""
    if not _running:
        return
    from hydra.core.hydra_config import HydraConfig

    trial, last, key = _running.get(HydraConfig.get().job.num, (None, None, None))
    epoch, value = metrics.get("epoch"), metrics.get(key)
    if trial is None or not isinstance(epoch, int) or not _finite(value):
        return
    trial.report(float(value), epoch)
    if (last is None or epoch < last) and trial.should_prune():
        raise Pruned(f"trial {trial.number} stopped at epoch {epoch}: {key}={value:.4g}")


@contextlib.contextmanager
def running(jobs: Mapping[int, tuple], key: str):
    """`report` serves these jobs' trials, `{job number: (trial, its last epoch or None)}`, e.g. around
    the basic launcher's `launch`."""
    _running.update({num: (trial, last, key) for num, (trial, last) in jobs.items()})
    try:
        yield
    finally:
        _running.clear()


def search_space(overrides: list[str]) -> tuple[dict, dict]:
    """({key: Optuna distribution}, {key: fixed value as typed}) of sweep overrides; a later override of a
    key replaces an earlier one. A one-line ConfigError naming the key of a space Optuna refuses."""
    parsed = {o.get_key_element(): o for o in OverridesParser.create().parse_overrides(overrides)}
    space, fixed = {}, {}
    for key, override in parsed.items():
        if override.is_sweep_override():
            try:
                space[key] = distribution(override)
            except ValueError as e:  # Optuna's: `low <= high` must hold, `low > 0` for log=True
                given = override.input_line.partition("=")[2]
                raise ConfigError(f"{key}={given}: not a search space Optuna takes ({e})") from None
        else:
            fixed[key] = override.get_value_element_as_str()
    return space, fixed


def distribution(override: Override):
    """The Optuna distribution of one sweep override (module docstring)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    if override.value_type == ValueType.INTERVAL_SWEEP:  # Hydra reads both ends as floats
        if "int" in value.tags:
            return IntDistribution(int(value.start), int(value.end), log="log" in value.tags)
        return FloatDistribution(value.start, value.end, log="log" in value.tags)
    values = list(override.sweep_iterator(transformer=Transformer.encode))
    if override.value_type == ValueType.RANGE_SWEEP and not value.shuffle and len(values) > 1:
        low, high, step = min(values), max(values), abs(value.step)
        if all(isinstance(v, int) for v in (low, high, step)):
            return IntDistribution(low, high, step=step)
        return FloatDistribution(low, high, step=step)
    return CategoricalDistribution(values)


def check_settings(pruner: str, direction: str, n_trials: int, n_jobs: int, max_failure_rate: float) -> None:
    """One-line ConfigErrors for `hydra.sweeper` settings the search cannot run with (checked before any
    run dir is made, and again by the sweeper)."""
    check_choice("hydra.sweeper.pruner", pruner, PRUNERS)
    check_choice("hydra.sweeper.direction", direction, ("minimize", "maximize"))
    check_range("hydra.sweeper.n_trials", n_trials, 1)
    check_range("hydra.sweeper.n_jobs", n_jobs, 1)
    check_range("hydra.sweeper.max_failure_rate", max_failure_rate, 0.0, 1.0)


class OptunaSweeper(Sweeper):
    """Asks Optuna for `n_jobs` trials at a time, launches them as jobs, tells it each job's outcome:
    its return value (complete), `Pruned` (pruned), any other error or no value (failed). Writes
    `optimization_results.yaml` (best parameters and value) into the sweep dir."""

    def __init__(
        self,
        sampler,
        direction: str,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        storage: str | None,
        study_name: str | None,
        pruner: str,
        pruners: DictConfig,
        params: DictConfig | None,
    ) -> None:
        check_settings(pruner, direction, n_trials, n_jobs, max_failure_rate)
        self.sampler, self.direction, self.n_trials, self.n_jobs = sampler, direction, n_trials, n_jobs
        self.max_failure_rate, self.storage, self.study_name = max_failure_rate, storage, study_name
        self.pruner = pruner
        self.pruner_args = OmegaConf.to_container(pruners.get(pruner) or {}) if pruners else {}
        self.params = OmegaConf.to_container(params) if params else {}

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config, self.hydra_context, self.job_idx = config, hydra_context, 0
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> None:
        import optuna
        from hydra._internal.core_plugins.basic_launcher import BasicLauncher

        space, fixed = search_space([f"{k}={v}" for k, v in self.params.items()] + list(arguments))
        pruner = getattr(optuna.pruners, PRUNERS[self.pruner])(**self.pruner_args)
        study = optuna.create_study(study_name=self.study_name, storage=self.storage, sampler=self.sampler,
                                    pruner=pruner, direction=self.direction, load_if_exists=True)  # fmt: skip
        log.info("Study %s: direction %s, sampler %s, pruner %s, %d trials, %d at a time",
                 study.study_name, self.direction, type(self.sampler).__name__, type(pruner).__name__,
                 self.n_trials, self.n_jobs)  # fmt: skip
        # Only jobs of this process can be pruned: the tracker's `report` needs their trials at hand.
        prunes = self.pruner != "none" and isinstance(self.launcher, BasicLauncher)
        if self.pruner != "none" and not prunes:
            log.info("pruner %s: %s runs the trials in other processes, where none is pruned",
                     self.pruner, type(self.launcher).__name__)  # fmt: skip
        key = _objective(self.config) if prunes else None
        progress.sweep_dir, progress.jobs = self.config.hydra.sweep.dir, self.n_trials
        epochs = OmegaConf.select(self.config, "train.epochs")  # a trial's last epoch, unless it sets its own
        counts: Counter = Counter()
        left = self.n_trials
        while left > 0:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, left))]
            settings = [{**t.params, **fixed} for t in trials]
            batch = [tuple(f"{k}={v}" for k, v in setting.items()) for setting in settings]
            jobs = {
                self.job_idx + i: (trial, _last_epoch(setting.get("train.epochs", epochs)))
                for i, (trial, setting) in enumerate(zip(trials, settings))
            }
            with running(jobs, key) if prunes else contextlib.nullcontext():
                returns = self.launcher.launch(batch, initial_job_idx=self.job_idx)
            self.job_idx += len(returns)
            failures = []
            for trial, ret in zip(trials, returns):
                state, value, error = _outcome(ret)
                study.tell(trial, value, state)
                counts[state.name.lower()] += 1
                if state == optuna.trial.TrialState.FAIL:
                    log.warning("Failed experiment: %s", error)
                    failures.append(error)
                elif state == optuna.trial.TrialState.PRUNED:
                    log.info("Pruned experiment: %s", error)
            if len(failures) / len(returns) > self.max_failure_rate:
                log.error("%d of %d trials failed, above max_failure_rate=%s",
                          len(failures), len(returns), self.max_failure_rate)  # fmt: skip
                raise failures[0]
            left -= len(trials)
        log.info("%d trials: %d complete, %d pruned, %d failed", sum(counts.values()), counts["complete"],
                 counts["pruned"], counts["fail"])  # fmt: skip
        self._save_results(study)

    def _save_results(self, study) -> None:
        """optimization_results.yaml: the best trial's parameters and value (a continued study's too)."""
        from optuna.trial import TrialState

        results = {"name": "optuna"}
        if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            best = study.best_trial
            results |= {"best_params": best.params, "best_value": best.value}
            log.info("Best parameters: %s", best.params)
            log.info("Best value: %s", best.value)
        else:
            log.warning("no trial completed: no best parameters")
        path = Path(self.config.hydra.sweep.dir) / "optimization_results.yaml"
        OmegaConf.save(OmegaConf.create(results), path)


def _outcome(ret: JobReturn) -> tuple:
    """(TrialState, value or None, error or None) of a finished job."""
    from optuna.trial import TrialState

    if ret.status == JobStatus.FAILED:
        error = ret._return_value  # the exception; `.return_value` would raise it
        return (TrialState.PRUNED if isinstance(error, Pruned) else TrialState.FAIL), None, error
    if not _finite(ret.return_value):
        return TrialState.FAIL, None, ValueError(f"the job returned {ret.return_value!r}, not an objective")
    return TrialState.COMPLETE, float(ret.return_value), None


def _objective(config: DictConfig) -> str:
    """The metric a search of `config` optimises, which the jobs' metrics rows carry per epoch."""
    from runner.task import task_of

    return objective_key(task_of(config).metric[0])


def _last_epoch(epochs) -> int | None:
    """`train.epochs` as an int; None where it is not one (no such key): every epoch may prune."""
    try:
        return int(epochs)
    except (TypeError, ValueError):
        return None


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
