"""What the Co-Mixup paper measures on ImageNet (its Tables 2 and 3), on a test split whose object boxes
are known: the `digits_canvas` test split, or ImageNet val with `dataset.imagenet_boxes` (the ILSVRC
annotation files, `runner.data.imagenet_boxes`). Error, expected calibration error (10 bins, as its
Table 2), CAM localisation accuracy, and the error after corrupting everything outside the boxes
(replaced by another test image, or Gaussian noise added and clipped). An evaluation of a trained model,
so it lives beside the training loop, not the data.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage
from torchvision.ops import box_iou as box_iou_matrix

from runner.batches import STREAMED_EVAL_BATCH, batches, in_order
from runner.data import Data, Split
from runner.data.canvas import box_masks
from runner.metrics import calibration_bins, expected_calibration_error


def cam_boxes(cams: np.ndarray, threshold: float = 0.25) -> np.ndarray:
    """Box (r0, c0, r1, c1) of the largest contour of each CAM binarised at `threshold`, as the authors'
    evaluation code (InfoCAM's `BboxGenerator`): the min-max normalised CAM as uint8 grey levels, above
    int(threshold x their max); of its 8-connected regions, the one whose outer border, the polygon
    through its border pixels' centres, encloses the largest area (cv2.contourArea); that region's box."""
    low = cams.min(axis=(1, 2), keepdims=True)
    span = cams.max(axis=(1, 2), keepdims=True) - low
    norm = np.divide(cams - low, span, out=np.ones_like(cams), where=span > 0)
    grey = np.clip(norm * 255, 0, 255).astype(np.uint8)
    cut = (threshold * grey.max(axis=(1, 2), keepdims=True)).astype(int)
    out = np.zeros((len(cams), 4), int)
    for i, above in enumerate(grey > cut):
        regions, count = ndimage.label(ndimage.binary_fill_holes(above), structure=np.ones((3, 3)))
        if count == 0:  # nothing above the cut (threshold 1): the code's box of the corner pixel
            out[i] = 0, 0, 1, 1
            continue
        rows, cols = ndimage.find_objects(regions)[int(np.argmax(contour_areas(regions, count)))]
        out[i] = rows.start, cols.start, rows.stop, cols.stop
    return out


def contour_areas(regions: np.ndarray, count: int) -> np.ndarray:
    """Area enclosed by the outer border polygon (through border pixels' centres) of each labelled
    8-connected region 1..count, holes filled: each 2x2 block of pixel centres inside the polygon adds 1,
    one cut by a diagonal step (3 of its 4 pixels in the region) adds 1/2, one a border runs along adds
    nothing (two regions never share a block: they would touch)."""
    blocks = np.stack([regions[:-1, :-1], regions[1:, :-1], regions[:-1, 1:], regions[1:, 1:]])
    inside = (blocks > 0).sum(0)
    weight = (inside == 4) + 0.5 * (inside == 3)
    return np.bincount(blocks.max(0).ravel(), weights=weight.ravel(), minlength=count + 1)[1:]


def localisation_hits(cams, box_sets, correct, thresholds) -> np.ndarray:
    """(thresholds, N) bool: image i's class right and its CAM box at the threshold with IoU >= 0.5
    against one of its ground-truth boxes (`box_sets[i]`, (k, 4); ImageNet images may have several)."""
    counts = [len(b) for b in box_sets]
    truth = np.concatenate(box_sets)
    starts = np.r_[0, np.cumsum(counts)[:-1]]
    hits = []
    for t in thresholds:
        iou = box_iou(np.repeat(cam_boxes(cams, t), counts, axis=0), truth)
        hits.append((np.maximum.reduceat(iou, starts) >= 0.5) & correct)
    return np.array(hits)


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of box a[i] with box b[i], (N, 4) each as (r0, c0, r1, c1): torchvision's `box_iou` per pair
    (vmapped: its (N, N) matrix of all pairs would be N times the work)."""
    iou = torch.vmap(lambda p, q: box_iou_matrix(p[None], q[None])[0, 0])
    return iou(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)).numpy()


def outside_masks(box_sets, size: int) -> torch.Tensor:
    """(N, 1, size, size) float masks, 1 outside every box of image i (its background)."""
    owner = torch.from_numpy(np.repeat(np.arange(len(box_sets)), [len(b) for b in box_sets]))
    inside = torch.zeros(len(box_sets), 1, size, size).index_add_(
        0, owner, box_masks(np.concatenate(box_sets), size)
    )
    return 1 - inside.clamp_(max=1)


@torch.no_grad()
def canvas_metrics(
    model, data: Data, ctx, noise_std: float | None = None, cam_threshold: float = 0.25, seed: int = 0,
    batch_size=512,
):  # fmt: skip
    """Test error, ECE with the paper's 10 bins (`test/ece10`; the training loop reports 15-bin
    `test/ece`), CAM localisation and the error with the background (outside every box) replaced by
    another test image or given N(0, noise_std^2) noise (in pixel values, clipped to [0, 1]). Fractions in
    [0, 1]. The boxes are `data.meta["boxes"]["test"]`: (N, 4) (digits_canvas) or one (k, 4) array per
    image (ImageNet val, `runner.data.imagenet_boxes`), in network-input pixels as (r0, c0, r1, c1);
    `noise_std` defaults to the dataset's paper (`meta["background_noise_std"]`: ImageNet 0.1), else 0.3.

    The test split is walked through `runner.batches.batches` (file-backed splits in batches of at most
    STREAMED_EVAL_BATCH), the replacing images in a second walk in shuffled order, and everything is
    reduced batch by batch, so ImageNet's 50k images never sit in memory. The noise is drawn batch by
    batch in test order from one generator seeded with `seed`: the values one draw for the whole split
    gives (a CPU normal draw consumes its stream 16 values at a time; an image has a multiple of 16).

    Localisation (needs `model.feature_maps`), as the authors' evaluation code: a hit is the class right and
    IoU >= 0.5 between a ground-truth box and the box of the CAM (`class_activation_maps`: 3x3 smoothed,
    bicubic) binarised at `cam_threshold` (`cam_boxes`); `loc_acc` at the paper's 0.25. On 8x8 objects in
    a 24x24 canvas a coarse CAM at 0.25 covers most of the image, so the accuracy at the best threshold of
    0.05..0.95 (MaxBoxAcc, Choe et al. 2020; picked on the test set itself) is `loc_acc_best_threshold`,
    with that threshold in `loc_threshold`.
    """
    test, y = data.test, data.test.y_clean
    n, size = len(test), data.input_shape[-1]
    box_sets = [np.reshape(b, (-1, 4)) for b in data.meta["boxes"]["test"]]
    noise_std = data.meta.get("background_noise_std", 0.3) if noise_std is None else noise_std
    rng = np.random.default_rng(seed)
    other = torch.from_numpy((np.arange(n) + rng.integers(1, n, size=n)) % n)
    noise_source = torch.Generator().manual_seed(seed)
    if not isinstance(test, Split):
        batch_size = min(batch_size, STREAMED_EVAL_BATCH)
    order = in_order(n, batch_size)
    walks = zip(batches(test, ctx, order), batches(test, ctx, [other[i] for i in order]))
    sweep = np.round(np.arange(0.05, 1.0, 0.05), 2)
    thresholds = np.r_[cam_threshold, sweep]
    was_training = model.training
    model.eval()
    out = {"clean": [], "replace": [], "noise": []}
    hits = []
    try:
        for (x, idx), (x_other, _) in walks:
            batch_boxes = [box_sets[i] for i in idx.tolist()]
            outside = outside_masks(batch_boxes, size).to(x.device)
            noise = noise_std * torch.randn(x.shape, generator=noise_source).to(x.device)
            with ctx.autocast():
                logits = model(x).float()
                out["replace"].append(model(x - (x - x_other) * outside).argmax(1).cpu())
                out["noise"].append(model(noisy_background(x, noise * outside, data.meta)).argmax(1).cpu())
            out["clean"].append(logits.cpu())
            cams = class_activation_maps(model, x, logits.argmax(1))
            if cams is not None:
                correct = (logits.argmax(1).cpu() == y[idx.cpu()]).numpy()
                hits.append(localisation_hits(cams.numpy(), batch_boxes, correct, thresholds))
    finally:
        model.train(was_training)
    logits = torch.cat(out["clean"])
    pred = logits.argmax(1)
    metrics = {
        "test/err": (pred != y).double().mean().item(),
        "test/ece10": expected_calibration_error(calibration_bins(logits.softmax(1), y, bins=10)),
        "test/err_bg_replace": (torch.cat(out["replace"]) != y).double().mean().item(),
        "test/err_bg_noise": (torch.cat(out["noise"]) != y).double().mean().item(),
    }
    if hits:
        accuracy = np.concatenate(hits, axis=1).mean(1)
        best = int(np.argmax(accuracy[1:]))
        metrics["test/loc_acc"] = float(accuracy[0])
        metrics["test/loc_acc_best_threshold"] = float(accuracy[1 + best])
        metrics["test/loc_threshold"] = float(sweep[best])
    return metrics


def noisy_background(x: torch.Tensor, noise: torch.Tensor, meta: dict) -> torch.Tensor:
    """Network input `x` plus pixel-value `noise`, clipped to [0, 1] in pixel values: `x` itself for
    inputs in [0, 1], else through the (mean, std) of `meta["normalize"]` (ImageNet)."""
    if meta.get("normalize") is None:
        return (x + noise).clamp(0, 1)
    mean, std = (torch.tensor(v, device=x.device, dtype=x.dtype).view(-1, 1, 1) for v in meta["normalize"])
    return (((x * std + mean) + noise).clamp(0, 1) - mean) / std


def class_activation_maps(model, x: torch.Tensor, classes: torch.Tensor, smoothing: int = 3):
    """CAM_c = sum_k w[c, k] feature_maps_k of a batch, summed over each `smoothing` x `smoothing`
    neighbourhood (the authors' all-ones convolution, zero padded) and upsampled bicubically to the image,
    on the CPU; None for a model without spatial feature maps (mlp)."""
    try:
        maps = model.feature_maps(x).float()
    except NotImplementedError:
        return None
    cam = torch.einsum("bchw,bc->bhw", maps, model.classifier.weight[classes].float())[:, None]
    ones = torch.ones(1, 1, smoothing, smoothing, device=cam.device)
    cam = F.conv2d(cam, ones, padding=smoothing // 2)
    return F.interpolate(cam, size=x.shape[-2:], mode="bicubic", align_corners=False)[:, 0].cpu()
