"""Results: `metrics.jsonl` and `summary.json` in the run dir, mirrored to Weights & Biases.

W&B runs offline unless `logger.mode=online`; if it cannot start (no network, no package) the run
goes on with local files only. Only the main rank writes anything.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class Tracker:
    def __init__(self, run_dir: Path, logger_cfg=None, config: dict | None = None, enabled: bool = True):
        self.dir = Path(run_dir)
        self.enabled = enabled
        self.metrics_path = self.dir / "metrics.jsonl"
        self.wandb = None
        if enabled:
            self.dir.mkdir(parents=True, exist_ok=True)
        if (
            enabled
            and logger_cfg is not None
            and logger_cfg.name == "wandb"
            and logger_cfg.mode != "disabled"
        ):
            self.wandb = self._start_wandb(logger_cfg, config)

    def _start_wandb(self, cfg, config):
        try:
            import wandb

            return wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                group=cfg.group,
                tags=list(cfg.tags),
                mode=cfg.mode,
                dir=str(self.dir),
                config=config,
                name=self.dir.name,
                reinit="finish_previous",
                settings=wandb.Settings(silent=True, init_timeout=60),
            )
        except Exception as e:  # never fail a run for want of a network or a login
            log.warning("W&B could not start (%s); logging to %s only", e, self.metrics_path)
            return None

    def log(self, metrics: dict, step: int | None = None) -> None:
        if not self.enabled:
            return
        record = {k: _jsonable(v) for k, v in metrics.items()}
        if step is not None:
            record = {"step": step, **record}
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def truncate(self, last_step: int) -> None:
        """Drop records logged after `last_step` (a resumed run redoes the epoch it was killed in)."""
        if not (self.enabled and self.metrics_path.exists()):
            return
        lines = self.metrics_path.read_text().splitlines()
        keep = [ln for ln in lines if json.loads(ln).get("step", -1) <= last_step]
        self.metrics_path.write_text("".join(ln + "\n" for ln in keep))

    def image(self, key: str, path) -> None:
        """Log a PNG already written in the run dir."""
        if self.enabled and self.wandb is not None:
            import wandb

            self.wandb.log({key: wandb.Image(str(path))})

    def finish(self, summary: dict) -> None:
        if not self.enabled:
            return
        summary = {k: _jsonable(v) for k, v in summary.items()}
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.wandb is not None:
            self.wandb.summary.update(summary)
            self.wandb.finish()
            self.wandb = None
