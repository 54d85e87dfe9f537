"""`make bench-gpu`: the paper presets' training steps on CUDA, on generated data (`dataset=fake`).

For vanilla ERM and each method family's paper preset, with the paper's model and batch size: ms per
training step and images/s (the second epoch of `STEPS` steps; the first is warm-up), peak GPU memory, the
share of step time spent in the method's batch transform (Co-Mixup's saliency + partition solves) or
per-epoch pass (CSOT's allocation), and the ratio to vanilla at the same scale, measured in this run.
Then fp32 against bf16, and eager against torch.compile, for vanilla and Co-Mixup at CIFAR scale.
Without CUDA it prints one line and exits 0. Run: `make bench-gpu` (or `python -m benchmarks.bench_gpu`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

STEPS = 200
# name -> (overrides, fake shape, batch, the vanilla row it is compared with)
ROWS = {
    "vanilla imagenet": (["model=resnet50", "train.batch_size=100"], "imagenet", 100, None),
    "comixup imagenet": (["+experiment=comixup_imagenet"], "imagenet", 100, "vanilla imagenet"),
    "vanilla tiny": (["model=preactresnet18", "model.stem_stride=2", "train.batch_size=100"], "tiny_imagenet",
                     100, None),
    "comixup tiny": (["+experiment=comixup_tiny_imagenet"], "tiny_imagenet", 100, "vanilla tiny"),
    "vanilla cifar100": (["model=preactresnet18", "train.batch_size=100"], "cifar100", 100, None),
    "comixup cifar100": (["+experiment=comixup_cifar100_preactresnet18"], "cifar100", 100,
                         "vanilla cifar100"),
    "csot cifar100": (["+experiment=csot_cifar100", "method.warmup=0"], "cifar100", 128, "vanilla cifar100"),
    "dbot cifar100": (["+experiment=dbot_cifar100_lt"], "cifar100", 128, "vanilla cifar100"),
    "hash cifar100": (["+experiment=hier_hash_cifar100_triplet"], "cifar100", 128, "vanilla cifar100"),
}  # fmt: skip
TARGETS = {  # row: (largest ratio to its vanilla row, what is compared)
    "comixup imagenet": (2.2, "step"),
    "comixup tiny": (2.2, "step"),
    "dbot cifar100": (1.2, "step"),
    "hash cifar100": (1.2, "step"),
}
VARIANTS = {"bf16": ["hardware.precision=bf16"], "compile": ["hardware.compile=true"]}


def run_row(overrides: list[str], like: str, batch: int, tmp: Path) -> dict:
    """The second epoch's metrics record of a 2-epoch run of `STEPS` steps on fake data."""
    out = tmp / f"run{len(list(tmp.iterdir()))}"
    args = [
        *overrides, "hardware=gpu", "dataset=fake", f"dataset.like={like}",
        f"dataset.train_size={STEPS * batch}", f"dataset.test_size={batch}", "train.epochs=2",
        "train.checkpoint=false", "train.progress=false", "logger=none", f"hydra.run.dir={out}",
    ]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "runner.cli", *args], capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])


def describe(name: str, m: dict, batch: int, vanilla: dict | None) -> str:
    if "error" in m:
        return f"  {name:<18} error: {m['error']}"
    step = m["time/step_ms"]
    method_share = max(m.get("time/transform_s", 0.0), m.get("time/pass_s", 0.0)) / m["time/epoch_s"]
    ratio = f"{step / vanilla['time/step_ms']:6.2f}x" if vanilla and "error" not in vanilla else "     -"
    return (f"  {name:<18} {step:9.1f} {1000 * batch / step:9.0f} {m.get('mem/peak_gb', 0):8.1f} "
            f"{100 * method_share:7.1f}% {ratio}")  # fmt: skip


def main() -> bool | None:
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; nothing measured (run it on a GPU machine)")
        return None
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {STEPS} steps per epoch, fake data")
    print(f"  {'row':<18} {'ms/step':>9} {'images/s':>9} {'peak GB':>8} {'method':>8} {'vs vanilla':>7}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        results = {}
        for name, (overrides, like, batch, base) in ROWS.items():
            results[name] = run_row(overrides, like, batch, tmp)
            print(describe(name, results[name], batch, results.get(base)), flush=True)
        for name, (bound, _) in TARGETS.items():
            m, v = results[name], results[ROWS[name][3]]
            if "error" in m or "error" in v:
                print(f"  target {name} <= {bound}x vanilla: not measured -> MISS")
                ok = False
                continue
            ratio = m["time/step_ms"] / v["time/step_ms"]
            print(f"  target {name} step <= {bound}x vanilla: measured {ratio:.2f}x -> "
                  f"{'OK' if ratio <= bound else 'MISS'}")  # fmt: skip
            ok &= ratio <= bound
        csot = results["csot cifar100"]
        if "error" not in csot:
            share = csot["time/pass_s"] / csot["time/epoch_s"]
            print(f"  target csot allocation <= 10% of its epoch: measured {100 * share:.1f}% -> "
                  f"{'OK' if share <= 0.1 else 'MISS'}")  # fmt: skip
            ok &= share <= 0.1
        cifar = results["comixup cifar100"]
        if "error" not in cifar:
            share = cifar["time/transform_s"] / cifar["time/train_s"]
            ratio = cifar["time/step_ms"] / results["vanilla cifar100"]["time/step_ms"]
            print(f"  record comixup cifar100: {ratio:.2f}x vanilla, mixing {100 * share:.0f}% of step time")

        print("\nprecision and compile (ms/step; speed-up over fp32 eager)")
        for name in ("vanilla cifar100", "comixup cifar100", "vanilla imagenet"):
            overrides, like, batch, _ = ROWS[name]
            base = results[name]
            for variant, extra in VARIANTS.items():
                m = run_row([*overrides, *extra], like, batch, tmp)
                if "error" in m or "error" in base:
                    print(f"  {name:<18} {variant:<8} error: {m.get('error', base.get('error'))}")
                    continue
                speedup = base["time/step_ms"] / m["time/step_ms"]
                print(f"  {name:<18} {variant:<8} {m['time/step_ms']:9.1f} ms  {speedup:5.2f}x", flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
