"""The job config of a command line: argument parsing, presets, composition, preflight, typed configs
and objectives, for the CLI (`runner.cli`) and the tools that compose a run's config again (runner-eval,
runner-report, runner-data, the sweeper, the benchmarks).

Every job's config is checked before Hydra starts anything (`preflight`), so a typo in a 20-job sweep
fails in a second with one line naming the bad value and the valid choices, instead of in job 7.

Order-free composition: conf/config.yaml holds an empty `method` slot (`method: null`) that a preset
fills (`override /method: csot`) and the command line replaces; `+method=NAME` (the documented spelling)
is read as `method=NAME` (`canonical`), so `+method`, `+experiment` and `+debug` compose to the same
config in any order, in single runs and in every job a launcher or sweeper composes.

Method-aware defaults: `+method=NAME` without an `+experiment=` gets its family's preset for the dataset
(`method_preset`), added to the command line Hydra records (`command_line`), so a resume or `runner-eval`
composes the same; the job's first log line names it and the device `hardware=auto` chose.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import os
import re
import sys
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict

import runner.hardware  # noqa: F401  (registers the resolvers of hardware=auto)
from runner.configs import METHODS, TASKS
from runner.data import natural_side  # the import registers the datasets and their schemas
from runner.schema import (
    OPTION_SCHEMAS,
    SCALARS,
    ConfigError,
    main_metric,
    objective_key,
    option_keys,
    store_schemas,
    to_node,
    validate,
)
from runner.task import Task, task_of

store_schemas()  # the groups' defaults, the base of their YAML options (the methods': runner.configs)

__all__ = [
    "CONF_DIR",
    "CommandLine",
    "apply_debug",
    "canonical",
    "command_line",
    "compose",
    "compose_hydra",
    "objective",
    "objective_key",
    "preflight",
    "task_of",
    "typed",
]

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# Hydra flags that consume the next argument.
_FLAGS_WITH_VALUE = {
    "-c",
    "--cfg",
    "-p",
    "--package",
    "-cp",
    "--config-path",
    "-cn",
    "--config-name",
    "-cd",
    "--config-dir",
    "--experimental-rerun",
}
# Hydra's error for a group option no search path holds, squeezed to one line: group, value, options.
_MISSING_OPTION = (
    r"Could not (?:find|load) '([^']+)/([^']*)'.*?Available options in '[^']+':(.*?)(?:Config search path|$)"
)
_UNKNOWN_KEY = r"Could not override '([^']+)'"  # Hydra's error for a key the config lacks
_INFO_VALUES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def override_args(argv: list[str]) -> list[str] | None:
    """The config overrides in `argv`, or None when Hydra only prints help or info."""
    out, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
        elif arg in ("-h", "--help", "--hydra-help", "--version", "--shell-completion", "-sc"):
            return None
        elif arg in _FLAGS_WITH_VALUE:
            skip = True
        elif arg in ("-i", "--info"):
            skip = i + 1 < len(argv) and argv[i + 1] in _INFO_VALUES
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def canonical(overrides: list[str]) -> list[str]:
    """`overrides` with `+method=NAME` as `method=NAME`: the method slot of conf/config.yaml always exists
    (empty, or filled by a preset), so the method is chosen, not appended, wherever it stands."""
    return [o.removeprefix("+") if o.startswith("+method=") else o for o in overrides]


def _config_dirs(argv: list[str]) -> list[str]:
    """`--config-dir DIR` / `-cd DIR` of `argv` as a `hydra.searchpath` override (what Hydra's own
    command line does with it), so that preflight composes with the user's groups too."""
    dirs = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg in ("-cd", "--config-dir")]
    if not dirs:
        return []
    return ["hydra.searchpath=[" + ",".join(f"file://{Path(d).resolve()}" for d in dirs) + "]"]


def job_overrides(argv: list[str]) -> list[str] | None:
    """The overrides that shape the jobs of `argv` (its `--config-dir` too), or None for help/info."""
    overrides = override_args(argv)
    return None if overrides is None else _config_dirs(argv) + canonical(overrides)


_OPT_OUT = "+experiment=none: without it"


@functools.cache
def _preset_file(name: str) -> tuple[dict, dict]:
    """conf/experiment/NAME.yaml as (the group options it chooses, `override /model: mlp` -> {model: mlp};
    its content); ({}, {}) for a preset that is not there ("none", or one of the user's config dir)."""
    path = CONF_DIR / "experiment" / f"{name}.yaml"
    content = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    chosen = {}
    for entry in content.get("defaults", []):
        if isinstance(entry, dict):
            chosen.update({key.removeprefix("override /"): value for key, value in entry.items()})
    return chosen, content


@functools.cache
def preset_families() -> dict[str, tuple[str, str | None]]:
    """Each preset of conf/experiment that names a method: its method's task and its dataset (None: it
    keeps the default)."""
    presets = {}
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        chosen, _ = _preset_file(path.stem)
        if "method" in chosen:
            presets[path.stem] = (METHODS[chosen["method"]]().task, chosen.get("dataset"))
    return presets


@functools.cache
def _default_dataset() -> str:
    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
    return next(entry["dataset"] for entry in defaults if isinstance(entry, dict) and "dataset" in entry)


@functools.cache
def method_preset(method: str, dataset: str | None) -> tuple[str, str] | None:
    """The preset `+method=METHOD` applies on `dataset` (None: none named, the default) and why that one;
    None where its family has none there, or the preset's settings are not the method's (k-means has no
    DB-OT mass bounds)."""
    if method not in METHODS:  # a method of the user's own config dir
        return None
    task = METHODS[method]().task
    main = TASKS[task].main_presets
    on = dataset or _default_dataset()
    fitting = sorted(name for name, family_on in preset_families().items() if family_on == (task, on))
    if dataset is None and None in main:
        preset, why = main[None], "its CPU study"
    elif len(fitting) > 1:
        preset, why = main[dataset], f"the paper's main one of {', '.join(fitting)}"
    elif fitting:
        preset, why = fitting[0], ""
    else:
        return None
    settings = compose([f"method={method}", f"+experiment={preset}"]).method  # the method's, the preset's
    try:
        METHODS[method](**OmegaConf.to_container(settings, resolve=True))
    except (ConfigError, TypeError):  # a key or value the method does not take
        return None
    return preset, why


# Longer keys than this are no key of the config (Hydra would look for a file named after it).
_MAX_KEY = 200


def parse_overrides(overrides: list[str]) -> list:
    """Hydra's parse of `overrides`; a one-line ConfigError naming the override it cannot read, and how
    to write it."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, parsed = OverridesParser.create(), []
    for override in overrides:
        key, _, value = override.partition("=")
        if len(key) > _MAX_KEY:
            raise ConfigError(
                f"unknown key {key[:40]}... ({len(key)} characters): no config key is that long"
            )
        try:
            parsed.append(parser.parse_override(override))
        except Exception as e:
            if not value.isascii():  # Hydra's grammar reads unquoted values as ASCII
                raise ConfigError(
                    f"{override}: a value with characters outside ASCII must be quoted: '{key}=\"{value}\"'"
                ) from None
            reason = " ".join(str(e).split()).split(" See https://")[0]
            raise ConfigError(
                f"{override}: Hydra cannot read this override ({reason}); quote a value that holds spaces "
                f"or any of ()[]{{}},='\": '{key}=\"{value}\"'"
            ) from None
    return parsed


def without_other_options_settings(cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, str | None]:
    """`cfg` without the settings its preset gives a group's own option where the command line chose
    another option with no such key (`+method=csot model=cnn`: csot_digits' `model.hidden` is its MLP's),
    and the line that says so; keys the command line sets itself are kept (and checked as usual)."""
    parsed = parse_overrides(overrides)
    (preset, *_) = _given(parsed, "experiment") or [None]
    chosen, content = _preset_file(preset) if preset else ({}, {})
    given_keys = {o.key_or_group for o in parsed}
    left_out = []
    for group in sorted(OPTION_SCHEMAS.keys() & chosen.keys()):
        option = chosen[group]
        if (_given(parsed, group) or [option]) == [option]:
            continue
        valid = option_keys(group, cfg[group].get("name"))  # the schema `validate` checks the group with
        foreign = sorted(
            key
            for key in content.get(group) or {}
            if key not in valid and key in cfg[group] and f"{group}.{key}" not in given_keys
        )
        with open_dict(cfg):
            for key in foreign:
                del cfg[group][key]
        left_out += [f"{group}.{key} (for its {group} {option})" for key in foreign]
    if not left_out:
        return cfg, None
    return cfg, f"left out the preset's {', '.join(left_out)}"


def _given(parsed, key: str) -> list[str] | None:
    """The values `key` takes in the parsed overrides (several where swept); None where it is not given."""
    for o in reversed(parsed):
        if o.key_or_group == key:
            return list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]
    return None


def method_preset_override(overrides: list[str]) -> tuple[str | None, str | None]:
    """The `+experiment=PRESET` that (canonical) `overrides` get where every job they make has that
    `method_preset`, and the line that says so (or why a sweep gets none); (None, None) where they name
    an experiment or no method."""
    parsed = parse_overrides(overrides)
    methods, datasets = _given(parsed, "method"), _given(parsed, "dataset") or [None]
    if methods is None or _given(parsed, "experiment") is not None:
        return None, None
    chosen = {method_preset(m, d) for m in methods for d in datasets}
    names = sorted({c[0] if c else "none" for c in chosen})
    if len(names) > 1:
        return None, f"no preset: the swept jobs have different ones ({', '.join(names)}); name one"
    if chosen == {None}:
        return None, None
    ((preset, why),) = chosen
    on = "the default dataset" if datasets == [None] else f"dataset={','.join(datasets)}"
    note = f"preset: +experiment={preset} for +method={','.join(methods)} on {on}{', ' + why if why else ''}"
    return f"+experiment={preset}", f"{note} ({_OPT_OUT})"


def is_hydra_override(override: str) -> bool:
    """Whether an override (or its key) sets Hydra's own config, which does not shape the job config."""
    key = override.lstrip("+~").partition("=")[0]
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def fake_like_override(overrides: list[str]) -> str | None:
    """`dataset.like=SHAPE` where (canonical) `overrides` replace a preset's dataset by `dataset=fake` and
    name no shape: the generated images take the preset's dataset's (classes, image side)."""
    from runner.data.fake import LIKE

    parsed = parse_overrides(overrides)
    if _given(parsed, "dataset") != ["fake"] or _given(parsed, "dataset.like") is not None:
        return None
    presets = _given(parsed, "experiment") or []
    datasets = {_preset_file(preset)[0].get("dataset") for preset in presets}
    return f"dataset.like={LIKE[datasets.pop()]}" if len(datasets) == 1 and datasets <= LIKE.keys() else None


def variants(overrides: list[str]) -> list[list[str]]:
    """Override lists to check: every swept key at each of its values, the others at their first.

    Hydra's own keys are left out (they do not shape the job config); a continuous Optuna search space
    (`interval(a, b)`) is checked at both of its ends.
    """
    from hydra.core.override_parser.types import ValueType

    choices: list[tuple[str, list[str]]] = []
    for o in parse_overrides(overrides):
        if is_hydra_override(o.key_or_group):
            continue
        if o.value_type == ValueType.INTERVAL_SWEEP:
            ends = (o.value().start, o.value().end)  # Hydra reads both as floats; tag(int, ...) samples ints
            values = [int(v) if "int" in o.value().tags else v for v in ends]
        else:
            values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [None]
        choices.append(
            (
                o.input_line,
                [f"{o.get_key_element()}={v}" for v in values] if values[0] is not None else [o.input_line],
            )
        )
    first = [vals[0] for _, vals in choices]
    jobs = [first]
    for i, (_, vals) in enumerate(choices):  # each distinct value once (seed=0,0,1 checks seeds 0 and 1)
        jobs += [first[:i] + [v] + first[i + 1 :] for v in dict.fromkeys(vals[1:]) if v != vals[0]]
    return jobs


def compose(overrides: list[str]) -> DictConfig:
    """The job config of `overrides` (`+method=` read as `method=`); a one-line ConfigError if it fails."""
    overrides = canonical(overrides)
    return without_other_options_settings(_hydra_compose(overrides), overrides)[0]


def compose_hydra(overrides: list[str]) -> DictConfig:
    """The first job's config with the `hydra` node (launcher, sweeper, run dir) of the command line."""
    overrides = canonical(overrides)
    job = variants(overrides)[0] + [o for o in overrides if o.startswith(("hydra/", "hydra."))]
    return _hydra_compose(job, return_hydra_config=True)


def _hydra_compose(overrides: list[str], return_hydra_config: bool = False) -> DictConfig:
    """Hydra's compose of conf/config.yaml with `overrides`; its errors as one-line ConfigErrors: an
    option no search path holds with the group's choices, every unknown key with the valid ones."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return hydra_compose("config", overrides=overrides, return_hydra_config=return_hydra_config)
        except Exception as e:
            message = " ".join(str(e).split())
            missing = re.search(_MISSING_OPTION, message)
            if missing:  # a group option that no search path holds (conf/, --config-dir, hydra.searchpath)
                group, value, options = missing.groups()
                choices = ", ".join(options.split())
                raise ConfigError(f"{group}={value!r} is not an option; choices: {choices}") from None
            unknown = re.match(_UNKNOWN_KEY, message)
            if not unknown:  # e.g. a search space given as a hydra.* override
                raise ConfigError(message) from None
            raise _unknown_keys(hydra_compose, overrides, unknown.group(1), message) from None


def _unknown_keys(hydra_compose, overrides: list[str], key: str, message: str) -> ConfigError:
    """One error naming every unknown key of `overrides` (Hydra stops at the first, `key`), each with
    the keys that do exist where it was asked for; composed without them, the config tells those."""
    unknown: dict[str, list[str]] = {}  # parent -> its unknown keys, in command-line order
    while key is not None:
        unknown.setdefault(key.rpartition(".")[0], []).append(key)
        names = {k for keys in unknown.values() for k in keys}
        try:
            known = [o for o in overrides if o.partition("=")[0] not in names]
            base = hydra_compose("config", overrides=known)
            key = None
        except Exception as e:
            again = re.match(_UNKNOWN_KEY, " ".join(str(e).split()))
            if not again or again.group(1) in names:  # another kind of error, or no progress
                return ConfigError(message)
            key = again.group(1)
    clauses = []
    for parent, keys in unknown.items():
        node = OmegaConf.select(base, parent) if parent else base
        valid = ", ".join(node.keys()) if isinstance(node, DictConfig) else "none"
        plural, under = "s" if len(keys) > 1 else "", f" under {parent}" if parent else ""
        clauses.append(f"unknown key{plural} {', '.join(keys)}; valid keys{under}: {valid}")
    return ConfigError("; ".join(clauses))


def sweep_params(overrides: list[str]) -> list[str]:
    """The sweeper's `params` (search spaces from a config such as conf/sweep/*.yaml) as overrides, but
    for keys the command line sweeps itself (its value wins in the sweep)."""
    params = compose_hydra(overrides).hydra.sweeper.get("params") or {}
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    return [f"{key}={value}" for key, value in params.items() if key not in given]


def preflight(argv: list[str]) -> dict | None:
    """Compose and validate each job a command line would launch (in a sweep: each swept value, both ends
    of each search interval); raise ConfigError on the first bad one. Returns the first job's checked
    groups (None for help and info)."""
    overrides = job_overrides(argv)
    if overrides is None:
        return None
    preset, _ = method_preset_override(overrides)  # as `main` adds it (a no-op on main's own argv)
    overrides += [preset] if preset else []
    if {"-m", "--multirun"} & set(argv):
        overrides = sweep_params(overrides) + overrides
    searchpath = [o for o in overrides if o.lstrip("+").startswith("hydra.searchpath=")]  # users' groups
    jobs = variants(overrides)
    if len(jobs) >= _ANNOUNCED_CHECKS:
        print(
            f"runner: checking the configs of {len(jobs)} jobs before the first starts", file=sys.stderr
        )
    first = checked = texts = None
    for variant in jobs:
        try:
            if first is None:
                first = compose(searchpath + variant)
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
    overrides = job_overrides(argv)
    if overrides is None:
        return []
    extra = []
    if int(os.environ.get("RANK", 0)) > 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    multirun = {"-m", "--multirun"} & set(argv)
    if multirun:
        cfg = compose_hydra(overrides)
        if "optuna" in cfg.hydra.sweeper._target_:
            from runner.sweeper import check_settings, search_space

            sweeper = cfg.hydra.sweeper
            check_settings(sweeper.pruner, sweeper.direction, sweeper.n_trials, sweeper.n_jobs,
                           sweeper.max_failure_rate)  # fmt: skip
            search_space(sweep_params(overrides) + [o for o in overrides if not is_hydra_override(o)])
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


def apply_debug(cfg: DictConfig) -> str | None:
    """Bound a typed job config in place to `cfg.debug`: epochs, random subsets of the data of
    `max_batches` batches per split, and on the CPU its batches and image sides; its task bounds its own
    method keys (`Task.smoke`). Returns the line that says what smoke changed past the subsets, if any."""
    debug = cfg.get("debug")
    if debug is None:
        return None
    notes = ["random weights in place of the preset's pretrained ones"] if debug.random_weights else []
    if cfg.hardware.device == "cpu":
        notes += _cap_for_the_cpu(cfg, debug.cpu_batch, debug.cpu_side)
    if cfg.dataset.name == "fake" and cfg.train.select.startswith("best:val/"):  # the same restore
        cfg.train.select = "best:test/" + cfg.train.select.removeprefix("best:val/")
        notes.append(f"train.select={cfg.train.select} (generated data have no validation split)")
    cfg.train.epochs = min(cfg.train.epochs, debug.epochs)
    for key, batch in (("max_train", cfg.train.batch_size), ("max_eval", cfg.train.eval_batch_size)):
        cfg.dataset[key] = min(cfg.dataset[key] or math.inf, debug.max_batches * batch)
    task_of(cfg).smoke(cfg)
    return f"+debug=smoke: {'; '.join(notes)}" if notes else None


def _cap_for_the_cpu(cfg: DictConfig, batch: int, side: int) -> list[str]:
    """Cap the evaluation batch at `batch` (its subsets are `max_batches` of them: 2 x 1024 CIFAR images
    took a ResNeXt-29 most of a smoke minute) and, where the images are larger than 32 px (smaller ones
    train cheaply), every batch size at `batch` and every image side at `side`, in place; what it capped."""
    batches, sides = {}, {}  # the capped keys (a phase's as train.phases.*) and their values
    large = max([natural_side(cfg.dataset)] + [phase.image_size for phase in cfg.train.phases]) > 32
    keys = [(cfg.train, "batch_size", "train.batch_size")] if large else []
    keys += [(cfg.train, "eval_batch_size", "train.eval_batch_size")]
    keys += [(phase, "batch_size", "train.phases.*.batch_size") for phase in cfg.train.phases if large]
    for node, key, where in keys:
        if node[key] > batch:
            batches.setdefault(where, node[key])
            node[key] = batch
    if large and natural_side(cfg.dataset) > side:
        sides["dataset.image_size"] = natural_side(cfg.dataset)
        cfg.dataset.image_size = side
    for phase in cfg.train.phases if large else []:
        if phase.image_size > side:
            sides.setdefault("train.phases.*.image_size", phase.image_size)
            phase.image_size = side
    capped = [f"{', '.join(batches)} at {batch}"] if batches else []
    capped += [f"{', '.join(sides)} at {side} px"] if sides else []
    return [f"on the CPU, {' and '.join(capped)} (debug.cpu_batch, debug.cpu_side)"] if capped else []


@dataclasses.dataclass
class CommandLine:
    """A command line as Hydra is to parse it: `args` with `+method=` read as `method=`, the preset and
    generated-data shape it implies and the Hydra overrides its launch adds; the line naming the preset
    applied (`preset_note`); the first job's checked groups (`checked`; None for help and info)."""

    args: list[str]
    preset_note: str | None
    checked: dict | None


def command_line(args: list[str]) -> CommandLine:
    """Check every job of the command line `args` (`preflight`) and complete it for Hydra: what it
    records and composes again per job (a resume, `runner-eval`) is then the whole job."""
    args = canonical(args)
    preset, note = method_preset_override(job_overrides(args) or [])
    if preset:  # after the method, in the run of overrides that Hydra records (a resume repeats it)
        at = max(i for i, arg in enumerate(args) if arg.partition("=")[0] == "method")
        args.insert(at + 1, preset)
    like = fake_like_override(job_overrides(args) or [])
    if like:  # after dataset=fake, recorded as the preset's is
        args.insert(args.index("dataset=fake") + 1, like)
    checked = preflight(args)
    extra, given = launch_overrides(args), override_args(args)
    at = args.index(given[0]) if given else len(args)  # argparse wants one run of overrides
    args[at:at] = extra
    return CommandLine(args, note, checked)
