"""Summary statistics of a classifier's predictions that every classification run reports, and a metric's
name with its direction (`KEY` or `KEY:max|min`) wherever a run, a report or a selection rule names one."""

from __future__ import annotations

import statistics

import torch

from runner.checks import ConfigError

# The validation metric train.early_stop and train.save_top_k follow (runner.train.Monitor), unless a
# method's hooks choose their own (hier_hash: val/p@1).
MONITORED = "val/acc"
DIRECTIONS = ("max", "min")


def parse_metric(text: str, default: str | None = None, given_as: str = "metric=") -> tuple[str, str]:
    """`KEY` or `KEY:max|min` as `(key, "max" | "min")`. Without a direction: `default`, else the key's own
    (a loss or an ECE is minimised, anything else maximised). `given_as` prefixes `text` in the one-line
    error of a bad direction, as the user wrote it (`metric=`, `--metric `)."""
    key, _, direction = str(text).partition(":")
    direction = direction or default or ("min" if key.rsplit("/", 1)[-1] in ("loss", "ece") else "max")
    if direction not in DIRECTIONS:
        raise ConfigError(f"{given_as}{text}: the direction after ':' must be max or min")
    return key, direction


def calibration_bins(probs: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> torch.Tensor:
    """Per equal-width confidence bin: [count, sum of confidences, number correct], shape (3, bins),
    float64 on the device of `probs`; sums, so that shards of a split (or batches) add up before
    `expected_calibration_error`."""
    conf, pred = probs.max(1)
    which = torch.clamp((conf * bins).long(), max=bins - 1)
    values = torch.stack([torch.ones_like(conf), conf, (pred == labels).to(conf.dtype)]).double()
    return torch.zeros(3, bins, dtype=torch.float64, device=probs.device).index_add_(1, which, values)


def expected_calibration_error(binned: torch.Tensor) -> float:
    """ECE = sum_b |B_b| / N * |acc(B_b) - conf(B_b)| from `calibration_bins` (Guo et al. 2017)."""
    count, conf, correct = binned
    n = count.sum().item()
    return float((conf - correct).abs().sum().item() / n) if n else 0.0


def reliability_plot(path, binned: torch.Tensor, title: str = "") -> None:
    """Accuracy against confidence per bin (bars), with the diagonal of perfect calibration."""
    from runner.plots import new_figure, save_figure

    count, conf, correct = binned
    bins = binned.shape[1]
    centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
    acc = torch.where(count > 0, correct / count.clamp(min=1), torch.zeros_like(count))
    fig, ax = new_figure((4, 4))
    # numpy arrays: matplotlib's arithmetic on a tensor calls its NumPy-1 __array_wrap__ (DeprecationWarning)
    ax.bar(centres.numpy(), acc.numpy(), width=1 / bins, edgecolor="black", label="accuracy")
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax.set(xlabel="confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1))
    ax.set_title(f"{title}  ECE {expected_calibration_error(binned):.3f}".strip())
    ax.legend(loc="upper left")
    save_figure(fig, path)


def history_summary(accuracies: list[float], prefix: str = "test/acc") -> dict:
    """Best, last and the median of the last 10 epochs' accuracies (the Co-Mixup tables' convention)."""
    if not accuracies:
        return {}
    return {
        f"{prefix}_best": max(accuracies),
        f"{prefix}_last": accuracies[-1],
        f"{prefix}_median10": statistics.median(accuracies[-10:]),
    }
