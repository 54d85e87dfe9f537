"""Presets: the `+experiment=` preset a `+method=` line gets (`method_preset`: one the method declares,
`runner.configs.register_method(presets=)`), the settings of a preset dropped where the command line
chose another option of its group, and the generated data's shape where `dataset=fake` replaces a
preset's dataset."""

from __future__ import annotations

import functools

import yaml
from omegaconf import DictConfig, open_dict

from runner.configs import METHODS, TASKS
from runner.overrides import CONF_DIR, given, parse_overrides
from runner.schema import OPTION_SCHEMAS
from runner.validate import option_keys

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
    """Each preset a method declares (`TaskEntry.presets`, its task's view): its task and its dataset
    (None: it keeps the default)."""
    declared = {preset: task for task, entry in TASKS.items() for preset in entry.presets}
    return {preset: (declared[preset], _preset_file(preset)[0].get("dataset")) for preset in sorted(declared)}


@functools.cache
def _default_dataset() -> str:
    defaults = yaml.safe_load((CONF_DIR / "config.yaml").read_text())["defaults"]
    return next(entry["dataset"] for entry in defaults if isinstance(entry, dict) and "dataset" in entry)


@functools.cache
def method_preset(method: str, dataset: str | None) -> tuple[str, str] | None:
    """The preset `+method=METHOD` applies on `dataset` (None: none named, the default) and why that one:
    of the presets it declares (`register_method(presets=)`), the one choosing that dataset, or the
    task's main one there (`TaskEntry.main_presets`); None where none is declared for it there."""
    if method not in METHODS:  # a method of the user's own config dir
        return None
    entry = TASKS[METHODS[method]().task]
    main, on = entry.main_presets, dataset or _default_dataset()
    serving = {preset for preset, methods in entry.presets.items() if method in methods}
    fitting = sorted(preset for preset in serving if preset_families()[preset][1] == on)
    if dataset is None and main.get(None) in serving:
        return main[None], "its CPU study"
    if len(fitting) > 1:
        return main[dataset], f"the paper's main one of {', '.join(fitting)}"
    return (fitting[0], "") if fitting else None


def without_other_options_settings(cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, str | None]:
    """`cfg` without the settings its preset gives a group's own option where the command line chose
    another option with no such key (`+method=csot model=cnn`: csot_digits' `model.hidden` is its MLP's),
    and the line that says so; keys the command line sets itself are kept (and checked as usual)."""
    parsed = parse_overrides(overrides)
    (preset, *_) = given(parsed, "experiment") or [None]
    chosen, content = _preset_file(preset) if preset else ({}, {})
    given_keys = {o.key_or_group for o in parsed}
    left_out = []
    for group in sorted(OPTION_SCHEMAS.keys() & chosen.keys()):
        option = chosen[group]
        if (given(parsed, group) or [option]) == [option]:
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


def method_preset_override(overrides: list[str]) -> tuple[str | None, str | None]:
    """The `+experiment=PRESET` that (canonical) `overrides` get where every job they make has that
    `method_preset`, and the line that says so (or why a sweep gets none); (None, None) where they name
    an experiment or no method."""
    parsed = parse_overrides(overrides)
    methods, datasets = given(parsed, "method"), given(parsed, "dataset") or [None]
    if methods is None or given(parsed, "experiment") is not None:
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


def fake_like_override(overrides: list[str]) -> str | None:
    """`dataset.like=SHAPE` where (canonical) `overrides` replace a preset's dataset by `dataset=fake` and
    name no shape: the generated images take the preset's dataset's (classes, image side)."""
    from runner.data.fake import LIKE

    parsed = parse_overrides(overrides)
    if given(parsed, "dataset") != ["fake"] or given(parsed, "dataset.like") is not None:
        return None
    presets = given(parsed, "experiment") or []
    datasets = {_preset_file(preset)[0].get("dataset") for preset in presets}
    return f"dataset.like={LIKE[datasets.pop()]}" if len(datasets) == 1 and datasets <= LIKE.keys() else None
