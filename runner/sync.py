"""`runner-sync RUN_DIR...`: one clean offline W&B run per run dir, rebuilt from its `metrics.jsonl`.

In the default offline mode every start of a run (the first, then each restart after a stop or a
preemption) writes its own `wandb/offline-run-*` folder under the run's one id; uploaded together they
are not one run with each epoch once (a restart redoes the steps after its checkpoint, and W&B does not
resume offline runs). `metrics.jsonl` is that run: a resume cuts it back to the checkpoint. This command
rebuilds the W&B run from it (the saved config, every record at its step, summary.json) under
`RUN_DIR/wandb-sync/` and prints the `wandb sync` command that uploads it, in place of the folders under
`RUN_DIR/wandb/`. Images a run logged (e.g. a mixup preview) stay as PNG files in the run dir.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from omegaconf import OmegaConf

from runner import rundir
from runner.checks import ConfigError
from runner.track import WANDB_ID, wandb_init_args

SYNC_DIR = "wandb-sync"
_NON_FINITE = {"nan", "inf", "-inf"}  # how metrics.jsonl spells non-finite floats (`track._jsonable`)


def _records(path: Path) -> list[dict]:
    """The records of metrics.jsonl; a torn last line (a killed run's) is left out, as a resume does."""
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        records.append({k: float(v) if v in _NON_FINITE else v for k, v in record.items()})
    return records


def rebuild(run_dir) -> Path:
    """Write the run dir's W&B run afresh as one offline run (its id, config, history, summary) under
    RUN_DIR/wandb-sync/, replacing an earlier rebuild; return its offline-run folder. ConfigError (one
    line) for a run dir without W&B records, or one a run still holds."""
    import wandb

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such folder; give the run dir of a run (outputs/DATE/TIME)")
    id_path, metrics_path, config_path = (run_dir / n for n in (WANDB_ID, "metrics.jsonl", "config.yaml"))
    missing = [p.name for p in (id_path, metrics_path, config_path) if not p.is_file()]
    if missing:
        raise ConfigError(f"{run_dir}: no {', '.join(missing)}; not the run dir of a run logged to W&B")
    config = OmegaConf.to_container(OmegaConf.load(config_path))
    logger = OmegaConf.create(config["logger"])
    rundir.lock(run_dir)  # a run still going would add records after the rebuild
    try:
        target = run_dir / SYNC_DIR
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        run_id = id_path.read_text().strip()
        run = wandb.init(**wandb_init_args(run_dir, logger, config, run_id, "offline", dir=target))
        for record in _records(metrics_path):
            step = record.pop("step", None)
            run.log(record, step=step)
        summary_path = run_dir / "summary.json"
        failed = False
        if summary_path.is_file():
            summary = json.loads(summary_path.read_text())
            run.summary.update(summary)
            failed = "error" in summary
        run.finish(exit_code=1 if failed else 0)
    finally:
        rundir.unlock(run_dir)
    (folder,) = (target / "wandb").glob(f"offline-run-*-{run_id}")
    return folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="runner-sync",
        description="Rebuild each run dir's W&B run as one clean offline run (from metrics.jsonl) and "
        "print the `wandb sync` command that uploads it: after a run stopped and restarted offline.",
    )
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    args = parser.parse_args(argv)
    try:
        folders = [rebuild(d) for d in args.run_dirs]
    except ConfigError as e:
        print(f"runner-sync: error: {e}", file=sys.stderr)
        sys.exit(2)
    print("upload with:\n  wandb sync " + " ".join(str(f) for f in folders))


if __name__ == "__main__":
    main()
