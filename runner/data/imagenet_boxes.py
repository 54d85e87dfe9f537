"""ImageNet validation bounding boxes for the Co-Mixup paper's Tables 2 and 3 (`runner.canvas_metrics`).

`dataset.imagenet_boxes=PATH` names the folder of the ILSVRC2012 validation annotations as released
(ILSVRC2012_bbox_val_v3.tgz, extracted): one PASCAL-VOC-style XML per validation image,

    PATH/ILSVRC2012_val_00000001.xml   (or PATH/<wnid>/ILSVRC2012_val_00000001.xml)
    <annotation> ... <size><width>500</width><height>375</height></size>
      <object><name>n01751748</name> ... <bndbox><xmin>111</xmin><ymin>108</ymin><xmax>500</xmax>
      <ymax>375</ymax></bndbox></object> ... </annotation>

Every object's box of each test image (the file named after the image) is carried through the test
split's own evaluation transform (resize and center crop, torchvision's box geometry), so the boxes are
in the pixels the network sees.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import torch

from runner.checks import ConfigError
from runner.data import Data

LAYOUT = "one PASCAL VOC XML per val image, PATH/ILSVRC2012_val_<8 digits>.xml (ILSVRC2012_bbox_val_v3.tgz)"
NOISE_STD = 0.1  # Co-Mixup's Table 3: N(0, 0.1^2) outside the box, clipped


def read_annotation(path: Path) -> tuple[tuple[int, int], np.ndarray]:
    """((height, width), boxes (k, 4) float as x0, y0, x1, y1) of one annotation file."""
    try:
        root = ET.parse(path).getroot()
        size = root.find("size")
        shape = int(size.findtext("height")), int(size.findtext("width"))
        boxes = [
            [float(box.findtext(key)) for key in ("xmin", "ymin", "xmax", "ymax")]
            for box in root.iter("bndbox")
        ]
    except ET.ParseError as e:
        raise ConfigError(f"{path}: not XML ({e}); expected {LAYOUT}") from None
    except (AttributeError, TypeError, ValueError):  # an element missing or not a number
        raise ConfigError(
            f"{path}: expected <size> with <width>, <height> and <bndbox>es with numbers in <xmin>, <ymin>, "
            "<xmax>, <ymax>"
        ) from None
    if not boxes:
        raise ConfigError(f"{path}: no <object><bndbox> in it; expected {LAYOUT}")
    return shape, np.array(boxes)


def annotation_file(folder: Path, image: Path) -> Path:
    for path in (folder / f"{image.stem}.xml", folder / image.parent.name / f"{image.stem}.xml"):
        if path.is_file():
            return path
    raise ConfigError(f"dataset.imagenet_boxes={folder}: no {image.stem}.xml for {image}; expected {LAYOUT}")


def val_boxes(folder: Path, split) -> list[np.ndarray]:
    """Per image of the file-backed `split`, its boxes (k, 4) as (r0, c0, r1, c1) in network-input pixels
    after the split's evaluation transform, rounded to whole pixels."""
    from torchvision import tv_tensors

    out = []
    for encoded in split.encoded_paths:
        image = Path(encoded.decode())
        shape, boxes = read_annotation(annotation_file(folder, image))
        boxes = tv_tensors.BoundingBoxes(torch.from_numpy(boxes), format="XYXY", canvas_size=shape)
        x0, y0, x1, y1 = np.rint(split.transforms.eval(boxes).numpy()).astype(int).T
        out.append(np.stack([y0, x0, y1, x1], axis=1))
    return out


def add_val_boxes(data: Data, folder: str) -> None:
    """With `folder` (`dataset.imagenet_boxes`), the test split's boxes as `data.meta["boxes"]["test"]`
    and Table 3's noise level; the metrics of `runner.canvas_metrics` then run after training."""
    if not folder:
        return
    if not hasattr(data.test, "encoded_paths"):
        raise ConfigError(
            f"dataset.imagenet_boxes={folder}: needs the ImageNet val images as files (dataset=imagenet), "
            "not an in-memory test split"
        )
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"dataset.imagenet_boxes={folder}: {path.resolve()} is not a folder; expected {LAYOUT}"
        )
    data.meta["boxes"] = {"test": val_boxes(path, data.test)}
    data.meta["background_noise_std"] = NOISE_STD
