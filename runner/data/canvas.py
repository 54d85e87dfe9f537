"""`digits_canvas`: sklearn's 8x8 digits pasted at random positions on a noise canvas, boxes known.

A CPU-scale stand-in for the localisation and robustness studies of the mixup papers: each digit
(pixels in [0, 1]) is composited with `max` onto a canvas of U(0, noise) pixels at a uniform random
position, so the object fills (8 / canvas)^2 of the image and its box is known exactly. Train and
test digits are disjoint (a stratified split of the 1797 images; the default test_fraction leaves
1000 for training); every test digit is placed `test_copies` times.

`canvas_metrics` measures on the test split what the Co-Mixup paper measures on ImageNet: error,
expected calibration error, CAM localisation accuracy, and the error after corrupting everything
outside the box (replaced by another test image, or Gaussian noise added and clipped).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage

from runner.data import Data, Split, register_dataset, three_way_split
from runner.schema import DatasetConfig, check_range

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


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = 10) -> float:
    """ECE = sum_b |B_b| / N * |acc(B_b) - conf(B_b)| over equal-width confidence bins."""
    conf, pred = probs.max(1)
    correct = (pred == labels).double()
    which = torch.clamp((conf * bins).long(), max=bins - 1)
    ece = 0.0
    for b in range(bins):
        inside = which == b
        if inside.any():
            ece += inside.double().mean().item() * abs(
                correct[inside].mean().item() - conf[inside].double().mean().item()
            )
    return ece


def box_masks(boxes: np.ndarray, size: int) -> torch.Tensor:
    """(N, 1, size, size) float masks, 1 inside each box."""
    grid = np.arange(size)
    rows = (grid[None, :] >= boxes[:, :1]) & (grid[None, :] < boxes[:, 2:3])
    cols = (grid[None, :] >= boxes[:, 1:2]) & (grid[None, :] < boxes[:, 3:4])
    return torch.from_numpy((rows[:, :, None] & cols[:, None, :])[:, None].astype(np.float32))


def cam_boxes(cams: np.ndarray, threshold: float = 0.25) -> np.ndarray:
    """Box of the largest connected region where the min-max normalised CAM >= threshold (CAM protocol)."""
    out = np.zeros((len(cams), 4), int)
    for i, cam in enumerate(cams):
        span = cam.max() - cam.min()
        norm = (cam - cam.min()) / span if span > 0 else np.ones_like(cam)
        regions, count = ndimage.label(norm >= threshold)
        largest = np.argmax(np.bincount(regions.ravel(), minlength=count + 1)[1:]) + 1
        rows, cols = np.nonzero(regions == largest)
        out[i] = rows.min(), cols.min(), rows.max() + 1, cols.max() + 1
    return out


def localisation_accuracy(cams, boxes, correct, thresholds) -> np.ndarray:
    """Top-1 localisation accuracy (class right and IoU >= 0.5) at each CAM threshold."""
    return np.array([((box_iou(cam_boxes(cams, t), boxes) >= 0.5) & correct).mean() for t in thresholds])


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    inter = np.clip(np.minimum(a[:, 2:], b[:, 2:]) - np.maximum(a[:, :2], b[:, :2]), 0, None).prod(1)
    area = lambda box: (box[:, 2:] - box[:, :2]).prod(1)  # noqa: E731
    return inter / (area(a) + area(b) - inter)


@torch.no_grad()
def canvas_metrics(
    model, data: Data, ctx, noise_std: float = 0.3, cam_threshold: float = 0.25, seed: int = 0
):
    """Test error, ECE (10 bins), CAM localisation and the error with the background replaced by
    another test image or given N(0, noise_std^2) noise (clipped to [0, 1]). Fractions in [0, 1].

    Localisation (needs `model.feature_maps`): a hit is the class right and IoU >= 0.5 between the
    box and the CAM box at a threshold. `loc_acc@0.25` uses the paper's threshold; on 8x8 objects in
    a 24x24 canvas a coarse CAM at 0.25 covers most of the image, so `loc_acc` is the accuracy at the
    best threshold of 0.05..0.95 (MaxBoxAcc, Choe et al. 2020) with that threshold in `loc_threshold`.
    """
    from runner.train import predict

    x, y = data.test.x, data.test.y_clean
    boxes = data.meta["boxes"]["test"]
    size = x.shape[-1]
    inside = box_masks(boxes, size)
    rng = np.random.default_rng(seed)
    other = torch.from_numpy((np.arange(len(x)) + rng.integers(1, len(x), size=len(x))) % len(x))
    replaced = x * inside + x[other] * (1 - inside)
    gen = torch.Generator().manual_seed(seed)
    noisy = (x + noise_std * torch.randn(x.shape, generator=gen) * (1 - inside)).clamp(0, 1)

    logits = predict(model, x, ctx)
    pred = logits.argmax(1)
    metrics = {
        "test/err": (pred != y).double().mean().item(),
        "test/ece": expected_calibration_error(logits.softmax(1), y),
        "test/err_bg_replace": (predict(model, replaced, ctx).argmax(1) != y).double().mean().item(),
        "test/err_bg_noise": (predict(model, noisy, ctx).argmax(1) != y).double().mean().item(),
    }
    cams = class_activation_maps(model, x, pred, ctx)
    if cams is not None:
        thresholds = np.round(np.arange(0.05, 1.0, 0.05), 2)
        accuracy = localisation_accuracy(cams.numpy(), boxes, (pred == y).numpy(), thresholds)
        best = int(np.argmax(accuracy))
        metrics["test/loc_acc"] = float(accuracy[best])
        metrics["test/loc_threshold"] = float(thresholds[best])
        metrics[f"test/loc_acc@{cam_threshold}"] = float(
            accuracy[np.argmin(np.abs(thresholds - cam_threshold))]
        )
    return metrics


@torch.no_grad()
def class_activation_maps(model, x: torch.Tensor, classes: torch.Tensor, ctx, batch_size: int = 512):
    """CAM_c = sum_k w[c, k] feature_maps_k upsampled (bilinear) to the image; None without feature maps."""
    was_training = model.training
    model.eval()
    cams = []
    try:
        for start in range(0, len(x), batch_size):
            maps = model.feature_maps(x[start : start + batch_size].to(ctx.device)).float()
            weights = model.classifier.weight[classes[start : start + batch_size].to(ctx.device)].float()
            cam = torch.einsum("bchw,bc->bhw", maps, weights)[:, None]
            cams.append(
                F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0].cpu()
            )
    except NotImplementedError:  # a model without spatial feature maps (mlp)
        return None
    finally:
        model.train(was_training)
    return torch.cat(cams)
