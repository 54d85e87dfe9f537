"""`runner`: compose dataset, model, hardware, logger (and an optional `+method=`), run its task.

Every job's config is checked before Hydra starts anything (`preflight`), so a typo in a 20-job sweep
fails in a second with one line naming the bad value and the valid choices, instead of in job 7.

Order-free composition: conf/config.yaml holds an empty `method` slot (`method: null`) that a preset
fills (`override /method: csot`) and the command line replaces; `+method=NAME` (the documented spelling)
is read as `method=NAME` (`canonical`), so `+method`, `+experiment` and `+debug` compose to the same
config in any order, in single runs and in every job a launcher or sweeper composes.

Method-aware defaults: `+method=NAME` without an `+experiment=` gets its family's preset for the dataset
(`method_preset`), added to the command line Hydra records, so a resume or `runner-eval` composes the
same; the job's first log line names it and the device `hardware=auto` chose.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import functools
import logging
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

import runner.data  # noqa: F401  (registers the datasets and their schemas)
import runner.hardware  # noqa: F401  (registers the resolvers of hardware=auto)
from runner import configs, rundir
from runner.data import missing_files
from runner.data.files import UnreadableImage
from runner.faults import CheckpointError, Diverged, Interrupted, JobFailed, OutOfMemory, out_of_memory_stops
from runner.schema import (
    OPTION_SCHEMAS,
    SCALARS,
    ConfigError,
    apply_debug,
    main_metric,
    option_keys,
    task_module,
    to_node,
    validate,
)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
configs.register()  # the method schemas: the base of each conf/method/*.yaml
log = logging.getLogger("runner")

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
# The launchers that log a line as each job starts (Hydra's basic one, joblib's).
_LAUNCHER_LOGGERS = (
    "hydra._internal.core_plugins.basic_launcher",
    "hydra_plugins.hydra_joblib_launcher._core",
)
_INFO_VALUES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def _override_args(argv: list[str]) -> list[str] | None:
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


def _job_overrides(argv: list[str]) -> list[str] | None:
    """The overrides that shape the jobs of `argv` (its `--config-dir` too), or None for help/info."""
    overrides = _override_args(argv)
    return None if overrides is None else _config_dirs(argv) + canonical(overrides)


# `+method=NAME` alone applies its family's preset (conf/experiment/*.yaml) for the dataset (README,
# "Usage"): a family is a task's methods, so CSOT's presets are its baselines' too. Where several presets
# fit one dataset, the paper's main one; on the default dataset (none named), the family's CPU study where
# that is not a preset of the default dataset.
_MAIN_PRESETS = {
    ("classify", "cifar100"): "comixup_cifar100_preactresnet18",  # Co-Mixup Table 1's first network
    ("hashing", "cifar100"): "hier_hash_cifar100_npairs",  # the setting of hier_hash.yaml's defaults
    ("hashing", "imagenet32"): "hier_hash_imagenet32_npairs",
    ("classify", None): "comixup_digits_canvas",
    ("hashing", None): "hier_hash_synthetic",
}
_OPT_OUT = "+experiment=none: without it"
_preset_note: str | None = None  # main's line on the preset it applied, the first line of the job's log


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
def _presets() -> dict[str, tuple[str, str | None]]:
    """Each preset of conf/experiment that names a method: its method's task and its dataset (None: it
    keeps the default)."""
    presets = {}
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        chosen, _ = _preset_file(path.stem)
        if "method" in chosen:
            presets[path.stem] = (configs.METHODS[chosen["method"]]().task, chosen.get("dataset"))
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
    if method not in configs.METHODS:  # a method of the user's own config dir
        return None
    task = configs.METHODS[method]().task
    on = dataset or _default_dataset()
    fitting = sorted(name for name, family_on in _presets().items() if family_on == (task, on))
    if dataset is None and (task, None) in _MAIN_PRESETS:
        preset, why = _MAIN_PRESETS[task, None], "its CPU study"
    elif len(fitting) > 1:
        preset, why = _MAIN_PRESETS[task, dataset], f"the paper's main one of {', '.join(fitting)}"
    elif fitting:
        preset, why = fitting[0], ""
    else:
        return None
    settings = _compose([f"method={method}", f"+experiment={preset}"]).method  # the method's, the preset's
    try:
        configs.METHODS[method](**OmegaConf.to_container(settings, resolve=True))
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
    typed = {o.key_or_group for o in parsed}
    left_out = []
    for group in sorted(OPTION_SCHEMAS.keys() & chosen.keys()):
        option = chosen[group]
        if (_given(parsed, group) or [option]) == [option]:
            continue
        valid = option_keys(group, cfg[group].get("name"))  # the schema `validate` checks the group with
        foreign = sorted(
            key
            for key in content.get(group) or {}
            if key not in valid and key in cfg[group] and f"{group}.{key}" not in typed
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


def _is_hydra(override: str) -> bool:
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


def _variants(overrides: list[str]) -> list[list[str]]:
    """Override lists to check: every swept key at each of its values, the others at their first.

    Hydra's own keys are left out (they do not shape the job config); a continuous Optuna search space
    (`interval(a, b)`) is checked at both of its ends.
    """
    from hydra.core.override_parser.types import ValueType

    choices: list[tuple[str, list[str]]] = []
    for o in parse_overrides(overrides):
        if _is_hydra(o.key_or_group):
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
    variants = [first]
    for i, (_, vals) in enumerate(choices):  # each distinct value once (seed=0,0,1 checks seeds 0 and 1)
        variants += [first[:i] + [v] + first[i + 1 :] for v in dict.fromkeys(vals[1:]) if v != vals[0]]
    return variants


def _compose(overrides: list[str]) -> DictConfig:
    """The job config of `overrides` (`+method=` read as `method=`); a one-line ConfigError if it fails."""
    from hydra import compose, initialize_config_dir

    overrides = canonical(overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return without_other_options_settings(compose("config", overrides=overrides), overrides)[0]
        except Exception as e:
            message = " ".join(str(e).split())
            missing = re.search(_MISSING_OPTION, message)
            if missing:  # a group option that no search path holds (conf/, --config-dir, hydra.searchpath)
                group, value, options = missing.groups()
                choices = ", ".join(options.split())
                raise ConfigError(f"{group}={value!r} is not an option; choices: {choices}") from None
            unknown = re.match(_UNKNOWN_KEY, message)
            if not unknown:
                raise ConfigError(message) from None
            raise _unknown_keys(compose, overrides, unknown.group(1), message) from None


def _unknown_keys(compose, overrides: list[str], key: str, message: str) -> ConfigError:
    """One error naming every unknown key of `overrides` (Hydra stops at the first, `key`), each with
    the keys that do exist where it was asked for; composed without them, the config tells those."""
    unknown: dict[str, list[str]] = {}  # parent -> its unknown keys, in command-line order
    while key is not None:
        unknown.setdefault(key.rpartition(".")[0], []).append(key)
        names = {k for keys in unknown.values() for k in keys}
        try:
            base = compose("config", overrides=[o for o in overrides if o.partition("=")[0] not in names])
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


def _compose_hydra(overrides: list[str]) -> DictConfig:
    """The first job's config with the `hydra` node (launcher, sweeper, run dir) of the command line."""
    from hydra import compose, initialize_config_dir

    overrides = canonical(overrides)
    job = _variants(overrides)[0] + [o for o in overrides if o.startswith(("hydra/", "hydra."))]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return compose("config", overrides=job, return_hydra_config=True)
        except Exception as e:  # e.g. a search space given as a hydra.* override
            raise ConfigError(" ".join(str(e).split())) from None


def _sweep_params(overrides: list[str]) -> list[str]:
    """The sweeper's `params` (search spaces from a config such as conf/sweep/*.yaml) as overrides, but
    for keys the command line sweeps itself (its value wins in the sweep)."""
    params = _compose_hydra(overrides).hydra.sweeper.get("params") or {}
    given = {o.partition("=")[0].lstrip("+~") for o in overrides}
    return [f"{key}={value}" for key, value in params.items() if key not in given]


def preflight(argv: list[str]) -> dict | None:
    """Compose and validate each job a command line would launch (in a sweep: each swept value, both ends
    of each search interval); raise ConfigError on the first bad one. Returns the first job's checked
    groups (None for help and info)."""
    overrides = _job_overrides(argv)
    if overrides is None:
        return None
    preset, _ = method_preset_override(overrides)  # as `main` adds it (a no-op on main's own argv)
    overrides += [preset] if preset else []
    if {"-m", "--multirun"} & set(argv):
        overrides = _sweep_params(overrides) + overrides
    searchpath = [o for o in overrides if o.lstrip("+").startswith("hydra.searchpath=")]  # users' groups
    variants = _variants(overrides)
    if len(variants) >= _ANNOUNCED_CHECKS:
        print(
            f"runner: checking the configs of {len(variants)} jobs before the first starts", file=sys.stderr
        )
    first = checked = texts = None
    for variant in variants:
        try:
            if first is None:
                first = _compose(searchpath + variant)
                checked = validate(first)
                texts = {
                    g: OmegaConf.to_yaml(first[g]) for g in checked if isinstance(first.get(g), DictConfig)
                }
                continue
            changed = _one_plain_value(first, variants[0], variant)
            if changed is None:
                validate(_compose(searchpath + variant))
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


def _typed(cfg: DictConfig, schemas: dict) -> DictConfig:
    """The job config with every schema default filled in (what tasks read and what is saved)."""
    typed = OmegaConf.create({"seed": cfg.seed, "name": cfg.get("name", "run")})
    for group, obj in schemas.items():
        typed[group] = to_node(obj) if dataclasses.is_dataclass(obj) else obj
    return typed


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _job(cfg: DictConfig) -> float | None:
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode.name == "MULTIRUN"
    # Whatever ends the job, `cleanup` finishes its W&B run, leaves the process group, frees the run dir.
    with contextlib.ExitStack() as cleanup:
        try:
            return _run(cfg, cleanup)
        except (KeyboardInterrupt, Interrupted) as e:
            stop = signal.Signals(getattr(e, "signum", signal.SIGINT))
            print(f"runner: stopped by {stop.name}; resume with: {_resume_hint(hydra_cfg)}", file=sys.stderr)
            _no_sweep_table()
            sys.exit(128 + stop)
        # bad input, or a run gone wrong
        except (ConfigError, Diverged, CheckpointError, OutOfMemory, UnreadableImage) as e:
            if multirun:  # the sweep goes on; SweepSummary lists the job as failed
                raise JobFailed(e) from e
            print(f"runner: error: {e}", file=sys.stderr)
            sys.exit(2 if isinstance(e, ConfigError) else 1)


def _resume_hint(hydra_cfg) -> str:
    """The command that resumes the job (checkpoints/last.pt of its run dir), and in a sweep the sweep."""
    hint = rundir.resume_command(hydra_cfg.runtime.output_dir, hydra_cfg.overrides.task)
    if hydra_cfg.mode.name == "MULTIRUN":
        hint += f" (the whole sweep: its command line with hydra.sweep.dir={hydra_cfg.sweep.dir})"
    return hint


def _run(cfg: DictConfig, cleanup: contextlib.ExitStack) -> float | None:
    """One job: validate, lock the run dir, set up device and tracker, run the task, write the summary."""
    from runner.hardware import (
        RunContext,
        cap_host_memory,
        capped_workers,
        describe,
        seed_everything,
        setup,
        teardown,
    )
    from runner.track import Tracker, log_to_file

    t0 = time.perf_counter()
    hydra_cfg = HydraConfig.get()
    cfg, left_out = without_other_options_settings(cfg, list(hydra_cfg.overrides.task))
    print_config, multirun = cfg.get("print_config", False), hydra_cfg.mode.name == "MULTIRUN"
    cfg = _typed(cfg, validate(cfg))
    smoke_note = apply_debug(cfg)
    cfg.hardware.num_workers = capped_workers(cfg.hardware.num_workers)
    if multirun and cfg.logger.group is None:  # one W&B group per sweep
        cfg.logger.group = "/".join(Path(hydra_cfg.sweep.dir).parts[-2:])
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if multirun:  # a sweep's console: one line per job (below); the job's records go to its log file
        for handler in logging.getLogger().handlers:
            if not isinstance(handler, logging.FileHandler):
                handler.setLevel(logging.WARNING)
    cleanup.callback(teardown)
    device, rank, world_size = setup(cfg.hardware)
    if device.type == "cpu":  # running out of memory: an error that names the batch, not the OOM killer
        cap_host_memory()
    if rank == 0:  # the first line: what the runner chose for the command line (a preset, the device)
        log.info("; ".join(filter(None, [_preset_note, left_out, describe(cfg.hardware, device)])))
        if smoke_note:
            log.info(smoke_note)
    if world_size > 1:  # torchrun's ranks: rank 0's run dir (another rank's clock may name another)
        run_dir = rundir.shared(run_dir, rank)
    if rank == 0:
        rundir.lock(run_dir)
        cleanup.callback(rundir.unlock, run_dir)
    resume = rundir.check_resume(run_dir, cfg)
    seed_everything(cfg.seed, cfg.hardware.deterministic, rank)
    if rank == 0:
        OmegaConf.save(cfg, run_dir / "config.yaml")
        # 70 lines: on the console only when asked for, or a run's own lines scroll away behind them
        log_to_file(log, logging.INFO, "config (validated):\n%s", OmegaConf.to_yaml(cfg).rstrip(),
                    console=print_config)  # fmt: skip
    tracker = Tracker(run_dir, cfg.logger, OmegaConf.to_container(cfg), enabled=rank == 0, resume=resume)
    cleanup.callback(tracker.close, exit_code=1)  # a no-op after tracker.finish
    ctx = RunContext(
        device,
        run_dir,
        tracker,
        precision=cfg.hardware.precision,
        channels_last=cfg.hardware.channels_last,
        compile=cfg.hardware.compile,
        cuda_graph=cfg.hardware.cuda_graph,
        sync_bn=cfg.hardware.sync_bn,
        rank=rank,
        world_size=world_size,
        num_workers=cfg.hardware.num_workers,
    )
    module = task_module(cfg)
    method = cfg.method.name if "method" in cfg else "erm"
    data_name = getattr(module, "data_name", lambda c: c.dataset.name)(cfg)  # a task may name its own data
    log.info(
        "%s: method=%s dataset=%s model=%s device=%s seed=%d -> %s",
        module.__name__,
        method,
        data_name,
        cfg.model.name,
        device,
        cfg.seed,
        run_dir,
    )
    outside_fit = (  # `fit` names the batch itself
        "ran out of {} outside the training steps; lower the network's size, or train.eval_batch_size for "
        "the passes over whole splits"
    )
    with out_of_memory_stops(outside_fit.format):
        metrics = module.run(cfg, ctx)  # fills ctx.info (the model's parameter count) as it goes
    summary = {"name": cfg.name, "tags": list(cfg.logger.tags), **ctx.info, **metrics}
    summary["time/total_s"] = time.perf_counter() - t0
    metric = main_metric(cfg, module.METRIC)[0]  # the task's, or the preset's headline (`metric:`)
    # A non-finite main metric or search objective fails the run (for the report, and for Optuna).
    bad = [f"{k}={summary[k]}" for k in {metric, _objective_key(metric)} if _non_finite(summary.get(k))]
    if bad:
        summary["error"] = f"Diverged: {', '.join(sorted(bad))}"
    tracker.finish(summary)
    if bad:
        raise Diverged(f"{', '.join(sorted(bad))} in {run_dir / 'summary.json'}")
    if rank == 0:
        shown = [metric] if multirun else [k for k in summary if k == metric or k.startswith("test/")][:6]
        values = "  ".join(f"{k}={summary[k]:.4f}" for k in shown if isinstance(summary[k], float))
        seconds = f"({summary['time/total_s']:.1f} s)"
        if multirun:
            print(f"#{hydra_cfg.job.num} done  {' '.join(hydra_cfg.overrides.task)}: {values}  {seconds}")
        else:
            summary_path = run_dir / "summary.json"
            print(f"{module.__name__} {method} on {data_name}: {values}  {seconds} -> {summary_path}")
    score = summary.get(_objective_key(metric))  # what a search optimises: never the test metric
    return float(score) if score is not None else None


def _non_finite(value) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _objective_key(metric: str) -> str:
    """The validation twin of a task's METRIC (`test/acc` -> `val/acc`); an unsupervised score as is."""
    return "val/" + metric.removeprefix("test/") if metric.startswith("test/") else metric


def objective(module, cfg) -> str:
    """The summary key an Optuna search optimises for `cfg`: `_objective_key` of the task's METRIC.
    A ConfigError (one line, before any trial) when that needs a validation split `cfg` lacks."""
    metric = main_metric(cfg, module.METRIC)[0]
    key = _objective_key(metric)
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


def _launch_overrides(argv: list[str]) -> list[str]:
    """Hydra overrides a launch adds (README, "Sweeps"): the Optuna direction of the task's METRIC and
    a search that goes on past failed trials (unless given), no Hydra files from torchrun ranks but 0."""
    overrides = _job_overrides(argv)
    if overrides is None:
        return []
    extra = []
    if int(os.environ.get("RANK", 0)) > 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    multirun = {"-m", "--multirun"} & set(argv)
    if multirun:
        cfg = _compose_hydra(overrides)
        if "optuna" in cfg.hydra.sweeper._target_:
            from runner.sweeper import check_settings, search_space

            sweeper = cfg.hydra.sweeper
            check_settings(sweeper.pruner, sweeper.direction, sweeper.n_trials, sweeper.n_jobs,
                           sweeper.max_failure_rate)  # fmt: skip
            search_space(_sweep_params(overrides) + [o for o in overrides if not _is_hydra(o)])
            objective(task_module(cfg), cfg)  # selects on validation data, or stops here
            direction = {"max": "maximize", "min": "minimize"}[main_metric(cfg, task_module(cfg).METRIC)[1]]
            # A failed or diverged trial is told to Optuna as failed; the search goes on.
            defaults = {"direction": direction, "max_failure_rate": 1.0}
            extra += [
                f"hydra.sweeper.{key}={value}"
                for key, value in defaults.items()
                if not any(o.startswith(f"hydra.sweeper.{key}=") for o in overrides)
            ]
    return extra


def _claim_run_dir(argv: list[str]) -> None:
    """A single run into an existing run dir (a resume): lock it and check the resume before Hydra
    rewrites the dir's .hydra/ files; `_run` takes the same lock again and releases it."""
    overrides = _job_overrides(argv)
    if overrides is None or {"-m", "--multirun"} & set(argv):
        return
    cfg = _compose_hydra(overrides)
    run_dir = Path(cfg.hydra.run.dir)
    if not run_dir.is_dir():
        return
    with open_dict(cfg):
        del cfg["hydra"]
    typed = _typed(cfg, validate(cfg))
    apply_debug(typed)
    if int(os.environ.get("RANK", 0)) == 0:
        rundir.lock(run_dir)
        atexit.register(rundir.unlock, run_dir)  # should Hydra fail before the job
    rundir.check_resume(run_dir, typed)


def _quiet_optuna() -> None:
    """Optuna logs in colour through its own handler and its storage layer (alembic) announces each
    plugin at INFO: keep both out of a search's log (the sweeper's own lines and the trials' remain)."""
    import optuna

    optuna.logging.disable_default_handler()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def _check_writable(argv: list[str]) -> None:
    """A one-line ConfigError where the run (or sweep) dir of `argv` cannot be written: a read-only file
    system or folder (the working directory, for the default `outputs/`), before Hydra makes it."""
    overrides = _job_overrides(argv)
    key = "hydra.sweep.dir" if {"-m", "--multirun"} & set(argv) else "hydra.run.dir"
    where = Path(OmegaConf.select(_compose_hydra(overrides), key))
    existing = next(p for p in [where, *where.absolute().parents] if p.exists())
    if os.access(existing, os.W_OK):
        return
    why = "a read-only file system" if os.statvfs(existing).f_flag & os.ST_RDONLY else "no write permission"
    raise ConfigError(
        f"{key}={where}: cannot write in {existing.absolute()} ({why}); give {key}=A_WRITABLE_FOLDER "
        f"(a run dir's copy there resumes it), or start runner from a writable folder"
    )


def main() -> None:
    try:
        _main()
    except KeyboardInterrupt:  # outside a job (a job reports its own, with the command to resume it)
        print("runner: interrupted before any job started; nothing was written", file=sys.stderr)
        sys.exit(130)


def _main() -> None:
    sys.argv[1:] = canonical(sys.argv[1:])  # what Hydra parses, records and re-composes per job
    if any(a.startswith("+sweep=") or a.startswith("hydra/sweeper=optuna") for a in sys.argv[1:]):
        _quiet_optuna()
    try:
        global _preset_note
        preset, _preset_note = method_preset_override(_job_overrides(sys.argv[1:]) or [])
        if preset:  # after the method, in the run of overrides that Hydra records (a resume repeats it)
            at = max(i for i, arg in enumerate(sys.argv) if arg.partition("=")[0] == "method")
            sys.argv.insert(at + 1, preset)
        like = fake_like_override(_job_overrides(sys.argv[1:]) or [])
        if like:  # after dataset=fake, recorded as the preset's is
            sys.argv.insert(sys.argv.index("dataset=fake") + 1, like)
        checked = preflight(sys.argv[1:])
        runs = checked is not None and not {"-c", "--cfg", "-i", "--info"} & set(sys.argv)  # not a printout
        missing = runs and not {"-m", "--multirun"} & set(sys.argv) and missing_files(checked["dataset"])
        if missing:  # before a run dir is made for it (a sweep's job without its data fails alone)
            raise ConfigError(missing)
        extra, given = _launch_overrides(sys.argv[1:]), _override_args(sys.argv[1:])
        if runs:
            _check_writable(sys.argv[1:])
        _claim_run_dir(sys.argv[1:])
        at = sys.argv.index(given[0]) if given else len(sys.argv)  # argparse wants one run of overrides
        sys.argv[at:at] = extra
    except ConfigError as e:
        print(f"runner: error: {e}", file=sys.stderr)
        sys.exit(2)
    if {"-m", "--multirun"} & set(sys.argv):
        for launcher in _LAUNCHER_LOGGERS:  # each job's own line says what it ran, once it has
            logging.getLogger(launcher).addFilter(lambda record: not str(record.msg).startswith("\t#"))
    try:
        _job()
    except KeyboardInterrupt:  # outside a job (a job reports its own, with the command to resume it)
        sweep = HydraConfig.get().sweep.dir if HydraConfig.initialized() else None
        resume = f" with hydra.sweep.dir={sweep}" if sweep else ""
        print(f"runner: interrupted between jobs; its command line{resume} runs the rest", file=sys.stderr)
        _no_sweep_table()
        sys.exit(130)


def _no_sweep_table() -> None:
    """No table at the exit of a stopped sweep: its results are partial, and the imports it needs may
    have been cut short (scipy's: "name '_ndimage_api' is not defined")."""
    report = sys.modules.get("runner.report")
    if report is not None:
        atexit.unregister(report.print_sweep_summary)


def run_in_process(args: list[str]) -> None:
    """`runner ARGS` as a call, for tools that start several runs in one process (`make bench-gpu`, the
    device-tracking harness): a finished run returns, a failed one raises its SystemExit, and sys.argv
    is left as it was."""
    saved, sys.argv = sys.argv, ["runner", *args]
    try:
        main()
    except SystemExit as stop:
        if stop.code:
            raise
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
