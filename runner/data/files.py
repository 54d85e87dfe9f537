"""File-backed splits: a list of (path, label) decoded on the fly by DataLoader workers.

A `FileSplit` holds paths and labels only, so memory does not grow with the dataset. When a loop walks the
split (see `runner.batches.batches`), `hardware.num_workers` processes decode the images (`read_rgb`:
libjpeg-turbo through torchvision, PIL for other formats) and crop, resize and flip them as uint8 with
torchvision's `transforms.v2`; the main process moves each uint8 batch to the device and `decode`s it there
to normalised float32, so the workers do a quarter of the copying and none of the float arithmetic. It has
the same interface as the in-memory `Split` (`len`, `y`, `y_clean`, `subset`, `decode`), so tasks and
methods never ask which one they hold.

A file no decoder can read (truncated, empty, not an image) stops the run with `UnreadableImage` under
`dataset.bad_images=error`; under `skip` the next readable sample stands in for it, and the batch carries
the files passed over to the main process (`UNREADABLE`), which names each once and counts them.
"""

from __future__ import annotations

import functools
import itertools
import logging
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from runner.hardware import to_device

log = logging.getLogger(__name__)

IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
AUGMENTS = ("none", "crop_flip", "rrc_flip")


class ImageTransforms(NamedTuple):
    train: object  # uint8 tensor (C, H, W) -> uint8 (C, size, size), with random augmentation
    eval: object  # uint8 tensor (C, H, W) -> uint8 (C, size, size), deterministic
    mean: tuple  # per channel: `FileSplit.decode` makes (x / 255 - mean) / std of the transformed batch
    std: tuple


def image_transforms(
    augment: str, image_size: int, mean, std, crop_pad: int = 4, eval_resize: int = 0
) -> ImageTransforms:
    """The papers' pipelines at side `image_size`, on uint8 tensors, to be normalised by `mean`/`std`.

    rrc_flip    train: RandomResizedCrop(size) + flip; eval: resize to `eval_resize` (0: size / 0.875, the
                ImageNet convention), center crop
    crop_flip   train: resize to size, random crop with `crop_pad` zero padding + flip; eval: resize
    none        train = eval: resize (+ center crop) only

    Resizing antialiases as PIL does (torchvision's native uint8 kernel on the CPU).
    """
    from torchvision.transforms import v2

    stats = tuple(map(float, mean)), tuple(map(float, std))
    if augment == "rrc_flip":
        resize = eval_resize or int(round(image_size / 0.875))
        evaluate = v2.Compose([v2.Resize(resize, antialias=True), v2.CenterCrop(image_size)])
        train = v2.Compose([v2.RandomResizedCrop(image_size, antialias=True), v2.RandomHorizontalFlip()])
        return ImageTransforms(train, evaluate, *stats)
    resize = [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)]
    evaluate = v2.Compose(resize)
    if augment == "none":
        return ImageTransforms(evaluate, evaluate, *stats)
    train = v2.Compose([*resize, v2.RandomCrop(image_size, padding=crop_pad), v2.RandomHorizontalFlip()])
    return ImageTransforms(train, evaluate, *stats)


def pil_rgb(path) -> object:
    """Image file `path` as an RGB PIL image, turned upright by its EXIF orientation."""
    from PIL import Image, ImageOps

    with Image.open(path) as image:
        return ImageOps.exif_transpose(image).convert("RGB")


def read_rgb(path) -> torch.Tensor:
    """Image file `path` as a uint8 RGB tensor (3, H, W), turned upright by its EXIF orientation.

    JPEG, PNG, GIF and WebP go through torchvision's decoders (libjpeg-turbo, straight to a tensor: no PIL
    image, no conversion); what they refuse (BMP, TIFF, ...) through PIL. Gray, palette, alpha and CMYK
    images come out as PIL's `convert("RGB")` would make them; a 16-bit PNG keeps the high byte of each
    sample, as PIL does for 16-bit colour (PIL clips 16-bit gray at 255 instead: white for most images).
    """
    from torchvision.io import ImageReadMode, decode_image, read_file

    try:
        image = decode_image(read_file(str(path)), mode=ImageReadMode.RGB, apply_exif_orientation=True)
    except RuntimeError:  # a format torchvision has no decoder for
        return torch.from_numpy(np.array(pil_rgb(path))).permute(2, 0, 1)  # channels last, as torchvision's
    if image.dim() == 4:  # an animated GIF: its first frame, as PIL reads it
        image = image[0]
    if image.dtype == torch.uint16:
        image = (image.to(torch.int32) >> 8).to(torch.uint8)
    return image


def try_read_rgb(path) -> tuple[torch.Tensor | None, str]:
    """(`read_rgb(path)`, "") or, for a file no decoder reads, (None, the reason on one line)."""
    try:
        return read_rgb(path), ""
    except Exception as e:  # what the decoders raise varies: OSError, RuntimeError, SyntaxError (PIL), ...
        return None, f"{type(e).__name__}: {' '.join(str(e).split())}"


class UnreadableImage(RuntimeError):
    """An image file no decoder reads, under `dataset.bad_images=error`. Raised in a DataLoader worker, it
    reaches the main process re-made from its text with the worker's traceback in it (torch's
    `ExceptionWrapper`): `str()` is the original one line either way."""

    def __str__(self) -> str:
        return super().__str__().rstrip().rpartition(f"{type(self).__name__}: ")[2]


class UnreadableFiles:
    """The main process's record of the files `ImageFiles` passed over (`dataset.bad_images=skip`), which
    reach it with the batches of whichever worker met them: each is named once in the log, and counted
    until `take()` (an epoch's `data/bad_images`)."""

    def __init__(self):
        self.named: set[str] = set()
        self.count = 0

    def record(self, batch: list[str]) -> None:
        """`batch`: per sample, the files passed over for it ("path (reason)" lines; "" for none)."""
        for entry in batch:
            for file in filter(None, entry.split("\n")):
                self.count += 1
                if file not in self.named:
                    self.named.add(file)
                    log.warning("unreadable image %s replaced by the next readable sample "
                                "(dataset.bad_images=skip)", file)  # fmt: skip

    def take(self) -> int:
        """The files passed over since the last call."""
        count, self.count = self.count, 0
        return count


UNREADABLE = UnreadableFiles()


@functools.cache
def _scale_and_shift(mean: tuple, std: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 / (255 std), mean / std) per channel on `device`, made once per device: made per batch, each
    would be a blocking host-to-device copy on CUDA; made here, copied without the host waiting."""
    mean, std = torch.tensor(mean, dtype=torch.float64), torch.tensor(std, dtype=torch.float64)
    return to_device((1 / (255 * std)).float(), device), to_device((mean / std).float(), device)


def normalized(x: torch.Tensor, mean, std) -> torch.Tensor:
    """A uint8 batch (B, C, ...) as float32 `(x / 255 - mean) / std` per channel, on x's device.

    In place after the one conversion: each out-of-place step would allocate another batch-sized buffer
    (on the CPU, paged in afresh: 3.6x slower for a batch of 64 images of 224 px).
    """
    scale, shift = _scale_and_shift(tuple(mean), tuple(std), x.device)
    per_channel = (-1,) + (1,) * (x.dim() - 2)
    return x.to(torch.float32, copy=True).mul_(scale.view(per_channel)).sub_(shift.view(per_channel))


class ImageFiles(torch.utils.data.Dataset):
    """`dataset[i] -> (transform(uint8 image i), i)`: the index travels with the sample. A file that
    cannot be read raises `UnreadableImage` with `bad_images="error"`; with "skip" the next readable one
    (circularly) stands in for it, so the epoch's index order, which resumes and DDP shards rely on, is
    kept: `dataset[i] -> (image j, j, unreadable)`, `unreadable` naming the files passed over ("path
    (reason)" lines, "" for none)."""

    def __init__(self, root: Path, paths: np.ndarray, transform, bad_images: str = "error"):
        self.root, self.paths, self.transform, self.bad_images = root, paths, transform, bad_images

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int):
        unreadable = []
        for j in itertools.chain(range(i, len(self.paths)), range(i)):
            path = self.root / self.paths[j].decode()
            image, reason = try_read_rgb(path)
            if image is None and self.bad_images == "error":
                raise UnreadableImage(
                    f"unreadable image {path} ({reason}); dataset.bad_images=skip replaces such samples"
                )
            if image is None:
                unreadable.append(f"{path} ({reason})")
            elif self.bad_images == "skip":
                return self.transform(image), j, "\n".join(unreadable)
            else:
                return self.transform(image), j
        raise UnreadableImage(f"none of the {len(self.paths)} images under {self.root} can be read")


class FileSplit:
    """Images named by `paths` (relative to `root`) with labels `y` (noisy where label noise is on) and
    `y_clean` (the true labels; `y` where unknown); `bad_images` ("error" | "skip") says what an
    unreadable file does (`ImageFiles`)."""

    def __init__(self, root, paths, y, y_clean=None, *, transforms: ImageTransforms, bad_images="error"):
        self.root = Path(root)
        # A numpy bytes array, not a list of str: forked workers share it without copy-on-read, at one
        # byte per character (ImageNet's 1.28M paths: ~50 MB per process).
        encoded = isinstance(paths, np.ndarray) and paths.dtype.kind == "S"
        self.encoded_paths = paths if encoded else np.char.encode(np.asarray(paths, dtype=str), "utf-8")
        self.y = torch.as_tensor(np.asarray(y), dtype=torch.long)
        self.y_clean = (
            self.y.clone() if y_clean is None else torch.as_tensor(np.asarray(y_clean), dtype=torch.long)
        )
        self.transforms, self.bad_images = transforms, bad_images

    def __len__(self) -> int:
        return len(self.y)

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """A uint8 batch from the workers (already on its device) as normalised float32 network input."""
        return normalized(x, self.transforms.mean, self.transforms.std)

    @property
    def paths(self) -> list[str]:
        return [p.decode() for p in self.encoded_paths]

    def subset(self, idx) -> FileSplit:
        idx = np.asarray(torch.as_tensor(idx, dtype=torch.long))
        paths, y, y_clean = self.encoded_paths[idx], self.y[idx], self.y_clean[idx]
        return FileSplit(self.root, paths, y, y_clean, transforms=self.transforms, bad_images=self.bad_images)

    def dataset(self, train: bool) -> ImageFiles:
        transform = self.transforms.train if train else self.transforms.eval
        return ImageFiles(self.root, self.encoded_paths, transform, self.bad_images)
