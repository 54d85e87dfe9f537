"""Decoding image files to uint8 tensors, the uint8 transforms, and the normalisation on the device."""

import os
import pickle
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from runner.data.fake import FakeSplit
from runner.data.files import (
    IMAGENET_STATS,
    FileSplit,
    _scale_and_shift,
    image_transforms,
    normalized,
    pil_rgb,
    read_rgb,
)

CPU = torch.device("cpu")


def smooth_rgb(height=30, width=40, seed=0) -> np.ndarray:
    """Smooth colour content (coarse noise, bilinearly enlarged): no sharp edges, where JPEG decoders'
    chroma upsampling would differ most."""
    coarse = np.random.default_rng(seed).integers(0, 256, size=(4, 5, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((width, height), Image.BILINEAR))


def png16(rgb: np.ndarray) -> bytes:
    """A 16-bit RGB PNG of uint16 `rgb` (H, W, 3), written by hand: PIL writes no 16-bit colour."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    height, width, _ = rgb.shape
    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in rgb)
    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def as_hwc(image: torch.Tensor) -> np.ndarray:
    assert image.dtype == torch.uint8 and image.dim() == 3 and image.shape[0] == 3
    return image.permute(1, 2, 0).numpy().astype(np.int16)


LOSSLESS = {
    "gray.png": lambda rgb: Image.fromarray(rgb).convert("L"),
    "palette.png": lambda rgb: Image.fromarray(rgb).convert("P"),
    "rgba.png": lambda rgb: Image.fromarray(rgb).convert("RGBA"),
    "gray_alpha.png": lambda rgb: Image.fromarray(rgb).convert("LA"),
    "rgb.bmp": Image.fromarray,  # no torchvision decoder: PIL
    "rgb.tif": Image.fromarray,  # no torchvision decoder: PIL
    "palette.gif": lambda rgb: Image.fromarray(rgb).convert("P"),
    "rgb.webp": Image.fromarray,  # saved lossless below
}


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_formats_decode_to_rgb_exactly_as_pil_converts_them(tmp_path, name):
    path = tmp_path / name
    LOSSLESS[name](smooth_rgb()).save(path, lossless=True)
    assert (as_hwc(read_rgb(path)) == np.asarray(Image.open(path).convert("RGB"))).all()


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_jpegs_decode_to_rgb_within_decoder_rounding_of_pil(tmp_path, mode):
    path = tmp_path / f"{mode}.jpg"
    Image.fromarray(smooth_rgb()).convert(mode).save(path, quality=90)
    ours, pils = as_hwc(read_rgb(path)), np.asarray(Image.open(path).convert("RGB")).astype(np.int16)
    # Both are libjpeg-turbo with its accurate integer IDCT, but Pillow and torchvision bundle their own
    # builds: an IDCT rounding of 1 level in a chroma sample becomes up to 1.77 levels of blue in YCbCr ->
    # RGB, so up to 3 levels in all; smooth content keeps chroma-upsampling variants out of play.
    assert ours.shape == pils.shape and np.abs(ours - pils).max() <= 3


def test_16_bit_pngs_keep_the_high_byte(tmp_path):
    rgb16 = smooth_rgb().astype(np.uint16) * 256 + np.arange(40, dtype=np.uint16)[None, :, None]  # low bytes
    (tmp_path / "rgb16.png").write_bytes(png16(rgb16))
    ours = as_hwc(read_rgb(tmp_path / "rgb16.png"))
    assert (ours == rgb16 >> 8).all()
    assert (ours == np.asarray(Image.open(tmp_path / "rgb16.png").convert("RGB"))).all()  # as PIL's
    Image.fromarray(rgb16[..., 0]).save(tmp_path / "gray16.png")  # PIL would clip it at 255
    assert (as_hwc(read_rgb(tmp_path / "gray16.png")) == (rgb16[..., :1] >> 8)).all()


def test_animated_gif_gives_its_first_frame(tmp_path):
    first, second = (Image.fromarray(smooth_rgb(seed=s)).convert("P") for s in (0, 1))
    first.save(tmp_path / "anim.gif", save_all=True, append_images=[second])
    assert (as_hwc(read_rgb(tmp_path / "anim.gif")) == np.asarray(pil_rgb(tmp_path / "anim.gif"))).all()


@pytest.mark.parametrize("name", ["rotated.jpg", "rotated.tif"])
def test_exif_orientation_turns_images_upright_as_pil_exif_transpose(tmp_path, name):
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    Image.fromarray(smooth_rgb()).save(tmp_path / name, exif=exif, quality=95)
    with Image.open(tmp_path / name) as image:
        upright = np.asarray(ImageOps.exif_transpose(image).convert("RGB")).astype(np.int16)
    ours = as_hwc(read_rgb(tmp_path / name))
    assert ours.shape == upright.shape == (40, 30, 3) and np.abs(ours - upright).max() <= 3


@pytest.mark.parametrize(("augment", "size"), [("rrc_flip", 224), ("crop_flip", 32), ("none", 64)])
def test_eval_transforms_on_uint8_match_the_pil_float_pipeline(tmp_path, augment, size):
    from torchvision import transforms as T

    path = tmp_path / "photo.jpg"
    Image.fromarray(smooth_rgb(375, 500)).save(path, quality=90)
    tf = image_transforms(augment, size, *IMAGENET_STATS)
    ours = normalized(tf.eval(read_rgb(path))[None], *IMAGENET_STATS)[0]
    side = round(size / 0.875) if augment == "rrc_flip" else size
    pil_pipeline = T.Compose([T.Resize(side), T.CenterCrop(size), T.ToTensor(), T.Normalize(*IMAGENET_STATS)])
    theirs = pil_pipeline(Image.open(path).convert("RGB"))
    levels = (ours - theirs) * torch.tensor(IMAGENET_STATS[1]).view(3, 1, 1) * 255
    assert ours.shape == (3, size, size) and levels.abs().max() <= 1.01  # resampling rounds differently


def test_train_transforms_keep_uint8_and_the_size(tmp_path):
    image = torch.from_numpy(smooth_rgb(375, 500).copy()).permute(2, 0, 1)
    for augment in ("rrc_flip", "crop_flip", "none"):
        out = image_transforms(augment, 48, *IMAGENET_STATS, crop_pad=8).train(image)
        assert out.dtype == torch.uint8 and out.shape == (3, 48, 48)
    flat = torch.full((3, 48, 48), 200, dtype=torch.uint8)
    padded = [image_transforms("crop_flip", 48, *IMAGENET_STATS, crop_pad=8).train(flat) for _ in range(20)]
    assert any((p == 0).any() for p in padded)  # zero padding shows at the border of some crops


def test_decode_normalises_with_stats_made_once_per_device(tmp_path):
    Image.fromarray(smooth_rgb()).save(tmp_path / "a.png")
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)
    tf = image_transforms("none", 16, mean, std)
    split = FileSplit(tmp_path, ["a.png", "a.png"], [0, 1], transforms=tf)
    x = torch.stack([split.dataset(train=False)[i][0] for i in range(2)])
    assert x.dtype == torch.uint8
    expected = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(split.decode(x), expected)
    made = _scale_and_shift.cache_info().misses
    torch.testing.assert_close(split.subset([1]).decode(x[1:]), expected[1:])
    assert _scale_and_shift.cache_info().misses == made and x.dtype == torch.uint8
    pickle.loads(pickle.dumps(split.dataset(train=True)))  # what the DataLoader sends its workers


def test_fake_images_are_uint8_the_same_on_every_read_and_decode_to_float():
    split = FakeSplit(np.arange(10, 14), 3, (3, 8, 8), seed=5)
    first = split.dataset(train=True)[2][0]
    again = split.subset([1, 2]).dataset(train=False)[1][0]
    assert first.dtype == torch.uint8 and torch.equal(first, again)
    decoded = split.decode(first[None])
    assert decoded.dtype == torch.float32 and float(decoded.min()) < -1.5 and float(decoded.max()) > 1.5


def test_unreadable_files_raise_the_pil_error(tmp_path):
    Path(tmp_path / "broken.jpg").write_bytes(b"not an image")
    with pytest.raises(OSError):
        read_rgb(tmp_path / "broken.jpg")


def test_runner_turns_transparent_huge_pages_on_before_torch_loads():
    """Read once at torch's first allocation: `import runner` sets it before anything imports torch, and
    leaves a user's own setting alone."""
    code = "import os, sys, runner; print('torch' in sys.modules, os.environ['THP_MEM_ALLOC_ENABLE'])"
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "1"]
    env["THP_MEM_ALLOC_ENABLE"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "0"]
