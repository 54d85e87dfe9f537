"""The job config of a command line: `CommandLine` parses argv once, completes it (the preset, the
generated data's shape, the Hydra overrides a launch adds), checks every job (`preflight`) and composes
each job once; `build_job` turns Hydra's config of a job into the typed config a run, a resume's check and
`runner-eval` all use. For the CLI (`runner.cli`) and the tools that compose a run's config again
(runner-eval, runner-report, runner-data, the sweeper, the benchmarks).

Every job's config is checked before Hydra starts anything (`preflight`), so a typo in a 20-job sweep
fails in a second with one line naming the bad value and the valid choices, instead of in job 7.

Order-free composition: conf/config.yaml holds an empty `method` slot (`method: null`) that a preset
fills (`override /method: csot`) and the command line replaces; `+method=NAME` (the documented spelling)
is read as `method=NAME` (`canonical`), so `+method`, `+experiment` and `+debug` compose to the same
config in any order, in single runs and in every job a launcher or sweeper composes.

Method-aware defaults: `+method=NAME` without an `+experiment=` gets its family's preset for the dataset
(`runner.presets`), added to the command line Hydra records, so a resume or `runner-eval` composes the
same; the job's first log line names it and the device `hardware=auto` chose.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import sys
from typing import NamedTuple

from omegaconf import DictConfig, OmegaConf, open_dict

import runner.data  # noqa: F401  (registers the datasets and their schemas)
import runner.hardware  # noqa: F401  (registers the resolvers of hardware=auto)
from runner.checks import ConfigError
from runner.overrides import (
    CONF_DIR,
    canonical,
    check_no_repeated_values,
    config_dirs,
    hydra_compose,
    is_hydra_override,
    override_args,
    parse_overrides,
    variants,
)
from runner.presets import fake_like_override, method_preset_override, without_other_options_settings
from runner.rundir import multirun_args
from runner.schema import main_metric, objective_key, store_schemas
from runner.smoke import apply_debug
from runner.task import Task, task_of
from runner.validate import SCALARS, to_node, validate

store_schemas()  # the groups' defaults, the base of their YAML options (the methods': runner.configs)

__all__ = [
    "CONF_DIR",
    "CommandLine",
    "Job",
    "build_job",
    "compose",
    "compose_hydra",
    "launch_overrides",
    "objective",
    "preflight",
    "typed",
]


def compose(overrides: list[str]) -> DictConfig:
    """The job config of `overrides` (`+method=` read as `method=`); a one-line ConfigError if it fails."""
    overrides = canonical(overrides)
    return without_other_options_settings(hydra_compose(overrides), overrides)[0]


def compose_hydra(overrides: list[str]) -> DictConfig:
    """The first job's config with the `hydra` node (launcher, sweeper, run dir) of the command line."""
    overrides = canonical(overrides)
    job = variants(overrides)[0] + [o for o in overrides if o.startswith(("hydra/", "hydra."))]
    return hydra_compose(job, return_hydra_config=True)


def _sweep_params(line: CommandLine) -> list[str]:
    """The sweeper's `params` (search spaces from a config such as conf/sweep/*.yaml) as overrides, but
    for keys the command line sweeps itself (its value wins in the sweep)."""
    params = line.hydra_config.hydra.sweeper.get("params") or {}
    given = {o.partition("=")[0].lstrip("+~") for o in line.overrides}
    return [f"{key}={value}" for key, value in params.items() if key not in given]


def preflight(argv: list[str]) -> dict | None:
    """Compose and validate each job a command line would launch (in a sweep: each swept value, both ends
    of each search interval); raise ConfigError on the first bad one. Returns the first job's checked
    groups (None for help and info)."""
    return CommandLine.parse(argv).checked


def _check_jobs(line: CommandLine) -> dict:
    """`preflight` of a parsed command line: the first job composed once (in a single run, with Hydra's
    settings: `CommandLine.hydra_config`), each other job changed from it where one plain value differs."""
    overrides = line.overrides
    if not line.multirun:
        sweep = next((o for o in overrides if o.lstrip("+").startswith("sweep=")), None)
        if sweep:  # Hydra would run the first job alone and drop the search space unsaid
            raise ConfigError(f"{sweep} is a search space: add -m (runner -m {sweep} ...)")
    else:
        overrides = _sweep_params(line) + overrides
        if "optuna" not in line.hydra_config.hydra.sweeper._target_:  # a grid; Optuna samples its own
            check_no_repeated_values(overrides)
    searchpath = [o for o in overrides if o.lstrip("+").startswith("hydra.searchpath=")]  # users' groups
    jobs = variants(overrides)
    if len(jobs) >= _ANNOUNCED_CHECKS:
        print(f"runner: checking the configs of {len(jobs)} jobs before the first starts", file=sys.stderr)
    first = checked = texts = None
    for variant in jobs:
        try:
            if first is None:
                first = compose(searchpath + variant) if line.multirun else line.composed()
                checked = validate(first)
                texts = {
                    g: OmegaConf.to_yaml(first[g]) for g in checked if isinstance(first.get(g), DictConfig)
                }
                continue
            changed = _one_plain_value(first, jobs[0], variant)
            if changed is None:
                validate(compose(searchpath + variant))
                continue
            key, value = changed
            top = key.partition(".")[0]  # the one group to check again, and those that refer to it
            same = {
                g: obj for g, obj in checked.items() if g in texts and g != top and "${" + top not in texts[g]
            }
            with _set_for_now(first, key, value):
                validate(first, reuse=same)
        except ConfigError as e:
            raise ConfigError(f"{e}{_integer_interval_hint(str(e), overrides)}") from None
    return checked


# A preflight of this many jobs or more says so: a large sweep's takes seconds before anything else shows.
_ANNOUNCED_CHECKS = 100


def _one_plain_value(first: DictConfig, first_variant: list[str], variant: list[str]) -> tuple | None:
    """(key, value) of the one override by which `variant` differs from the first job's, where the first
    job's config with that value is what Hydra would compose (a swept seed or lr); None where that takes
    Hydra (a group choice, an added or deleted key, a key the config lacks). 2,000 seeds took 6 minutes
    composed one by one."""
    (changed,) = [o for o, was in zip(variant, first_variant, strict=True) if o != was]
    (override,) = parse_overrides([changed])
    key = override.key_or_group
    plain = "." in key or key in SCALARS  # a top-level scalar; no config group has such a name
    if not plain or override.is_add() or override.is_delete() or override.is_force_add() or override.package:
        return None
    if sum(o.partition("=")[0].lstrip("+~") == key for o in variant) > 1:  # a later one of the key wins
        return None
    if OmegaConf.select(first, key, default=_ABSENT) is _ABSENT:
        return None
    return key, override.value()


@contextlib.contextmanager
def _set_for_now(cfg: DictConfig, key: str, value):
    """`cfg` with `key` at `value` inside the block, as it was after (its node restored as it stood)."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    saved = copy.deepcopy(parent._get_node(leaf))
    parent[leaf] = value
    try:
        yield
    finally:
        parent[leaf] = saved


_ABSENT = object()


def _integer_interval_hint(error: str, overrides: list[str]) -> str:
    """The fix where `error` is an integer key refusing the float ends of an untagged `interval(...)`."""
    if "could not be converted to Integer" not in error:
        return ""
    for override in overrides:
        key, _, value = override.partition("=")
        if value.startswith("interval(") and f" {key.lstrip('+')}:" in f" {error.split('for ', 1)[-1]}":
            return f"; an integer search space is {key}=tag(int, {value})"
    return ""


def typed(cfg: DictConfig, schemas: dict) -> DictConfig:
    """The job config with every schema default filled in (what tasks read and what is saved)."""
    job = OmegaConf.create({"seed": cfg.seed, "name": cfg.get("name", "run")})
    for group, obj in schemas.items():
        job[group] = to_node(obj) if dataclasses.is_dataclass(obj) else obj
    return job


def objective(task: Task, cfg) -> str:
    """The summary key an Optuna search optimises for `cfg`: `objective_key` of the task's metric.
    A ConfigError (one line, before any trial) when that needs a validation split `cfg` lacks."""
    metric = main_metric(cfg, task.metric)[0]
    key = objective_key(metric)
    dataset = validate(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]))["dataset"]
    share = "val_per_class" if hasattr(dataset, "val_per_class") else "val_fraction"  # per-class sized sets
    if key.startswith("val/") and not getattr(dataset, share) > 0:
        example = "10" if share == "val_per_class" else "0.1"
        raise ConfigError(
            f"a search selects on {key}, never on {metric}, and dataset={dataset.name} has no "
            f"validation split (dataset.{share}={getattr(dataset, share)}); give it one, e.g. "
            f"dataset.{share}={example}"
        )
    return key


def launch_overrides(argv: list[str]) -> list[str]:
    """Hydra overrides a launch adds (README, "Sweeps"): the Optuna direction of the task's metric and
    a search that goes on past failed trials (unless given), no Hydra files from torchrun ranks but 0."""
    return _launch_overrides(CommandLine.read(argv))


def _launch_overrides(line: CommandLine) -> list[str]:
    """`launch_overrides` of a parsed command line."""
    extra = []
    if int(os.environ.get("RANK", 0)) > 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    if line.multirun:
        cfg = line.hydra_config
        if cfg.hydra.sweeper._target_ == _HYDRAS_BASIC_SWEEPER and not any(
            o.startswith("hydra/sweeper=") for o in line.overrides
        ):  # the same grid, its first job started at once (a preset's `override` would lose to a default's)
            extra.append("hydra/sweeper=grid")
        if "optuna" in cfg.hydra.sweeper._target_:
            from runner.sweeper import check_settings, search_space

            sweeper = cfg.hydra.sweeper
            check_settings(sweeper.pruner, sweeper.direction, sweeper.n_trials, sweeper.n_jobs,
                           sweeper.max_failure_rate)  # fmt: skip
            overrides = line.overrides
            search_space(_sweep_params(line) + [o for o in overrides if not is_hydra_override(o)])
            objective(task_of(cfg), cfg)  # selects on validation data, or stops here
            direction = {"max": "maximize", "min": "minimize"}[main_metric(cfg, task_of(cfg).metric)[1]]
            # A failed or diverged trial is told to Optuna as failed; the search goes on.
            defaults = {"direction": direction, "max_failure_rate": 1.0}
            extra += [
                f"hydra.sweeper.{key}={value}"
                for key, value in defaults.items()
                if not any(o.startswith(f"hydra.sweeper.{key}=") for o in overrides)
            ]
    return extra


_HYDRAS_BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


class Job(NamedTuple):
    """A job's typed config and the lines its log starts with: the preset's settings left out for another
    option of their group, and what `+debug=smoke` changed past its subsets (each None where nothing)."""

    config: DictConfig
    left_out: str | None
    smoke_note: str | None


def build_job(composed: DictConfig, overrides: list[str]) -> Job:
    """The typed job config of `composed`, Hydra's config of (canonical) `overrides` without its `hydra`
    node: the preset's settings another option of their group lacks left out, every schema default filled
    in, bounded by `+debug=smoke`. The one way a run, a resume's check and `runner-eval` get theirs."""
    cfg, left_out = without_other_options_settings(composed, overrides)
    config = typed(cfg, validate(cfg))
    return Job(config, left_out, apply_debug(config))


@dataclasses.dataclass
class CommandLine:
    """A command line parsed once (`CommandLine.parse`): `args` as Hydra is to parse them (`+method=` read
    as `method=`, with the preset and generated-data shape they imply and the Hydra overrides a launch
    adds), `overrides` those of them that shape its jobs (its `--config-dir` as `hydra.searchpath`; None
    for help and info), `multirun` (-m), the line naming the preset applied (`preset_note`) and the first
    job's checked groups (`checked`; None for help and info)."""

    args: list[str]
    overrides: list[str] | None
    multirun: bool
    preset_note: str | None = None
    checked: dict | None = None

    @classmethod
    def read(cls, argv: list[str]) -> CommandLine:
        """`argv` as it stands, neither completed nor checked."""
        args = canonical(argv)
        given = override_args(args)
        return cls(args, None if given is None else config_dirs(args) + given, multirun_args(args))

    @classmethod
    def parse(cls, argv: list[str]) -> CommandLine:
        """Read `argv` once, complete it for Hydra and check every job it launches (ConfigError, one line,
        on the first bad one): what Hydra records and composes again per job (a resume, `runner-eval`)
        is then the whole job."""
        line = cls.read(argv)
        if line.overrides is None:
            return line
        args, first_given = line.args, next((o for o in line.overrides if o in line.args), None)
        preset, line.preset_note = method_preset_override(line.overrides)
        if preset:  # after the method, in the run of overrides that Hydra records (a resume repeats it)
            line._add_after("method", preset)
        like = fake_like_override(line.overrides)
        if like:  # after dataset=fake, recorded as the preset's is
            line._add_after("dataset", like)
        line.checked = _check_jobs(line)
        extra = _launch_overrides(line)
        at = args.index(first_given) if first_given else len(args)  # argparse wants one run of overrides
        args[at:at] = extra
        line.overrides += extra
        return line

    def _add_after(self, key: str, override: str) -> None:
        """Put `override` after the last override of `key`, in `args` and in `overrides`."""
        for overrides in (self.args, self.overrides):
            at = max(i for i, arg in enumerate(overrides) if arg.partition("=")[0] == key)
            overrides.insert(at + 1, override)

    @functools.cached_property
    def hydra_config(self) -> DictConfig:
        """The first job's config with Hydra's node (run and sweep dirs, launcher, sweeper), composed once."""
        return compose_hydra(self.overrides)

    def composed(self) -> DictConfig:
        """The single run's job config as `compose` gives it, from `hydra_config` (a copy of its own)."""
        return without_other_options_settings(self._without_hydra(), self.overrides)[0]

    def job(self) -> Job:
        """The single run's `Job`, as `runner.cli` runs it."""
        return build_job(self._without_hydra(), self.overrides)

    def _without_hydra(self) -> DictConfig:
        cfg = copy.deepcopy(self.hydra_config)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg
