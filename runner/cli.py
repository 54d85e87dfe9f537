"""`runner`: compose dataset, model, hardware, logger (and an optional `+method=`), run its task.

Every job's config is checked before Hydra starts anything (`preflight`), so a typo in a 20-job sweep
fails in a second with one line naming the bad value and the valid choices, instead of in job 7.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from runner.schema import ConfigError, apply_debug, task_module, validate

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
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


def _check_group_choice(group: str, value: str) -> None:
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    if value not in options:
        raise ConfigError(f"{group}={value!r} is not an option; choices: {', '.join(options)}")


def _variants(overrides: list[str]) -> list[list[str]]:
    """Override lists to check: every swept key at each of its values, the others at their first.

    Hydra's own keys are left out (they do not shape the job config); so are continuous Optuna
    search spaces (`interval(...)`), which have no values to list.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"}
    choices: list[tuple[str, list[str]]] = []
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as e:
        raise ConfigError(" ".join(str(e).split())) from None
    for o in parsed:
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or o.value_type == ValueType.INTERVAL_SWEEP:
            continue
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [None]
        if key in groups and not o.is_delete():
            for v in values:
                _check_group_choice(key, v if v is not None else o.get_value_element_as_str())
        if key == "method" and not o.is_add() and not o.is_force_add():
            raise ConfigError("method is appended, not replaced: write +method=NAME")
        choices.append(
            (
                o.input_line,
                [f"{o.get_key_element()}={v}" for v in values] if values[0] is not None else [o.input_line],
            )
        )
    first = [vals[0] for _, vals in choices]
    variants = [first]
    for i, (_, vals) in enumerate(choices):
        variants += [first[:i] + [v] + first[i + 1 :] for v in vals[1:]]
    return variants


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        try:
            return compose("config", overrides=overrides)
        except Exception as e:
            message = " ".join(str(e).split())
            unknown = re.match(r"Could not override '([^']+)'", message)
            if not unknown:
                raise ConfigError(message) from None
            # Name the keys that do exist where the unknown one was asked for.
            key = unknown.group(1)
            parent, _, leaf = key.rpartition(".")
            base = compose("config", overrides=[o for o in overrides if not o.startswith(key + "=")])
            node = OmegaConf.select(base, parent) if parent else base
            valid = ", ".join(node.keys()) if isinstance(node, DictConfig) else "none"
            raise ConfigError(
                f"unknown key {key}; valid keys{' under ' + parent if parent else ''}: {valid}"
            ) from None


def preflight(argv: list[str]) -> None:
    """Compose and validate each job a command line would launch; raise ConfigError on the first bad one."""
    overrides = _override_args(argv)
    if overrides is None:
        return
    for variant in _variants(overrides):
        validate(_compose(variant))


def _typed(cfg: DictConfig, schemas: dict) -> DictConfig:
    """The job config with every schema default filled in (what tasks read and what is saved)."""
    typed = OmegaConf.create({"seed": cfg.seed, "name": cfg.get("name", "run")})
    for group, obj in schemas.items():
        typed[group] = OmegaConf.structured(obj)
    return typed


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _job(cfg: DictConfig) -> float | None:
    try:
        return _run(cfg)
    except ConfigError as e:  # bad input found while building data, model or device: one line
        if HydraConfig.get().mode.name == "MULTIRUN":
            raise
        print(f"runner: error: {e}", file=sys.stderr)
        sys.exit(2)


def _run(cfg: DictConfig) -> float | None:
    """One job: validate, set up device and tracker, run the task, write the summary."""
    from runner.hardware import RunContext, seed_everything, setup, teardown
    from runner.track import Tracker

    t0 = time.perf_counter()
    cfg = _typed(cfg, validate(cfg))
    apply_debug(cfg)
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode.name == "MULTIRUN" and cfg.logger.group is None:  # one W&B group per sweep
        cfg.logger.group = "/".join(Path(hydra_cfg.sweep.dir).parts[-2:])
    device, rank, world_size = setup(cfg.hardware)
    seed_everything(cfg.seed, cfg.hardware.deterministic)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    if rank == 0:
        OmegaConf.save(cfg, run_dir / "config.yaml")
    tracker = Tracker(run_dir, cfg.logger, OmegaConf.to_container(cfg), enabled=rank == 0)
    ctx = RunContext(
        device,
        run_dir,
        tracker,
        amp=cfg.hardware.amp,
        rank=rank,
        world_size=world_size,
        num_workers=cfg.hardware.num_workers,
    )
    module = task_module(cfg)
    method = cfg.method.name if "method" in cfg else "erm"
    log.info(
        "%s: method=%s dataset=%s model=%s device=%s seed=%d -> %s",
        module.__name__,
        method,
        cfg.dataset.name,
        cfg.model.name,
        device,
        cfg.seed,
        run_dir,
    )
    summary = dict(module.run(cfg, ctx))
    summary["time/total_s"] = time.perf_counter() - t0
    tracker.finish(summary)
    teardown()
    metric = module.METRIC[0]
    if rank == 0:
        shown = [k for k in summary if k == metric or k.startswith("test/")][:6]
        print(
            f"{module.__name__} {method} on {cfg.dataset.name}: "
            + "  ".join(f"{k}={summary[k]:.4f}" for k in shown if isinstance(summary[k], float))
            + f"  ({summary['time/total_s']:.1f} s) -> {run_dir / 'summary.json'}"
        )
    value = summary.get(metric)
    return float(value) if value is not None else None


def _launch_overrides(argv: list[str]) -> list[str]:
    """Hydra overrides a launch adds (README, "Sweeps"): the Optuna direction of the task's METRIC
    (unless given), and no Hydra files from torchrun ranks other than 0."""
    overrides = _override_args(argv)
    if overrides is None:
        return []
    extra = []
    if int(os.environ.get("RANK", 0)) > 0:
        extra += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    multirun = {"-m", "--multirun"} & set(argv)
    if multirun and not any(o.startswith("hydra.sweeper.direction=") for o in overrides):
        from hydra import compose, initialize_config_dir

        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            choices = [o for o in overrides if o.startswith("hydra/")]
            cfg = compose("config", overrides=_variants(overrides)[0] + choices, return_hydra_config=True)
        if "optuna" in cfg.hydra.sweeper._target_:
            direction = {"max": "maximize", "min": "minimize"}[task_module(cfg).METRIC[1]]
            extra.append(f"hydra.sweeper.direction={direction}")
    return extra


def main() -> None:
    try:
        preflight(sys.argv[1:])
        extra, given = _launch_overrides(sys.argv[1:]), _override_args(sys.argv[1:])
        at = sys.argv.index(given[0]) if given else len(sys.argv)  # argparse wants one run of overrides
        sys.argv[at:at] = extra
    except ConfigError as e:
        print(f"runner: error: {e}", file=sys.stderr)
        sys.exit(2)
    _job()


if __name__ == "__main__":
    main()
