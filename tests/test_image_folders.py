"""Image folders as people have them (odd formats and names, stray files, a notebook folder, symlinks),
the one `data:` line every dataset announces itself with, and unreadable images: `dataset.bad_images=error`
stops with one line, `skip` replaces them and counts them, `runner-data check` lists them beforehand."""

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli_here
from fixtures_data import write_image
from omegaconf import OmegaConf
from PIL import Image

from runner.checkpoint import load_checkpoint
from runner.checks import ConfigError
from runner.compose import compose
from runner.data import load_data
from runner.data.files import UnreadableImage
from runner.data_check import main as runner_data
from runner.validate import validate

FOX = "fénec roux"  # a class folder with a space and a non-ASCII letter, reached through a symlink
CLASSES = ["cat", "dog", FOX]


def write_odd_folder(root: Path) -> dict:
    """An image folder as one finds them: every kind of image file the loaders must read as RGB, files
    and a notebook folder beside them that are not data. Returns the counts the loader must report."""
    pixels = np.random.default_rng(0).integers(0, 256, (10, 12, 3), dtype=np.uint8)
    cat = root / "train" / "cat"
    cat.mkdir(parents=True)
    Image.fromarray(pixels).convert("L").save(cat / "gray.png")
    Image.fromarray(pixels).convert("P").save(cat / "palette.PNG")
    Image.fromarray(pixels).convert("RGBA").save(cat / "rgba.png")
    Image.fromarray(pixels[..., 0].astype(np.uint16) * 257).save(cat / "gray16.png")
    Image.fromarray(pixels).convert("CMYK").save(cat / "cmyk.JPG")
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    Image.fromarray(pixels).save(cat / "rotated.jpeg", exif=exif)
    Image.fromarray(pixels).save(cat / "photo 1.webp")
    Image.fromarray(pixels).save(cat / "été.bmp")
    for i in range(4):
        write_image(root / "train" / "dog" / f"dog_{i}.jpg", seed=i, size=8)
        write_image(root.parent / "elsewhere" / "fox" / f"fox_{i}.png", seed=10 + i, size=8)
    os.symlink(cat / "gray.png", root / "train" / "dog" / "link.jpg")
    os.symlink(root.parent / "elsewhere" / "fox", root / "train" / FOX)
    for split in ("train", "val"):
        write_image(root / split / ".ipynb_checkpoints" / "untitled.png", seed=20, size=8)
    for label, cls in enumerate(CLASSES):
        for i in range(2):
            write_image(root / "val" / cls / f"{cls}_{i}.png", seed=30 + 2 * label + i, size=8)
    not_images = [cat / ".DS_Store", cat / "notes.txt", root / "train" / "dog" / "Thumbs.db"]
    not_images.append(root / "train" / "notes.txt")
    for path in not_images:
        path.write_bytes(b"\0\1 not an image")
    return {"train": 8 + 5 + 4, "val": 6, "ignored": len(not_images)}


def write_bad(path: Path, kind: str) -> Path:
    """An unreadable `.jpg`: `truncated` (half of a real JPEG) or `empty`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "empty":
        path.write_bytes(b"")
    else:
        write_image(path.with_suffix(".tmp.jpg"), seed=40, size=16)
        whole = path.with_suffix(".tmp.jpg").read_bytes()
        path.with_suffix(".tmp.jpg").unlink()
        path.write_bytes(whole[: len(whole) // 2])
    return path.resolve()


def load(root, *overrides):
    cfg = validate(compose(["dataset=imagefolder", f"dataset.root={root}", *overrides]))["dataset"]
    return load_data(OmegaConf.structured(cfg), seed=0)


def data_line(counts: dict) -> str:
    return (
        f"data: imagefolder, 3 classes, {counts['train']} train / {counts['val']} val / {counts['val']} test "
        f"images ({counts['ignored']} non-image files ignored)"
    )


def test_odd_folders_give_their_classes_and_every_image_as_rgb_and_count_what_they_ignore(tmp_path, caplog):
    counts = write_odd_folder(tmp_path / "pets")
    with caplog.at_level(logging.INFO, logger="runner.data"):
        data = load(tmp_path / "pets", "dataset.image_size=8", "dataset.augment=none")
    assert data.meta["classes"] == CLASSES  # no `.ipynb_checkpoints` class
    assert (len(data.train), len(data.val), data.test is data.val) == (counts["train"], counts["val"], True)
    announced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data:")]
    assert announced == [data_line(counts)]
    assert "train/cat/été.bmp" in data.train.paths and f"train/{FOX}/fox_0.png" in data.train.paths
    images = data.train.dataset(train=False)
    for i in range(len(images)):
        x, index = images[i]
        assert (x.shape, x.dtype, index) == ((3, 8, 8), torch.uint8, i)


def test_every_dataset_announces_itself_in_the_same_line(caplog):
    def line(*overrides):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="runner.data"):
            load_data(validate(compose(list(overrides)))["dataset"], seed=0)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("data:")]

    assert line("dataset=digits") == ["data: digits, 10 classes, 1257 train / 180 val / 360 test images"]
    fake = ["dataset=fake", "dataset.like=cifar10", "dataset.train_size=20", "dataset.test_size=5"]
    assert line(*fake) == ["data: fake, 10 classes, 20 train / 0 val / 5 test images"]
    assert line("dataset=synthetic") == [
        "data: synthetic, 5 classes, 1400 train / 200 val / 400 test samples"
    ]


def test_bad_images_takes_error_or_skip():
    with pytest.raises(ConfigError, match=r"dataset.bad_images='maybe'.*error, skip"):
        validate(compose(["dataset=imagefolder", "dataset.bad_images=maybe"]))


def test_unreadable_images_are_skipped_for_the_next_readable_one_only_under_skip(tmp_path):
    write_odd_folder(tmp_path / "pets")
    bad = write_bad(tmp_path / "pets" / "train" / "dog" / "dog_0.jpg", "truncated")  # replaces a good one
    data = load(tmp_path / "pets", "dataset.image_size=8", "dataset.bad_images=skip")
    i = data.train.paths.index("train/dog/dog_0.jpg")
    x, index, skipped = data.train.dataset(train=False)[i]
    assert index == i + 1 and skipped.startswith(f"{bad} (") and "\n" not in skipped
    assert torch.equal(x, data.train.dataset(train=False)[i + 1][0])
    strict = load(tmp_path / "pets", "dataset.image_size=8")
    with pytest.raises(UnreadableImage, match=f"unreadable image {bad} .*; dataset.bad_images=skip replaces"):
        strict.train.dataset(train=True)[i]


def cli_args(root: Path, run_dir: Path, *extra) -> list[str]:
    return [
        "dataset=imagefolder", f"dataset.root={root}", "dataset.image_size=8", "model=mlp", "logger=none",
        "hardware=cpu", "hardware.num_workers=2", "train.epochs=2", "train.batch_size=6",
        f"hydra.run.dir={run_dir}", *extra,
    ]  # fmt: skip


def test_an_unreadable_image_stops_the_run_in_one_line_with_the_last_checkpoint_kept(tmp_path):
    write_odd_folder(tmp_path / "pets")
    bad = write_bad(tmp_path / "pets" / "val" / "dog" / "empty.jpg", "empty")
    run = tmp_path / "run"
    # evaluated at epoch 2 only: the run meets the file after the checkpoint of epoch 1
    proc = run_cli_here(cli_args(tmp_path / "pets", run, "train.eval_every=2"), tmp_path, check=False)
    output = proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("runner: error:")]
    assert proc.returncode == 1 and "Traceback" not in output, output[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"runner: error: unreadable image {bad} (")
    assert errors[0].endswith("; dataset.bad_images=skip replaces such samples")
    state = load_checkpoint(run / "checkpoints" / "last.pt", torch.device("cpu"))
    assert (state["epoch"], state["step"]) == (0, None)


def test_skip_finishes_names_each_bad_file_once_and_counts_them_per_epoch(tmp_path):
    counts = write_odd_folder(tmp_path / "pets")
    bad = [
        write_bad(tmp_path / "pets" / "train" / "cat" / "truncated.jpg", "truncated"),
        write_bad(tmp_path / "pets" / "val" / "dog" / "empty.jpg", "empty"),
    ]
    run = tmp_path / "run"
    proc = run_cli_here(cli_args(tmp_path / "pets", run, "dataset.bad_images=skip"), tmp_path)
    output = proc.stdout + proc.stderr
    assert data_line({**counts, "train": counts["train"] + 1, "val": counts["val"] + 1}) in output
    for path in bad:
        assert output.count(f"unreadable image {path} (") == 1
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    epochs = [row for row in rows if "epoch" in row]
    # 18 training files in 3 whole batches read the truncated one once; val's empty one is read by the
    # val and the test pass (test/ is absent: val/ is the test split)
    assert [row["data/bad_images"] for row in epochs] == [3, 3]


def test_runner_data_check_lists_exactly_the_unreadable_files(tmp_path, capsys):
    write_odd_folder(tmp_path / "pets")
    with pytest.raises(SystemExit) as done:
        runner_data(["check", str(tmp_path / "pets"), "--workers", "2"])
    assert done.value.code == 0 and "all 23 files read" in capsys.readouterr().out
    bad = [
        write_bad(tmp_path / "pets" / "train" / "cat" / "truncated.jpg", "truncated"),
        write_bad(tmp_path / "pets" / "val" / "dog" / "empty.jpg", "empty"),
    ]
    with pytest.raises(SystemExit) as done:
        runner_data(["check", str(tmp_path / "pets"), "dataset.image_size=8", "--workers", "2"])
    out = capsys.readouterr().out.splitlines()
    listed = [line.partition(" (")[0] for line in out if line.startswith("unreadable: ")]
    assert done.value.code == 1 and out[-1] == "2 of 25 image files unreadable"
    assert listed == [f"unreadable: {path}" for path in sorted(map(str, bad))]
    with pytest.raises(SystemExit) as done:
        runner_data(["check", str(tmp_path / "pets"), "dataset=digits"])
    assert done.value.code == 2 and "is not read from image files" in capsys.readouterr().err
