"""File-backed data path: decoding throughput against torchvision, and memory that does not grow with N.

1. Throughput: 500x375 photo-like JPEGs (ImageNet's typical size, ~100 KB) in an imagefolder layout,
   decoded and augmented (RandomResizedCrop 224 + flip, ImageNet normalisation) by 2 DataLoader workers in
   batches of 64. The runner's `FileSplit` through `runner.batches.batches` (libjpeg-turbo decode and uint8
   transforms in the workers, the float conversion and normalisation by `decode` in the timed loop, on the
   CPU here) against the papers' pipeline: torchvision's `ImageFolder` (PIL) + `DataLoader` with
   `transforms.RandomResizedCrop`, flip, float32 `ToTensor` and `Normalize` in the workers. The timed loop
   reads each batch once, as training would. Target: >= 1.5x torchvision's images/s (best of 5 passes
   each, alternated; images per CPU second of the main process and workers shown too, the comparison that
   other load on a shared machine distorts least).
2. Memory: peak resident memory (the run and its workers) of `runner dataset=imagefolder +debug=smoke` on
   300 and on 3,000 of those images, decoded at 224 px (holding the 3,000 decoded images would add 1.8
   GB). Target: the 3,000-image run within 1.1x of the 300-image run.
Run: `python -m benchmarks.bench_data` (or `make bench B=data`).
"""

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from runner.batches import EpochBatches, batches
from runner.data.files import IMAGENET_STATS, FileSplit, image_transforms
from runner.hardware import RunContext

WIDTH, HEIGHT, CLASSES, WORKERS, BATCH = 500, 375, 10, 2, 64


def write_imagefolder(root: Path, n: int, seed: int = 0) -> float:
    """`n` JPEGs of WIDTH x HEIGHT px in root/{train,val}/<class>/ (val gets a tenth); returns their mean
    size in KB. Content at three scales (shapes, texture, grain), so that files are as large as photos':
    the entropy decoding that makes up much of a JPEG's decode time grows with the file."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    size = (WIDTH, HEIGHT)
    total = 0
    for i in range(n):
        split = "val" if i % 10 == 9 else "train"
        folder = root / split / f"class{(i // 10) % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        shapes = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(size, Image.BICUBIC)
        texture = Image.fromarray(rng.integers(0, 256, (94, 125), dtype=np.uint8)).resize(size, Image.BICUBIC)
        grain = rng.normal(0, 15, (HEIGHT, WIDTH, 1))
        pixels = 0.6 * np.asarray(shapes) + 0.4 * np.asarray(texture)[..., None] + grain
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
        total += path.stat().st_size
    return total / n / 1024


def cpu_seconds() -> float:
    """CPU time so far of this process and its live children (the loaders' persistent workers, read from
    /proc): a pass's cost, which other processes on a shared machine hardly change."""
    own, me, total = os.times(), str(os.getpid()), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, ..., utime (11), stime (12)
        except OSError:  # a process that just ended
            continue
        if fields[1] == me:
            total += int(fields[11]) + int(fields[12])
    return own.user + own.system + total / os.sysconf("SC_CLK_TCK")


def throughput(root: Path, passes: int = 5) -> dict[str, tuple[float, float]]:
    """(images/s, images per CPU second) of the runner and of torchvision, the best of `passes` passes over
    the training images each."""
    from torchvision import transforms as T
    from torchvision.datasets import ImageFolder

    papers = T.Compose(
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(*IMAGENET_STATS)]
    )
    reference = ImageFolder(str(root / "train"), transform=papers)
    paths = [str(Path(p).relative_to(root)) for p, _ in reference.samples]
    tf = image_transforms("rrc_flip", 224, *IMAGENET_STATS)
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

    def rate(loader, epoch) -> tuple[float, float]:
        sampler.set_epoch(epoch)
        t0, cpu0, seen = time.perf_counter(), cpu_seconds(), 0
        for x, _ in loader:  # ours: float network input, decoded by `split.decode` in this loop
            # Read every pixel, as a training step does: torchvision's batch is not in this process's memory
            # until then (its workers' shared memory, mapped page by page on first touch).
            x.sum()
            seen += len(x)
        return seen / (time.perf_counter() - t0), seen / (cpu_seconds() - cpu0)

    # The workers keep the cores busy: intra-op threads of this loop (`decode`) would only contend with them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rate(ours, 0), rate(theirs, 0)  # warm the page cache and start the workers
    # Alternate the two, best pass of each, so that load from other processes hits both alike.
    rates = [(rate(ours, epoch), rate(theirs, epoch)) for epoch in range(1, passes + 1)]
    torch.set_num_threads(threads)
    best = [tuple(map(max, zip(*(r[i] for r in rates)))) for i in (0, 1)]
    return {"runner": best[0], "torchvision": best[1]}


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
        kb = write_imagefolder(large, 3000)
        print(f"wrote 3,300 JPEGs of {WIDTH}x{HEIGHT} px, {kb:.0f} KB on average, in "
              f"{time.perf_counter() - t0:.0f} s (self RSS now "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")  # fmt: skip

        rates = throughput(large)
        print(f"\ndecode + RandomResizedCrop 224 + flip + normalise, {WORKERS} workers, batch {BATCH}, "
              "2,700 images, best of 5 passes:")  # fmt: skip
        print(f"  {'':58s} {'images/s':>9s} {'per CPU s':>10s}")
        for name, (per_s, per_cpu_s) in (
            ("runner FileSplit (decode_image, uint8; float on the device)", rates["runner"]),
            ("torchvision ImageFolder (PIL, float32 ToTensor + Normalize)", rates["torchvision"]),
        ):
            print(f"  {name:58s} {per_s:9.1f} {per_cpu_s:10.1f}")
        (ours, ours_cpu), (theirs, theirs_cpu) = rates["runner"], rates["torchvision"]
        print(f"  (images per CPU second, main process and workers: {ours_cpu / theirs_cpu:.2f}x)")
        ok &= _target("runner / torchvision images/s", ours / theirs, 1.5)

        mb = {n: peak_memory_mb(root) for n, root in ((300, small), (3000, large))}
        print("\npeak RSS of `runner dataset=imagefolder +debug=smoke`:")
        for n, value in mb.items():
            print(f"  {n:5d} images  {value:8.1f} MB")
        ok &= _target("peak memory 3,000 / 300 images", mb[3000] / mb[300], 1.1, at_least=False)
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
