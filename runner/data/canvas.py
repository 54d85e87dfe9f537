"""`digits_canvas`: sklearn's 8x8 digits pasted at random positions on a noise canvas, boxes known.

A CPU-scale stand-in for the localisation and robustness studies of the mixup papers: each digit
(pixels in [0, 1]) is composited with `max` onto a canvas of U(0, noise) pixels at a uniform random
position, so the object fills (8 / canvas)^2 of the image and its box is known exactly. Train and
test digits are disjoint (a stratified split of the 1797 images; the default test_fraction leaves
1000 for training); every test digit is placed `test_copies` times.

`runner.canvas_metrics` measures on its test split what the Co-Mixup paper measures on ImageNet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from runner.checks import check_range
from runner.data import Data, Split, register_dataset, three_way_split
from runner.schema import DatasetConfig

DIGIT = 8  # side of a sklearn digit


@dataclass
class CanvasConfig(DatasetConfig):
    canvas: int = 24  # side of the square canvas, pixels
    noise: float = 0.35  # background pixels ~ U(0, noise)
    test_copies: int = 2  # placements of every test digit

    def __post_init__(self):
        super().__post_init__()
        check_range("dataset.canvas", self.canvas, DIGIT)
        check_range("dataset.noise", self.noise, 0.0, 1.0)
        check_range("dataset.test_copies", self.test_copies, 1)


def place_on_canvas(digits: np.ndarray, size: int, noise: float, rng: np.random.Generator):
    """Composite digits (N, 8, 8) onto U(0, noise) canvases (N, size, size) at random positions.

    Returns (images (N, 1, size, size) float32, boxes (N, 4) int as row0, col0, row1, col1).
    """
    n = len(digits)
    images = rng.uniform(0.0, noise, size=(n, size, size))
    rows, cols = rng.integers(0, size - DIGIT + 1, size=(2, n))
    window = np.arange(DIGIT)
    r = rows[:, None, None] + window[None, :, None]
    c = cols[:, None, None] + window[None, None, :]
    sample = np.arange(n)[:, None, None]
    images[sample, r, c] = np.maximum(images[sample, r, c], digits)
    boxes = np.stack([rows, cols, rows + DIGIT, cols + DIGIT], axis=1)
    return images[:, None].astype(np.float32), boxes


@register_dataset("digits_canvas", schema=CanvasConfig)
def digits_canvas(cfg, rng) -> Data:
    """The canvas dataset; `meta["boxes"]` maps split name -> (N, 4) object boxes."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    digits = (bunch.images / 16.0)[:, None]  # (N, 1, 8, 8) so the split helper keeps the shape
    splits = three_way_split(digits, bunch.target, cfg.val_fraction, cfg.test_fraction, rng)
    out, boxes = [], {}
    for name, split, copies in zip(("train", "val", "test"), splits, (1, 1, cfg.test_copies)):
        x = split.x.numpy()[:, 0].repeat(copies, axis=0)
        y = split.y.repeat_interleave(copies)
        images, boxes[name] = place_on_canvas(x, cfg.canvas, cfg.noise, rng)
        out.append(Split(torch.from_numpy(images), y, y.clone()))
    return Data(*out, num_classes=10, input_shape=(1, cfg.canvas, cfg.canvas), meta={"boxes": boxes})


# ----------------------------------------------------------------------------------------------
# metrics


def box_masks(boxes: np.ndarray, size: int) -> torch.Tensor:
    """(N, 1, size, size) float masks, 1 inside each box."""
    grid = np.arange(size)
    rows = (grid[None, :] >= boxes[:, :1]) & (grid[None, :] < boxes[:, 2:3])
    cols = (grid[None, :] >= boxes[:, 1:2]) & (grid[None, :] < boxes[:, 3:4])
    return torch.from_numpy((rows[:, :, None] & cols[:, None, :])[:, None].astype(np.float32))
