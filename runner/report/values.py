"""The runs' values as the report reads, compares, orders and shows them."""

from __future__ import annotations

import json
import math
import re

import yaml


def parse_scalar(text: str):
    """A command-line override's value as YAML reads it; a number YAML 1.1 leaves a string, as a float."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
        try:
            number = float(value)
            return number if math.isfinite(number) else value
        except ValueError:
            pass
    return value


def value_at(config: dict, key: str):
    """`config`'s value at a dotted key; a config group (model=cnn) gives its name."""
    node = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node = node.get("name")
    return node


def same(a, b) -> bool:
    if is_number(a) and is_number(b):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return hashable(a) == hashable(b)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def hashable(v):
    return json.dumps(v, sort_keys=True) if isinstance(v, (list, dict)) else v


def sort_key(v):
    return (0, float(v), "") if is_number(v) else (1, 0.0, str(v))


def show(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def natural_key(text: str) -> list:
    return [(0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text)]


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def params_label(params: dict) -> str:
    return ", ".join(f"{k}={show(v)}" for k, v in params.items())


def mean_std(mean: float, std: float) -> str:
    """Four significant digits of the mean; the std to the same decimal place."""
    digits = 3 - math.floor(math.log10(abs(mean))) if mean and math.isfinite(mean) else 4
    digits = min(max(digits, 0), 8)
    return f"{mean:.{digits}f}" + ("" if math.isnan(std) else f" ± {std:.{digits}f}")
