"""The one-line config errors and the checks behind them: choices, ranges, and choices declared as types.

A schema field typed `Literal["a", "b"]` (or `list[Literal[...]]`) is checked by `check_literals` against
its choices, so the choices are written once, in the type. This module imports nothing of the runner:
the schemas of every part (runner.schema, runner.configs, the datasets) build on it.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad config value; the message is one line meant for the user."""


def check_choice(key: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(
            f"{key}={value!r} is not a valid choice; choose one of: {', '.join(map(str, choices))}"
        )


def at_least(default, lowest):
    """A schema field: its default and the lowest value it allows, checked by `check_lowest`."""
    return dataclasses.field(default=default, metadata={"lowest": lowest})


def check_lowest(group: str, obj) -> None:
    """`check_range` of each field of the schema object `obj` declared by `at_least`, from its lowest."""
    for field in dataclasses.fields(obj):
        if "lowest" in field.metadata:
            check_range(f"{group}.{field.name}", getattr(obj, field.name), field.metadata["lowest"])


def check_range(key: str, value, lo=None, hi=None, lo_open=False, hi_open=False) -> None:
    """Raise unless lo <= value <= hi (strict where `*_open`); NaN is in no range."""
    bad = (
        value != value
        or (lo is not None and (value < lo or (lo_open and value == lo)))
        or (hi is not None and (value > hi or (hi_open and value == hi)))
    )
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        interval = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}{right}"
        raise ConfigError(f"{key}={value!r} is out of range; must be in {interval}")


def choices(tp) -> tuple | None:
    """The choices of a `Literal[...]` type, else None."""
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None


@functools.cache
def field_types(schema: type) -> dict[str, Any]:
    """A dataclass's field types, string annotations (`from __future__ import annotations`) resolved."""
    return typing.get_type_hints(schema)


def check_literals(obj, path: str) -> None:
    """Check every `Literal` field of the dataclass `obj` (and every item of a `list[Literal]` field)."""
    for name, tp in field_types(type(obj)).items():
        value = getattr(obj, name)
        if (allowed := choices(tp)) is not None:
            check_choice(f"{path}.{name}", value, allowed)
        elif typing.get_origin(tp) is list and (allowed := choices(typing.get_args(tp)[0])) is not None:
            for item in value:
                check_choice(f"{path}.{name}", item, allowed)


@functools.cache
def omegaconf_type(schema: type) -> type:
    """`schema` as OmegaConf can type it: a twin dataclass with each `Literal` field typed by its choices'
    type (OmegaConf knows no `Literal`), nested dataclasses likewise; `schema` itself when it has none."""
    fields, changed = [], False
    for f in dataclasses.fields(schema):
        tp = plain = field_types(schema)[f.name]
        if choices(tp) is not None:
            plain = type(choices(tp)[0])
        elif typing.get_origin(tp) is list and choices(typing.get_args(tp)[0]) is not None:
            plain = list[type(choices(typing.get_args(tp)[0])[0])]
        elif dataclasses.is_dataclass(tp):
            plain = omegaconf_type(tp)
        changed |= plain is not tp
        default = (
            {"default": f.default}
            if f.default is not dataclasses.MISSING
            else {"default_factory": f.default_factory}
        )
        fields.append((f.name, plain, dataclasses.field(metadata=f.metadata, **default)))
    return dataclasses.make_dataclass(schema.__name__, fields) if changed else schema


def build(schema: type, values: dict):
    """`schema(**values)`, nested dataclass fields built from their dicts (what `OmegaConf.to_object`
    does for an `omegaconf_type` twin): `__post_init__` runs its checks."""
    types = field_types(schema)
    return schema(
        **{
            k: build(types[k], v) if dataclasses.is_dataclass(types[k]) and isinstance(v, dict) else v
            for k, v in values.items()
        }
    )
