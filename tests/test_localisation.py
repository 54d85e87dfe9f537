"""Co-Mixup's ImageNet localisation and background-corruption evaluation (Tables 2 and 3): the ILSVRC
val box annotations (`dataset.imagenet_boxes`) on a fixture in the real layout, carried to network-input
pixels, and the metrics of `runner.canvas_metrics` on them."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import summaries
from omegaconf import OmegaConf

from runner.canvas_metrics import canvas_metrics, noisy_background, outside_masks
from runner.cli import _compose
from runner.data import load_data
from runner.data.imagenet_boxes import add_val_boxes
from runner.hardware import RunContext
from runner.models import build_model
from runner.schema import ConfigError, validate
from runner.train import batches, in_order

WNIDS = ["n01440764", "n01443537"]
# val image -> (class, (width, height), boxes as xmin, ymin, xmax, ymax in the image's pixels)
VAL = {
    "ILSVRC2012_val_00000001": (0, (40, 30), [(10, 6, 30, 24)]),
    "ILSVRC2012_val_00000002": (1, (24, 48), [(0, 0, 12, 20), (6, 30, 24, 48)]),  # two objects
    "ILSVRC2012_val_00000003": (1, (32, 32), [(4, 4, 28, 28)]),
}
ANNOTATION = """<annotation>
	<folder>val</folder>
	<filename>{name}</filename>
	<source><database>ILSVRC_2012</database></source>
	<size><width>{width}</width><height>{height}</height><depth>3</depth></size>
	<segmented>0</segmented>{objects}
</annotation>
"""
OBJECT = """
	<object>
		<name>{wnid}</name><pose>Unspecified</pose><truncated>0</truncated><difficult>0</difficult>
		<bndbox><xmin>{}</xmin><ymin>{}</ymin><xmax>{}</xmax><ymax>{}</ymax></bndbox>
	</object>"""


def write_fixture(root: Path) -> Path:
    """ImageNet train/<wnid>/*.JPEG and val/<wnid>/ILSVRC2012_val_*.JPEG, and the val annotations as
    ILSVRC2012_bbox_val_v3.tgz extracts them (val_boxes/ILSVRC2012_val_*.xml); returns that folder."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i, wnid in enumerate(WNIDS):
        folder = root / "train" / wnid
        folder.mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(folder / f"{wnid}_{i}.JPEG")
    boxes = root / "val_boxes"
    boxes.mkdir()
    for name, (label, (width, height), objects) in VAL.items():
        folder = root / "val" / WNIDS[label]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
            folder / f"{name}.JPEG"
        )
        xml = "".join(OBJECT.format(*box, wnid=WNIDS[label]) for box in objects)
        (boxes / f"{name}.xml").write_text(
            ANNOTATION.format(name=name, width=width, height=height, objects=xml)
        )
    return boxes


def load(root, *overrides):
    cfg = validate(
        _compose(["dataset=imagenet", f"dataset.root={root}", "dataset.image_size=16", *overrides])
    )
    data = load_data(OmegaConf.structured(cfg["dataset"]), seed=0)
    add_val_boxes(data, cfg["dataset"].imagenet_boxes)
    return data


def test_boxes_follow_the_evaluation_resize_and_center_crop(tmp_path):
    boxes = write_fixture(tmp_path)
    data = load(tmp_path, f"dataset.imagenet_boxes={boxes}")
    assert data.meta["background_noise_std"] == 0.1  # Table 3's N(0, 0.1^2)
    found = dict(zip((Path(p.decode()).stem for p in data.test.encoded_paths), data.meta["boxes"]["test"]))
    # image 1, 40x30: shorter side to round(16 / 0.875) = 18 (scale 0.6, width 24), center crop 16 at
    # top 1, left 4: x 10..30 -> 6..18 -> 2..14, y 6..24 -> 3.6..14.4 -> 2.6..13.4 -> rows 3..13
    np.testing.assert_array_equal(found["ILSVRC2012_val_00000001"], [[3, 2, 13, 14]])
    # image 2, 24x48: scale 0.75 to 18x36, crop at top 10, left 1; the boxes are clipped to the crop
    np.testing.assert_array_equal(found["ILSVRC2012_val_00000002"], [[0, 0, 5, 8], [12, 4, 16, 16]])
    # image 3, 32x32: scale 18/32 then crop 1: 4..28 -> 2.25..15.75 -> 1.25..14.75, rounded to even
    np.testing.assert_array_equal(found["ILSVRC2012_val_00000003"], [[1, 1, 15, 15]])
    # the background mask is outside every box of an image
    masks = outside_masks(data.meta["boxes"]["test"], 16)
    assert masks.shape == (3, 1, 16, 16)
    second = list(found).index("ILSVRC2012_val_00000002")
    assert masks[second, 0, :5, :8].sum() == 0 and masks[second, 0, 12:16, 4:16].sum() == 0
    assert masks[second].sum() == 256 - 40 - 48


def test_annotations_in_class_folders_are_found_too(tmp_path):
    boxes = write_fixture(tmp_path)
    for name, (label, _, _) in VAL.items():
        (boxes / WNIDS[label]).mkdir(exist_ok=True)
        (boxes / f"{name}.xml").rename(boxes / WNIDS[label] / f"{name}.xml")
    data = load(tmp_path, f"dataset.imagenet_boxes={boxes}")
    assert [len(b) for b in data.meta["boxes"]["test"]] == [1, 2, 1]


def test_bad_annotations_are_one_line_errors(tmp_path):
    boxes = write_fixture(tmp_path)
    (boxes / "ILSVRC2012_val_00000003.xml").unlink()
    with pytest.raises(ConfigError, match=r"dataset.imagenet_boxes=.*: no ILSVRC2012_val_00000003.xml for"):
        load(tmp_path, f"dataset.imagenet_boxes={boxes}")
    (boxes / "ILSVRC2012_val_00000003.xml").write_text(
        "<annotation><size><width>3</width></size></annotation>"
    )
    with pytest.raises(ConfigError, match=r"ILSVRC2012_val_00000003.xml: expected <size> with <width>"):
        load(tmp_path, f"dataset.imagenet_boxes={boxes}")
    with pytest.raises(ConfigError, match="is not a folder"):
        load(tmp_path, f"dataset.imagenet_boxes={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match="unknown key dataset.imagenet_boxes"):  # an ImageNet option
        validate(_compose(["dataset=digits", f"dataset.imagenet_boxes={boxes}"]))
    digits = load_data(OmegaConf.structured(validate(_compose(["dataset=digits"]))["dataset"]), seed=0)
    with pytest.raises(ConfigError, match="needs the ImageNet val images as files"):
        add_val_boxes(digits, str(boxes))


def test_metrics_on_imagenet_boxes(tmp_path):
    """A model whose class evidence is the box localises perfectly; the corruptions are those of the
    documented protocol (background replaced, or noise added in pixel values and clipped there)."""
    data = load(tmp_path, f"dataset.imagenet_boxes={write_fixture(tmp_path)}")
    ctx = RunContext(torch.device("cpu"), Path("."), None)
    box_sets, y = data.meta["boxes"]["test"], data.test.y_clean
    inside = 1 - outside_masks(box_sets, 16)
    first_boxes = [b[:1] for b in box_sets]  # the CAM of one object (of two in image 2)

    class BoxModel(torch.nn.Module):  # cheats: reads labels and boxes of the test split (one batch)
        classifier = torch.nn.Linear(1, 2, bias=False)

        def feature_maps(self, x):
            return 1 - outside_masks(first_boxes, 16).to(x.dtype)

        def forward(self, x):
            return 10 * torch.nn.functional.one_hot(y[: len(x)], 2).float()

    model = BoxModel()
    with torch.no_grad():
        model.classifier.weight.fill_(1.0)
    metrics = canvas_metrics(model, data, ctx)
    assert metrics["test/err"] == 0 and metrics["test/loc_acc@0.25"] == 1 and metrics["test/loc_acc"] == 1

    # a linear model sees the corruptions: recompute them on the whole split by hand
    torch.manual_seed(0)
    linear = build_model(OmegaConf.create({"name": "mlp", "hidden": []}), (3, 16, 16), 2)
    ((x, _),) = list(batches(data.test, ctx, in_order(3, 3)))
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in data.meta["normalize"])
    other = (np.arange(3) + np.random.default_rng(0).integers(1, 3, size=3)) % 3
    noise = 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    pixels = ((x * std + mean) + noise * (1 - inside)).clamp(0, 1)
    torch.testing.assert_close(noisy_background(x, noise * (1 - inside), data.meta), (pixels - mean) / std)
    with torch.no_grad():
        replace = (linear(x * inside + x[other] * (1 - inside)).argmax(1) != y).double().mean().item()
        noisy = (linear((pixels - mean) / std).argmax(1) != y).double().mean().item()
        clean = (linear(x).argmax(1) != y).double().mean().item()
    metrics = canvas_metrics(linear, data, ctx)
    assert metrics["test/err"] == pytest.approx(clean)
    assert metrics["test/err_bg_replace"] == pytest.approx(replace)
    assert metrics["test/err_bg_noise"] == pytest.approx(noisy)
    assert "test/loc_acc" not in metrics  # no feature maps, no CAM


@pytest.mark.slow  # subprocesses importing torch and Hydra: about 30 s
def test_a_run_and_runner_eval_report_the_box_metrics(tmp_path, cli):
    from runner.evaluate_run import evaluate_run

    boxes = write_fixture(tmp_path)
    cli("dataset=imagenet", f"dataset.root={tmp_path}", "dataset.image_size=16", "model=cnn",
        "model.channels=[4,8]", "hardware=cpu", "logger=none", "train.epochs=1", "train.batch_size=2",
        f"dataset.imagenet_boxes={boxes}")  # fmt: skip
    ((run_dir, summary),) = summaries(tmp_path).items()
    for key in (
        "test/loc_acc@0.25",
        "test/loc_acc",
        "test/err_bg_replace",
        "test/err_bg_noise",
        "test/ece10",
    ):
        assert 0 <= summary[key] <= 1, key
    again = evaluate_run(run_dir, [f"dataset.imagenet_boxes={boxes}"], name="boxes")
    assert again["test/err_bg_noise"] == pytest.approx(summary["test/err_bg_noise"])
    assert again["test/loc_acc@0.25"] == pytest.approx(summary["test/loc_acc@0.25"])
