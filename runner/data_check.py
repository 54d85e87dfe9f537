"""`runner-data check ROOT`: read every image file of a dataset's splits before a long run, and list the
ones no decoder reads (truncated, empty, not an image), so that they are fixed, removed or accepted with
`dataset.bad_images=skip` before the run meets them hours in.

    runner-data check ~/data/pets                                   # dataset=imagefolder
    runner-data check /data/webvision dataset=webvision --workers 16

ROOT is `dataset.root`; further arguments are the dataset overrides of a `runner` command line. The files
are decoded as a run decodes them (`runner.data.files.read_rgb`), in `--workers` processes. Prints the
`data:` line, then one line per unreadable file; exits 1 when there is any, 2 on bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from runner.checks import ConfigError
from runner.data.files import FileSplit, try_read_rgb


class _Reasons(torch.utils.data.Dataset):
    """`dataset[i] -> ""`, or why file `paths[i]` cannot be read."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> str:
        return try_read_rgb(self.paths[i])[1]


def dataset_files(root: str, overrides: list[str]) -> tuple[str, list[Path]]:
    """(the `data:` line, every file of the dataset's splits once, sorted) for dataset `root` composed
    with `overrides` as `runner` composes it (default `dataset=imagefolder`)."""
    from omegaconf import OmegaConf

    from runner.compose import compose
    from runner.data import describe, load_data
    from runner.validate import validate

    if not all(o.startswith(("dataset=", "dataset.")) for o in overrides):
        raise ConfigError(f"{' '.join(overrides)}: only dataset=NAME and dataset.KEY=VALUE overrides apply")
    composed = compose(["dataset=imagefolder", *overrides])
    composed.dataset.root = root  # set, not an override: a path needs no quoting then
    cfg = validate(composed)["dataset"]
    data = load_data(OmegaConf.structured(cfg), seed=0)
    splits = [data.train, data.val, data.test, *data.extra.values()]
    if not all(isinstance(split, FileSplit) for split in splits):
        raise ConfigError(f"dataset={cfg.name} is not read from image files: there is nothing to check")
    files = {split.root / path for split in splits for path in split.paths}
    return describe(data, cfg.name), sorted(files)


def unreadable(files: list[Path], workers: int) -> list[tuple[Path, str]]:
    """(file, why) for each of `files` that cannot be decoded, decoded in `workers` processes."""
    loader = torch.utils.data.DataLoader(_Reasons(files), batch_size=32, num_workers=workers, collate_fn=list)
    reasons = [reason for batch in loader for reason in batch]
    return [(file, reason) for file, reason in zip(files, reasons) if reason]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="runner-data", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="list the image files of a dataset that cannot be read")
    check.add_argument("root", help="the dataset's root folder (dataset.root)")
    check.add_argument("overrides", nargs="*", help="dataset=NAME (default imagefolder), dataset.KEY=VALUE")
    check.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="decoding processes")
    args = parser.parse_args(argv)
    try:
        if args.workers < 0:
            raise ConfigError(f"--workers={args.workers}: must be >= 0 (0: decode in this process)")
        line, files = dataset_files(args.root, args.overrides)
    except ConfigError as e:
        print(f"runner-data: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(line)
    bad = unreadable(files, args.workers)
    for file, reason in bad:
        print(f"unreadable: {file} ({reason})")
    print(f"{len(bad)} of {len(files)} image files unreadable" if bad else f"all {len(files)} files read")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
