"""Results: `metrics.jsonl` and `summary.json` in the run dir, mirrored to Weights & Biases.

W&B runs offline unless `logger.mode=online`; if it cannot start (no network, no package) the run
goes on with local files only. Only the main rank writes anything. The W&B run id is kept in the run
dir (`wandb_run_id`), so a resumed run (a restart, a Slurm requeue) goes on logging into the same W&B run:
online, the same run resumes; offline, each start writes its own folder under that id, and `runner-sync
RUN_DIR` (`runner.sync`) rebuilds them from metrics.jsonl as the one run to upload.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path

from runner import sweeper

log = logging.getLogger(__name__)

WANDB_ID = "wandb_run_id"


def _jsonable(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` in one step: a kill mid-write leaves the old file, never half a new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def wandb_init_args(run_dir: Path, cfg, config: dict | None, run_id: str, mode: str, dir=None) -> dict:
    """`wandb.init` arguments of the run dir's W&B run (logger config `cfg`, run config `config`),
    written under `dir` (default: the run dir): what a run and its `runner-sync` rebuild share."""
    import wandb

    return dict(
        id=run_id,
        resume="allow",
        project=cfg.project,
        entity=cfg.entity,
        group=cfg.group,
        tags=list(cfg.tags),
        mode=mode,
        dir=str(dir or run_dir),
        config=config,
        # `name` (the config's label) before the run dir's leaf: a sweep's runs share a prefix
        name=f"{config['name']}-{run_dir.name}" if config and "name" in config else run_dir.name,
        reinit="finish_previous",
        settings=wandb.Settings(silent=True, init_timeout=60),
    )


def log_to_file(logger: logging.Logger, level: int, msg: str, *args, exc_info=None, console: bool = False):
    """A record of `logger` for the job's log file (the root logger's FileHandler, Hydra's job logging)
    alone, or with `console` for the console too: what a person need not read as it runs (a config, a
    failed sweep job's traceback) stays on record."""
    if exc_info is not None:
        exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
    record = logger.makeRecord(logger.name, level, __file__, 0, msg, args, exc_info)
    for handler in logging.getLogger().handlers:
        if console or isinstance(handler, logging.FileHandler):
            handler.handle(record)


class Tracker:
    """`resume=True`: this run continues the one in `run_dir` (same W&B run id, when one was kept)."""

    def __init__(
        self,
        run_dir: Path,
        logger_cfg=None,
        config: dict | None = None,
        enabled: bool = True,
        resume: bool = False,
    ):
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
            self.wandb = self._start_wandb(logger_cfg, config, resume)

    def _start_wandb(self, cfg, config, resume: bool):
        try:
            import wandb

            id_path = self.dir / WANDB_ID
            run_id = id_path.read_text().strip() if resume and id_path.exists() else None
            if run_id is None:
                run_id = uuid.uuid4().hex[:12]
                write_atomic(id_path, run_id + "\n")
            elif cfg.mode == "offline":  # each start writes its own offline folder: the upload needs one
                log.info(
                    "W&B offline: this restart logs into a new offline folder of run %s; when the run has "
                    "ended, upload it as one run with `runner-sync %s` (docs/faults.md)",
                    run_id,
                    self.dir,
                )
            return wandb.init(**wandb_init_args(self.dir, cfg, config, run_id, cfg.mode))
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
        sweeper.report(record)  # an Optuna trial of this process: may raise sweeper.Pruned, ending the job

    def truncate(self, last_step: int, key: str = "step", missing: float = -1) -> None:
        """Drop records whose `key` is above `last_step` (a resumed run redoes what came after its
        checkpoint); a record without `key` counts as `missing`. The torn last line of a killed run goes."""
        if not (self.enabled and self.metrics_path.exists()):
            return
        keep = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the torn last line of a killed run
                continue
            if record.get(key, missing) <= last_step:
                keep.append(line)
        write_atomic(self.metrics_path, "".join(ln + "\n" for ln in keep))

    def image(self, key: str, path) -> None:
        """Log a PNG already written in the run dir."""
        if self.enabled and self.wandb is not None:
            import wandb

            self.wandb.log({key: wandb.Image(str(path))})

    def finish(self, summary: dict) -> None:
        """Write summary.json (a failed run's holds an `error`) and finish the W&B run."""
        if not self.enabled:
            return
        summary = {k: _jsonable(v) for k, v in summary.items()}
        write_atomic(self.dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        if self.wandb is not None:
            self.wandb.summary.update(summary)
        self.close(exit_code=1 if "error" in summary else 0)

    def close(self, exit_code: int = 0) -> None:
        """Finish the W&B run, if still open (a run that raised or was stopped: with its exit code)."""
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None
