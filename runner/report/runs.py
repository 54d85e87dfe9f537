"""Reading the runs under a run or multirun dir: each run's overrides, config, summary and its preset's
`paper:` numbers, grouped into the settings of the swept parameters (`build_report`), and the claims file
to check them against."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from runner.configs import TASKS
from runner.metrics import parse_metric
from runner.overrides import CONF_DIR
from runner.report.values import hashable, is_number, natural_key, parse_scalar, sort_key, value_at
from runner.schema import main_metric

REPLICATE_KEY = "seed"
WALL_KEY = "time/total_s"  # written by the CLI into every summary.json: the job's wall time
MAX_EXTRA_COLUMNS = 4
_SKIP_DIRS = {".hydra", ".submitit", "wandb", "checkpoints"}
CLAIMS_FILE = CONF_DIR / "claims.yaml"


@dataclass
class Run:
    dir: Path
    overrides: dict[str, str]  # key -> value, as given on the command line (or chosen by the sweeper)
    config: dict
    summary: dict | None  # None: no summary.json yet
    paper: dict = field(default_factory=dict)  # its preset's `paper:` block: {metric: {value, table}}

    @property
    def status(self) -> str:
        if self.summary is None:
            return "incomplete"
        if "pruned" in self.summary:  # stopped early by the search (runner.sweeper): partial metrics
            return "pruned"
        return "failed" if "error" in self.summary else "ok"

    def value(self, key: str):
        """The run's value of a (possibly swept) key: its override, else its resolved config value."""
        if key in self.overrides:
            return parse_scalar(self.overrides[key])
        return value_at(self.config, key)


@dataclass
class Group:
    """The runs of one setting of the swept parameters (its seeds)."""

    params: dict
    runs: list[Run] = field(default_factory=list)

    def stats(self, key: str) -> tuple[float, float, int]:
        """(mean, sample std, count) of a summary value over the group's runs; std is nan for one run."""
        values = [float(r.summary[key]) for r in self.runs if is_number(r.summary.get(key))]
        if not values:
            return math.nan, math.nan, 0
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else math.nan
        return mean, math.sqrt(var), len(values)


@dataclass
class Report:
    root: Path
    runs: list[Run]
    swept: list[str]  # swept parameters (seed excluded)
    groups: list[Group]  # settings with at least one completed run, sorted by parameter values
    metric: str
    direction: str  # "max" | "min"
    columns: list[str]  # summary keys tabled, the main metric first
    claims: dict = field(default_factory=dict)  # {preset name: [claim, ...]}, as in conf/claims.yaml

    @property
    def skipped(self) -> list[Run]:
        return [r for r in self.runs if r.status != "ok"]

    def best(self) -> Group | None:
        scored = [g for g in self.groups if g.stats(self.metric)[2]]
        if len(scored) < 2:
            return None
        pick = max if self.direction == "max" else min
        return pick(scored, key=lambda g: g.stats(self.metric)[0])


# ----------------------------------------------------------------------------------------- reading


def find_runs(root: Path) -> list[Run]:
    """Every run dir under `root` (itself included), in natural order of their paths."""
    runs = []
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        if (here / ".hydra" / "overrides.yaml").exists():
            runs.append(load_run(here))
    return sorted(runs, key=lambda r: natural_key(str(r.dir.relative_to(root))))


def load_run(run_dir: Path) -> Run:
    overrides = {}
    for item in yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text()) or []:
        key, eq, value = str(item).partition("=")
        overrides[key.lstrip("+~")] = value if eq else "(deleted)"
    config_path = run_dir / "config.yaml"  # the validated config; Hydra's own copy if the job died before
    if not config_path.exists():
        config_path = run_dir / ".hydra" / "config.yaml"
    config = (yaml.safe_load(config_path.read_text()) if config_path.exists() else None) or {}
    composed = run_dir / ".hydra" / "config.yaml"  # Hydra's composed config holds the preset's `paper:`
    paper = config.get("paper")
    if not paper and composed.exists():
        paper = (yaml.safe_load(composed.read_text()) or {}).get("paper")
    summary_path = run_dir / "summary.json"
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    except json.JSONDecodeError:  # cut off mid-write
        summary = None
    return Run(run_dir, overrides, config, summary, paper or {})


def task_metric(config: dict) -> tuple[str, str]:
    """The task's main metric `(key, "max" | "min")` for a run config."""
    from runner.task import task_named

    task = (config.get("method") or {}).get("task", "classify")
    if task not in TASKS:
        choices = ", ".join(TASKS)
        raise ValueError(f"task {task!r} is no registered task ({choices}); pass --metric KEY[:max|min]")
    return main_metric(config, task_named(task).metric)


def build_report(
    root, metric: str | None = None, columns: list[str] | None = None, claims=CLAIMS_FILE, by=None
) -> Report:
    """Read, group and order the runs under `root`. `metric` is `KEY` or `KEY:max|min`; `claims` the
    claims file to check; `by` the keys that make a group (default: the swept ones), e.g. the runs'
    `name` or `logger.tags` across several sweeps."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root}: no such directory")
    runs = find_runs(root)
    if not runs:
        raise ValueError(f"{root}: no runs found (a run dir holds .hydra/overrides.yaml)")
    done = [r for r in runs if r.status == "ok"]
    keys = list(dict.fromkeys(k for r in runs for k in r.overrides))
    swept = [k for k in keys if k != REPLICATE_KEY and len({hashable(r.value(k)) for r in runs}) > 1]
    if by:
        absent = [k for k in by if all(r.value(k) is None for r in runs)]
        if absent:
            config = runs[0].config  # its values, its groups (model=mlp) by name: what `Run.value` reads
            named = [k for k, v in config.items() if not isinstance(v, dict) or "name" in v]
            choices = ", ".join(dict.fromkeys([*keys, *named]))
            raise ValueError(
                f"--by {','.join(absent)}: in no run's overrides or config; choices: {choices}, or a "
                "dotted key of a run's config.yaml (e.g. logger.tags)"
            )
        swept = list(by)

    if metric is None:
        key, direction = task_metric((done or runs)[0].config)
    else:
        key, direction = parse_metric(metric, "max", given_as="--metric ")
    numeric = list(dict.fromkeys(k for r in done for k in r.summary if is_number(r.summary[k])))
    if done and not any(key in r.summary for r in done):
        raise ValueError(f"metric {key!r} is in no summary.json; keys: {', '.join(numeric)}")
    unknown = [c for c in columns or () if done and c not in numeric]
    if unknown:
        raise ValueError(f"--columns {','.join(unknown)}: in no summary.json; choices: {', '.join(numeric)}")

    groups: dict[tuple, Group] = {}
    for r in done:
        params = {k: r.value(k) for k in swept}
        groups.setdefault(tuple(hashable(v) for v in params.values()), Group(params)).runs.append(r)
    ordered = sorted(groups.values(), key=lambda g: [sort_key(v) for v in g.params.values()])

    if columns is None:  # the main metric, then its siblings (test/acc -> test/loss, ...)
        prefix = key.split("/")[0] + "/" if "/" in key else None
        siblings = [k for k in numeric if prefix and k.startswith(prefix) and k != key]
        columns = [key, *siblings[:MAX_EXTRA_COLUMNS]]
    elif key not in columns:
        columns = [key, *columns]
    return Report(root, runs, swept, ordered, key, direction, columns, load_claims(claims))


def load_claims(path=CLAIMS_FILE) -> dict:
    """{preset name: [claim, ...]} from a claims file (conf/claims.yaml describes the format)."""
    try:
        return yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ValueError(f"--claims {path}: {e.strerror}") from None
