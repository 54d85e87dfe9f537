"""Co-Mixup's ImageNet localisation and background-corruption evaluation (Tables 2 and 3): the ILSVRC
val box annotations (`dataset.imagenet_boxes`) on a fixture in the real layout, carried to network-input
pixels, and the metrics of `runner.canvas_metrics` on them."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import summaries
from omegaconf import OmegaConf
from scipy import ndimage

from runner.batches import batches, in_order
from runner.canvas_metrics import (
    cam_boxes,
    canvas_metrics,
    class_activation_maps,
    contour_areas,
    localisation_hits,
    noisy_background,
    outside_masks,
)
from runner.checks import ConfigError
from runner.compose import compose
from runner.data import load_data
from runner.data.imagenet_boxes import add_val_boxes
from runner.hardware import RunContext
from runner.models import build_model
from runner.validate import validate

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
    cfg = validate(compose(["dataset=imagenet", f"dataset.root={root}", "dataset.image_size=16", *overrides]))
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
        validate(compose(["dataset=digits", f"dataset.imagenet_boxes={boxes}"]))
    digits = load_data(OmegaConf.structured(validate(compose(["dataset=digits"]))["dataset"]), seed=0)
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
    assert metrics["test/err"] == 0 and metrics["test/loc_acc"] == 1 == metrics["test/loc_acc_best_threshold"]

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
        "test/loc_acc",
        "test/loc_acc_best_threshold",
        "test/err_bg_replace",
        "test/err_bg_noise",
        "test/ece10",
    ):
        assert 0 <= summary[key] <= 1, key
    again = evaluate_run(run_dir, [f"dataset.imagenet_boxes={boxes}"])
    assert again["test/err_bg_noise"] == pytest.approx(summary["test/err_bg_noise"])
    assert again["test/loc_acc"] == pytest.approx(summary["test/loc_acc"])


# ------------------------------------------------------------- the CAM protocol of the authors' code


class CellModel(torch.nn.Module):
    """A ResNet-like 8x downsampling: 7x7 feature maps of a 56-px image, one channel, 1 on the object's
    cells; the classifier's weight 1 for every class."""

    classifier = torch.nn.Linear(1, 2, bias=False)

    def __init__(self, cells):
        super().__init__()
        self.cells = cells
        torch.nn.init.ones_(self.classifier.weight)

    def feature_maps(self, x):
        maps = torch.zeros(len(x), 1, 7, 7)
        maps[:, :, self.cells[0], self.cells[1]] = 1.0
        return maps


def test_the_cam_is_summed_over_3x3_neighbourhoods_then_upsampled_bicubically():
    model = CellModel((slice(2, 5), slice(1, 3)))  # the object: rows 2-4, columns 1-2 of the 7x7 map
    cams = class_activation_maps(model, torch.zeros(1, 3, 56, 56), torch.tensor([0]))
    maps = np.pad(model.feature_maps(torch.zeros(1))[0, 0].numpy(), 1)  # zero padded, as the conv
    smoothed = sum(maps[i : i + 7, j : j + 7] for i in range(3) for j in range(3))  # every 3x3 sum
    assert (smoothed[3, 1], smoothed[3, 3], smoothed[3, 4]) == (6, 3, 0)  # in the object, beside it, apart
    bicubic = torch.nn.functional.interpolate(torch.tensor(smoothed)[None, None].float(), size=(56, 56),
                                              mode="bicubic", align_corners=False)  # fmt: skip
    torch.testing.assert_close(cams, bicubic[:, 0])
    bilinear = torch.nn.functional.interpolate(torch.tensor(smoothed)[None, None].float(), size=(56, 56),
                                               mode="bilinear", align_corners=False)  # fmt: skip
    assert not torch.allclose(cams, bilinear[:, 0], atol=0.05)  # bicubic overshoots where bilinear cannot


def test_the_cam_box_is_the_largest_contours_at_the_codes_grey_level_cut():
    cam = np.zeros((1, 20, 20))
    cam[0, 1, 0:14] = 1.0  # a one-pixel line of 14 pixels: its contour encloses no area
    cam[0, 5:9, 5:9] = 1.0  # a 4x4 square of 16 pixels: contour area 3 x 3 = 9
    cam[0, 12:17, 2:5] = 0.9  # a 5x3 block, 15 pixels, with a 1-pixel hole: contour area 4 x 2 = 8
    cam[0, 14, 3] = 0.0
    cam[0, 9, 9] = 0.25  # at the threshold, touching the square: grey 63 (0.25 x 255 as a byte), not above 63
    regions, count = ndimage.label(ndimage.binary_fill_holes(cam[0] >= 0.25), structure=np.ones((3, 3)))
    assert sorted(contour_areas(regions, count)) == [0, 8, 9]
    assert cam_boxes(cam, 0.25).tolist() == [[5, 5, 9, 9]]  # the square, without the pixel at the cut
    cam[0, 5:9, 5:9] = 0.0
    cam[0, 5:7, 5:7] = 1.0  # now 2x2 (area 1): the block with the hole, 8 by its filled contour
    assert cam_boxes(cam, 0.25).tolist() == [[12, 2, 17, 5]]
    diagonal = np.zeros((1, 8, 8))
    diagonal[0, [1, 2, 3, 2], [1, 2, 3, 1]] = 1.0  # a diagonal with one pixel beside it: an 8-connected
    assert cam_boxes(diagonal, 0.5).tolist() == [[1, 1, 4, 4]]  # region, its area a half-block: 1/2
    assert contour_areas(ndimage.label(diagonal[0], structure=np.ones((3, 3)))[0], 1).tolist() == [0.5]


def test_a_cam_on_the_object_localises_it_at_the_papers_threshold():
    """The box fixture of a 56-px image, the object on 5x5 of the 7x7 cells (pixels 8-48): the smoothed,
    upsampled CAM cut at 0.25 gives a box around the object with IoU >= 0.5, and the hit needs the class."""
    model = CellModel((slice(1, 6), slice(1, 6)))
    with torch.no_grad():  # as canvas_metrics calls it
        cams = class_activation_maps(model, torch.zeros(1, 3, 56, 56), torch.tensor([0])).numpy()
    (box,) = cam_boxes(cams, 0.25)
    assert box[0] == box[1] <= 8 and box[2] == box[3] >= 48  # symmetric, around the object
    assert (box[2] - box[0]) ** 2 <= 2 * 40**2  # IoU = 40^2 / side^2 >= 0.5
    truth = [np.array([[8, 8, 48, 48]])]
    assert localisation_hits(cams, truth, np.array([True]), [0.25]).tolist() == [[True]]
    assert localisation_hits(cams, truth, np.array([False]), [0.25]).tolist() == [[False]]
