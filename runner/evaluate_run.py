"""`runner-eval RUN_DIR [OVERRIDES...]`: evaluate a finished run's checkpoint again, on its own test split
or on another dataset.

The run's config is composed again from its command line (`RUN_DIR/.hydra/overrides.yaml`) with
OVERRIDES after it, so a group can change (`dataset=imagefolder dataset.root=...`: ImageNet val for a
WebVision run, CIFAR-10-C style folders). The weights are those the run reported: the best checkpoint
`train.save_top_k` kept (`checkpoints/best.pt`; a task's tagged fit's `checkpoints/fit-best.pt`), else the
fit's checkpoint (`checkpoints/last.pt`, `checkpoints/fit.pt`): the best weights by `train.select=best:KEY`
where the run selected (restored and reported) them, else its last. Prints the evaluation splits'
metrics in the run's format, then writes them to `RUN_DIR/eval-<name>.json` (`--name`, default: the
overrides, or `test`), or to `--out PATH` (a run dir that cannot be written: another run's, a read-only copy).

    runner-eval outputs/2026-11-25/10-00-00
    runner-eval outputs/2026-11-25/10-00-00 dataset=imagefolder dataset.root=data/cifar10c --name cifar10c

With object boxes (digits_canvas; ImageNet val with `dataset.imagenet_boxes=PATH`) it also reports the
Co-Mixup localisation and background-corruption metrics (`runner.canvas_metrics`):

    runner-eval outputs/2026-11-25/10-00-00 dataset.imagenet_boxes=data/imagenet/val_boxes --name boxes
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from omegaconf import OmegaConf

from runner.checkpoint import best_file, checkpoint_file
from runner.checks import ConfigError
from runner.configs import TASKS
from runner.faults import CheckpointError, OutOfMemory, out_of_memory_stops
from runner.task import task_of

# A fit's checkpoint (runner.checkpoint: `last.pt`, or `<tag>.pt` of a task's tagged fit) and, first, the best
# one `train.save_top_k` keeps beside it (`best.pt`, `<tag>-best.pt`).
WEIGHTS = (best_file(), checkpoint_file(), best_file("fit"), checkpoint_file("fit"))


def evaluate_run(run_dir: Path, overrides: list[str]) -> dict:
    """The metrics of the weights `run_dir` reported (`WEIGHTS`; the module's docstring) on the evaluation
    splits of its config with `overrides`, with the checkpoint and the overrides."""
    from runner.canvas_metrics import canvas_metrics
    from runner.checkpoint import load_checkpoint
    from runner.compose import CommandLine
    from runner.data import load_data
    from runner.data.imagenet_boxes import add_val_boxes
    from runner.evaluation import evaluate_splits
    from runner.hardware import RunContext, setup
    from runner.optim import final_image_size

    run_dir = Path(run_dir)
    saved = run_dir / ".hydra" / "overrides.yaml"
    if not saved.exists():
        raise ConfigError(f"{run_dir} is not a run dir (no .hydra/overrides.yaml); pass the folder of a run")
    cfg = CommandLine.parse([*OmegaConf.load(saved), *overrides]).job().config  # as the run built it
    task = task_of(cfg)
    # the tasks whose checkpoint is a classifier of the dataset's classes (`Task.network` builds it)
    evaluable = [entry.module for entry in TASKS.values() if entry.evaluable]
    if not TASKS[task.name].evaluable:
        where = TASKS[task.name].module
        raise ConfigError(f"runner-eval evaluates runs of {', '.join(evaluable)}; {run_dir} is {where}")
    path = next((run_dir / w for w in WEIGHTS if (run_dir / w).exists()), None)
    if path is None:
        raise ConfigError(f"{run_dir} has no checkpoint ({', '.join(WEIGHTS)})")
    device, _, _ = setup(cfg.hardware)
    data = load_data(cfg.dataset, cfg.seed)
    add_val_boxes(data, cfg.dataset.imagenet_boxes)
    model = task.network(cfg, data)
    # a file it cannot read: CheckpointError, its own line, with what an evaluation can do about it
    state = load_checkpoint(path, device, hint="restore it from a copy of the run to evaluate it")
    selected = (state.get("extra") or {}).get("best")  # train.select=best:KEY: the weights it restored
    weights = selected["state"] if selected is not None else state["model"]
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:
        raise ConfigError(
            f"{path} does not fit {cfg.model.name} on {cfg.dataset.name} with {data.num_classes} classes "
            f"({str(e).splitlines()[0]})"
        ) from None
    hw = cfg.hardware
    ctx = RunContext(device, run_dir, None, precision=hw.precision, channels_last=hw.channels_last,
                     num_workers=hw.num_workers, eval_image_size=final_image_size(cfg.train))  # fmt: skip
    model.to(device)
    batch_size = cfg.train.eval_batch_size
    with out_of_memory_stops(f"ran out of {{}} at train.eval_batch_size={batch_size}; lower it".format):
        metrics, _ = evaluate_splits(model, data, ctx, batch_size, cfg.train.ece_bins)
        if "boxes" in data.meta:  # digits_canvas, ImageNet val with dataset.imagenet_boxes
            metrics.update(canvas_metrics(model, data, ctx, batch_size=batch_size))
    return {"checkpoint": str(path), "overrides": overrides, **metrics}


def default_out(run_dir: Path, overrides: list[str], name: str | None) -> Path:
    """`run_dir/eval-<name>.json`; the name defaults to the overrides, or `test`."""
    name = name or (re.sub(r"[^\w.=-]+", "_", "_".join(overrides)) if overrides else "test")
    return Path(run_dir) / f"eval-{name}.json"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="runner-eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides after the run's own (key=value)")
    parser.add_argument("--name", help="RUN_DIR/eval-<name>.json (default: the overrides, or 'test')")
    parser.add_argument("--out", type=Path, help="the metrics' json file (default: RUN_DIR/eval-<name>.json)")
    args = parser.parse_args(argv)
    try:
        out = evaluate_run(args.run_dir, args.overrides)
    except (ConfigError, CheckpointError, OutOfMemory) as e:
        print(f"runner-eval: error: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    shown = {k: v for k, v in out.items() if isinstance(v, float)}
    # printed before the write: metrics a write cannot keep are still on the console
    print(f"runner-eval {args.run_dir} ({out['checkpoint']}): "
          + "  ".join(f"{k}={v:.4f}" for k, v in shown.items()), flush=True)  # fmt: skip
    path = args.out or default_out(args.run_dir, args.overrides, args.name)
    try:
        path.write_text(json.dumps(out, indent=2) + "\n")
    except OSError as e:
        print(f"runner-eval: error: cannot write {path} ({e.strerror}); give --out PATH", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
