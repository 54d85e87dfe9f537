"""The report beside the papers: a row that ran a paper preset's setting gets the preset's `paper:` numbers
and the difference (ours - paper); the claims of conf/claims.yaml about the preset a sweep ran are checked
on its rows (holds / fails / untested / not comparable, with the numbers)."""

from __future__ import annotations

import functools
import logging
import operator

from omegaconf import OmegaConf

from runner.report.runs import Group, Report, Run
from runner.report.values import is_number, mean_std, same, show, value_at

log = logging.getLogger(__name__)

# Overrides that say where or how a run ran, not what it measures: with them a run still ran its preset.
SETTING_FREE = (
    "seed", "experiment", "name", "hydra", "hardware", "logger", "dataset.root", "dataset.download",
    "dataset.imagenet_val", "model.pretrained", "method.base_checkpoint", "train.progress",
    "train.checkpoint", "train.checkpoint_every_minutes", "train.resume", "train.eval_batch_size",
)  # fmt: skip
_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def paper_setting(run: Run) -> bool:
    """Whether `run` ran the setting its preset's `paper:` numbers are for: the method the preset is named
    after (csot_cifar10: csot; hier_hash_imagenet32_npairs: hier_hash), and every override that changes
    what is measured (all but `SETTING_FREE`) at the value the preset itself gives that key."""
    experiment, method = run.value("experiment"), run.value("method")
    if not run.paper or not isinstance(experiment, str) or not experiment.startswith(f"{method}_"):
        return False
    preset = _preset(experiment, method if "method" in run.overrides else None)
    return preset is not None and all(
        same(run.value(key), value_at(preset, key))
        for key in run.overrides
        if not any(key == k or key.startswith(k + ".") for k in SETTING_FREE)
    )


@functools.cache
def _preset(experiment: str, method: str | None) -> dict | None:
    """The config `+experiment=NAME` composes to (after `+method=` where the run gave one)."""
    from runner.compose import compose

    overrides = ([f"+method={method}"] if method else []) + [f"+experiment={experiment}"]
    try:
        return OmegaConf.to_container(compose(overrides), resolve=True)
    except Exception as e:  # renamed or removed since the sweep ran: its runs get no paper numbers
        log.warning("runner-report: no paper numbers for +experiment=%s: %s", experiment, e)
        return None


def paper_table(report: Report) -> list[str]:
    """Per row that ran a paper preset's setting and per metric of its `paper:` block: ours (mean ± std
    over seeds), the paper's value, ours - paper, and the paper's table; [] when no row did."""
    header = [*report.swept, "metric", "ours", "paper", "ours - paper", "source"]
    rows = []
    for g in report.groups:
        if not paper_setting(g.runs[0]):
            continue
        for metric, entry in g.runs[0].paper.items():
            mean, std, n = g.stats(metric)
            value = float(entry["value"])
            ours, diff = ("-", "-") if n == 0 else (mean_std(mean, std), f"{mean - value:+.4g}")
            params = [show(v) for v in g.params.values()]
            rows.append([*params, metric, ours, show(value), diff, entry["table"]])
    if not rows:
        return []
    return ["| " + " | ".join(r) + " |" for r in [header, ["---"] * len(header), *rows]]


def check_claims(report: Report, claims: dict) -> list[tuple[str, str]]:
    """(verdict, line) per claim about a preset the report's runs ran: verdict holds | fails | untested
    (a side has no row, or several) | not comparable (the runs leave the preset's recipe: its epochs, its
    data), the line the claim with its numbers or how the runs differ."""
    out = []
    experiments = dict.fromkeys(g.runs[0].value("experiment") for g in report.groups)
    for experiment in experiments:
        rows = [g for g in report.groups if g.runs[0].value("experiment") == experiment]
        off_recipe = _off_recipe(rows, _preset(experiment, None)) if isinstance(experiment, str) else None
        for claim in claims.get(experiment, []) if isinstance(experiment, str) else ():
            head = f"{claim['claim']} ({experiment}; {claim.get('source', 'no source')})"
            if off_recipe:
                out.append(("not comparable", f"{head}: {off_recipe}"))
                continue
            when = claim.get("when") or {}
            (left, left_text), (right, right_text) = (_side(claim[s], when, rows) for s in ("left", "right"))
            if left is None or right is None:
                out.append(("untested", f"{head}: {left_text if left is None else right_text}"))
                continue
            verdict = "holds" if _OPS[claim["op"]](left, right) else "fails"
            out.append((verdict, f"{head}: {left_text} {claim['op']} {right_text}"))
    return out


def _off_recipe(rows: list[Group], preset: dict | None) -> str | None:
    """How the runs of `rows` leave their preset's recipe, whose claims hold of it alone (fewer epochs,
    another dataset, a subset of it: a smoke run at chance accuracy "held" a claim); None if they follow
    it."""
    if preset is None:
        return None
    recipe = {"epochs": preset["train"]["epochs"], "dataset": preset["dataset"]["name"],
              "max_train": preset["dataset"].get("max_train", 0)}  # fmt: skip
    for run in (r for g in rows for r in g.runs):
        ran = {
            key: value_at(run.config, path)
            for key, path in (
                ("epochs", "train.epochs"),
                ("dataset", "dataset.name"),
                ("max_train", "dataset.max_train"),
            )
        }
        if ran["epochs"] is not None and ran["epochs"] != recipe["epochs"]:
            return f"{ran['epochs']} of {recipe['epochs']} epochs"
        if ran["dataset"] is not None and ran["dataset"] != recipe["dataset"]:
            return f"dataset {ran['dataset']}, not {recipe['dataset']}"
        if ran["max_train"] and ran["max_train"] != recipe["max_train"]:
            return f"{ran['max_train']} training samples (dataset.max_train), not all"
    return None


def _side(side: dict, when: dict, rows: list[Group]) -> tuple[float | None, str]:
    """A claim's side: (value, how it was computed), or (None, why it could not be)."""
    if "gap" in side:
        return _gap_side(side, {**when, **(side.get("when") or {})}, rows)
    times, plus = float(side.get("times", 1)), float(side.get("plus", 0))
    if "metric" not in side:
        return plus, show(plus)
    when = {**when, **(side.get("when") or {})}
    picked = " ".join(f"{k}={show(v)}" for k, v in when.items())
    matches = [g for g in rows if all(same(r.value(k), v) for r in g.runs for k, v in when.items())]
    if len(matches) != 1:
        return None, f"{len(matches)} rows with {picked or 'any setting'} (need 1)"
    metric, stat = side["metric"], side.get("stat", "mean")
    values = [float(r.summary[metric]) for r in matches[0].runs if is_number(r.summary.get(metric))]
    if not values:
        return None, f"no {metric} in the runs with {picked}"
    value = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}[stat]
    text = f"{'' if stat == 'mean' else stat + ' '}{metric}" + (f" [{picked}]" if picked else "")
    text += f" {value:.4g}" + (f" x {show(times)}" if times != 1 else "")
    text += f" {'+-'[plus < 0]} {show(abs(plus))}" if plus else ""
    if times != 1 or plus:
        text += f" = {value * times + plus:.4g}"
    return value * times + plus, text


def _gap_side(side: dict, when: dict, rows: list[Group]) -> tuple[float | None, str]:
    """The point the fraction `gap` of the way from the side `from` to the side `to` (e.g. from CE on
    noisy labels to CE on clean ones): from + gap x (to - from)."""
    (low, low_text), (high, high_text) = (_side(side[end], when, rows) for end in ("from", "to"))
    if low is None or high is None:
        return None, low_text if low is None else high_text
    gap = float(side["gap"])
    value = low + gap * (high - low)
    return value, f"{low_text} + {show(gap)} x ({high_text} - {low:.4g}) = {value:.4g}"
