"""What the Co-Mixup paper measures on ImageNet, measured on the `digits_canvas` test split (boxes
known): error, expected calibration error (10 bins, as its Table 2), CAM localisation accuracy, and the
error after corrupting everything outside the box (replaced by another test image, or Gaussian noise
added and clipped). An evaluation of a trained model, so it lives beside the training loop, not the data.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from scipy import ndimage
from torchvision.ops import box_iou as box_iou_matrix

from runner.data import Data
from runner.data.canvas import box_masks
from runner.metrics import calibration_bins, expected_calibration_error
from runner.train import batches, in_order


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
    """IoU of box a[i] with box b[i], (N, 4) each as (r0, c0, r1, c1): torchvision's `box_iou` per pair
    (vmapped: its (N, N) matrix of all pairs would be N times the work)."""
    iou = torch.vmap(lambda p, q: box_iou_matrix(p[None], q[None])[0, 0])
    return iou(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)).numpy()


@torch.no_grad()
def canvas_metrics(
    model, data: Data, ctx, noise_std: float = 0.3, cam_threshold: float = 0.25, seed: int = 0, batch_size=512
):
    """Test error, ECE with the paper's 10 bins (`test/ece10`; the training loop reports 15-bin
    `test/ece`), CAM localisation and the error with the background replaced by another test image
    or given N(0, noise_std^2) noise (clipped to [0, 1]). Fractions in [0, 1]. The test split is
    walked through `runner.train.batches`, the replacing images in a second walk in shuffled order.

    Localisation (needs `model.feature_maps`): a hit is the class right and IoU >= 0.5 between the
    box and the CAM box at a threshold. `loc_acc@0.25` uses the paper's threshold; on 8x8 objects in
    a 24x24 canvas a coarse CAM at 0.25 covers most of the image, so `loc_acc` is the accuracy at the
    best threshold of 0.05..0.95 (MaxBoxAcc, Choe et al. 2020) with that threshold in `loc_threshold`.
    """
    test, y = data.test, data.test.y_clean
    n = len(test)
    boxes = data.meta["boxes"]["test"]
    inside = box_masks(boxes, data.input_shape[-1])
    rng = np.random.default_rng(seed)
    other = torch.from_numpy((np.arange(n) + rng.integers(1, n, size=n)) % n)
    noise = noise_std * torch.randn((n, *data.input_shape), generator=torch.Generator().manual_seed(seed))
    order = in_order(n, batch_size)
    walks = zip(batches(test, ctx, order), batches(test, ctx, [other[i] for i in order]))
    was_training = model.training
    model.eval()
    out = {"clean": [], "replace": [], "noise": [], "cam": []}
    try:
        for (x, idx), (x_other, _) in walks:
            outside = 1 - inside[idx].to(x.device)
            with ctx.autocast():
                logits = model(x).float()
                out["replace"].append(model(x - (x - x_other) * outside).argmax(1).cpu())
                out["noise"].append(
                    model((x + noise[idx].to(x.device) * outside).clamp(0, 1)).argmax(1).cpu()
                )
            out["clean"].append(logits.cpu())
            out["cam"].append(class_activation_maps(model, x, logits.argmax(1)))
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
    if out["cam"] and out["cam"][0] is not None:
        cams = torch.cat(out["cam"]).numpy()
        thresholds = np.round(np.arange(0.05, 1.0, 0.05), 2)
        accuracy = localisation_accuracy(cams, boxes, (pred == y).numpy(), thresholds)
        best = int(np.argmax(accuracy))
        metrics["test/loc_acc"] = float(accuracy[best])
        metrics["test/loc_threshold"] = float(thresholds[best])
        metrics[f"test/loc_acc@{cam_threshold}"] = float(
            accuracy[np.argmin(np.abs(thresholds - cam_threshold))]
        )
    return metrics


def class_activation_maps(model, x: torch.Tensor, classes: torch.Tensor):
    """CAM_c = sum_k w[c, k] feature_maps_k of a batch, upsampled (bilinear) to the image, on the CPU;
    None for a model without spatial feature maps (mlp)."""
    try:
        maps = model.feature_maps(x).float()
    except NotImplementedError:
        return None
    cam = torch.einsum("bchw,bc->bhw", maps, model.classifier.weight[classes].float())[:, None]
    return F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0].cpu()
