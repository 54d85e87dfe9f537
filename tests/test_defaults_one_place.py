"""Each default is written once: in the group's schema dataclass (runner/schema.py, a dataset's or model's
own schema, a method's in runner/configs), which Hydra's ConfigStore hands to the YAML options as their
base. A YAML option sets only what differs from it (and its `name`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import runner.data  # noqa: F401  (registers the datasets' schemas)
from runner.compose import CONF_DIR
from runner.configs import METHODS
from runner.schema import OPTION_SCHEMAS, TOP_LEVEL, DebugConfig, TrainConfig


def schema_of(group: str, name: str) -> type:
    if group == "method":
        return METHODS[name]
    if group == "debug":
        return DebugConfig
    return OPTION_SCHEMAS.get(group, {}).get(name, TOP_LEVEL[group])


def restated(node: dict, defaults: dict, where: str) -> list[str]:
    """The keys of a YAML `node` whose value is its schema's default (nested mappings key by key)."""
    found = []
    for key, value in node.items():
        if key in ("defaults", "name") or key not in defaults:
            continue
        if isinstance(value, dict) and isinstance(defaults[key], dict):
            found += restated(value, defaults[key], f"{where}.{key}")
        elif value == defaults[key] and type(value) is type(defaults[key]):
            found.append(f"{where}.{key}={value!r}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == defaults[key]:
            found.append(f"{where}.{key}={value!r}")  # 10 for 10.0
    return found


GROUPS = ("dataset", "model", "hardware", "logger", "method", "debug")
OPTIONS = sorted(path for group in GROUPS for path in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("path", OPTIONS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_a_yaml_option_sets_no_schema_default(path: Path):
    node = yaml.safe_load(path.read_text()) or {}
    schema = schema_of(path.parent.name, node.get("name", path.stem))
    assert restated(node, dataclasses.asdict(schema()), path.parent.name) == []


def test_the_primary_config_sets_no_group_default():
    node = yaml.safe_load((CONF_DIR / "config.yaml").read_text())
    found = [key for group, schema in TOP_LEVEL.items() if group in node
             for key in restated(node[group], dataclasses.asdict(schema()), group)]  # fmt: skip
    assert found == []


def test_a_restated_default_is_found():
    """The check above can fail: `lr: 0.1` and `epochs: 30` are TrainConfig's own; 0.2 is not."""
    node = {"lr": 0.1, "epochs": 30.0, "momentum": 0.5, "phases": []}
    assert restated(node, dataclasses.asdict(TrainConfig()), "train") == [
        "train.lr=0.1", "train.epochs=30.0", "train.phases=[]"
    ]  # fmt: skip
