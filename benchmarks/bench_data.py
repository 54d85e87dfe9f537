"""File-backed data path: decoding throughput against torchvision, and memory that does not grow with N.

1. Throughput: 256-px JPEGs in an imagefolder layout, decoded and augmented (RandomResizedCrop 224 + flip,
   ImageNet normalisation) by 2 DataLoader workers in batches of 64: the runner's `FileSplit` through
   `runner.train.batches` against torchvision's `ImageFolder` + `DataLoader` with the same transforms.
   Target: >= 0.9x torchvision's images/s.
2. Memory: peak resident memory (the run and its workers) of `runner dataset=imagefolder +debug=smoke` on
   300 and on 3,000 images of 256 px, decoded at 224 px (holding the 3,000 decoded images would add 1.8
   GB). Target: the 3,000-image run within 1.1x of the 300-image run.
Run: `python -m benchmarks.bench_data` (or `make bench B=data`).
"""

import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from runner.data.files import IMAGENET_STATS, FileSplit, image_transforms
from runner.hardware import RunContext
from runner.train import EpochBatches, batches

SIDE, CLASSES, WORKERS, BATCH = 256, 10, 2, 64


def write_imagefolder(root: Path, n: int, seed: int = 0) -> None:
    """`n` JPEGs of SIDE px in root/{train,val}/<class>/ (val gets a tenth), smooth random content."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(n):
        split = "val" if i % 10 == 9 else "train"
        folder = root / split / f"class{(i // 10) % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        coarse = rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((SIDE, SIDE), Image.BILINEAR)
        image.save(folder / f"{i:05d}.jpg", quality=90)


def throughput(root: Path, passes: int = 3) -> tuple[float, float]:
    """Images/s of (runner, torchvision), best of `passes` passes over the training images each."""
    from torchvision.datasets import ImageFolder

    tf = image_transforms("rrc_flip", 224, *IMAGENET_STATS)
    reference = ImageFolder(str(root / "train"), transform=tf.train)
    paths = [str(Path(p).relative_to(root)) for p, _ in reference.samples]
    split = FileSplit(root, paths, [label for _, label in reference.samples], transforms=tf)
    ctx = RunContext(torch.device("cpu"), root, None, num_workers=WORKERS)
    sampler = EpochBatches(len(split), BATCH, seed=0)
    ours = batches(split, ctx, sampler, augment="rrc_flip")
    theirs = torch.utils.data.DataLoader(
        reference,
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        num_workers=WORKERS,
        persistent_workers=True,
    )

    def rate(loader, epoch) -> float:
        sampler.set_epoch(epoch)
        t0, seen = time.perf_counter(), 0
        for x, _ in loader:
            seen += len(x)
        return seen / (time.perf_counter() - t0)

    rate(ours, 0), rate(theirs, 0)  # warm the page cache and start the workers
    # Alternate the two, best pass of each, so that load from other processes hits both alike.
    rates = [(rate(ours, epoch), rate(theirs, epoch)) for epoch in range(1, passes + 1)]
    return max(r[0] for r in rates), max(r[1] for r in rates)


def peak_memory_mb(root: Path) -> float:
    """Peak RSS (MB) of a smoke run: the larger of the main process and its largest worker."""
    code = (
        "import resource, runpy, sys\n"
        "sys.argv = ['runner'] + sys.argv[1:]\n"
        "try:\n    runpy.run_module('runner.cli', run_name='__main__')\n"
        "finally:\n"
        "    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "    print('PEAK_KB', max(own, kids))\n"
    )
    args = [
        "dataset=imagefolder", f"dataset.root={root}", "dataset.image_size=224", "model=mlp",
        "model.hidden=[32]", "train.batch_size=32", "train.eval_batch_size=64",
        f"hardware.num_workers={WORKERS}", "logger=none", "+debug=smoke", f"hydra.run.dir={root}/run",
    ]  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=root)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    line = next(line for line in out.stdout.splitlines() if line.startswith("PEAK_KB"))
    return int(line.split()[1]) / 1024


def _target(description, measured, bound, at_least=True):
    ok = measured >= bound if at_least else measured <= bound
    need = f"{'>=' if at_least else '<='} {bound:g}x"
    print(f"  target {description}: measured {measured:.2f}x, need {need} -> {'OK' if ok else 'MISS'}")
    return ok


def main() -> bool:
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        small, large = Path(tmp, "n300"), Path(tmp, "n3000")
        t0 = time.perf_counter()
        write_imagefolder(small, 300)
        write_imagefolder(large, 3000)
        print(f"wrote 3,300 JPEGs of {SIDE} px in {time.perf_counter() - t0:.0f} s (self RSS now "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")  # fmt: skip

        ours, theirs = throughput(large)
        print(f"\ndecode + RandomResizedCrop 224 + flip, {WORKERS} workers, batch {BATCH}, 2,700 images:")
        print(f"  runner FileSplit      {ours:8.1f} images/s")
        print(f"  torchvision ImageFolder {theirs:6.1f} images/s")
        ok &= _target("runner / torchvision images/s", ours / theirs, 0.9)

        mb = {n: peak_memory_mb(root) for n, root in ((300, small), (3000, large))}
        print("\npeak RSS of `runner dataset=imagefolder +debug=smoke`:")
        for n, value in mb.items():
            print(f"  {n:5d} images  {value:8.1f} MB")
        ok &= _target("peak memory 3,000 / 300 images", mb[3000] / mb[300], 1.1, at_least=False)
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
