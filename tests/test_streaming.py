"""The one data path: epoch batches and their shards, file-backed splits through DataLoader workers,
uint8 splits, the smoke bound, warm-up, and the per-run metrics (ECE, best/last/median)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

from runner.batches import EpochBatches, batches, in_order
from runner.data import Data, Split, split_of
from runner.data.files import FileSplit, image_transforms
from runner.evaluation import predict
from runner.hardware import RunContext
from runner.method_hooks import MethodHooks
from runner.metrics import calibration_bins, expected_calibration_error, history_summary
from runner.schema import TrainConfig
from runner.train import fit

CPU = torch.device("cpu")


def write_images(root: Path, n: int, side: int = 12) -> tuple[list[str], np.ndarray]:
    """`n` PNGs whose pixel values encode their index (lossless, so decoded values are checkable)."""
    paths, labels = [], np.arange(n) % 3
    for i in range(n):
        path = Path(f"c{labels[i]}/{i}.png")
        (root / path.parent).mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((side, side, 3), i, dtype=np.uint8)).save(root / path)
        paths.append(str(path))
    return paths, labels


def test_epoch_batches_shard_disjointly_and_resume_mid_epoch():
    n, batch, world = 103, 20, 2
    ranks = [EpochBatches(n, batch, rank, world, seed=7) for rank in range(world)]
    for epoch in range(2):
        for r in ranks:
            r.set_epoch(epoch)
        shards = [list(r) for r in ranks]
        assert [len(s) for s in shards] == [n // batch] * world
        one = EpochBatches(n, batch, seed=7)
        one.set_epoch(epoch)
        for step, whole in enumerate(one):  # the ranks' shards of a step are that step's global batch
            parts = [s[step] for s in shards]
            assert set(parts[0].tolist()).isdisjoint(parts[1].tolist())
            assert sorted(torch.cat(parts).tolist()) == sorted(whole.tolist())
    first = list(ranks[0])
    ranks[0].set_epoch(1, start=3)
    assert [b.tolist() for b in ranks[0]] == [b.tolist() for b in first[3:]]
    ranks[0].set_epoch(0)
    assert [b.tolist() for b in ranks[0]] != [b.tolist() for b in first]  # a new order per epoch


@pytest.mark.parametrize("workers", [0, 2])
def test_file_split_yields_its_indices_decoded_in_order(tmp_path, workers):
    paths, labels = write_images(tmp_path, 10)
    split = FileSplit(tmp_path, paths, labels, transforms=image_transforms("none", 12, (0, 0, 0), (1, 1, 1)))
    ctx = RunContext(CPU, tmp_path, None, num_workers=workers)
    seen = []
    for x, idx in batches(split, ctx, in_order(len(split), 4)):
        assert x.shape[1:] == (3, 12, 12) and x.dtype == torch.float32
        # pixel value i / 255 identifies image i: the index travels with its image
        torch.testing.assert_close(x[:, 0, 0, 0] * 255, idx.float(), atol=1e-3, rtol=0)
        seen += idx.tolist()
    assert seen == list(range(10))
    sub = split.subset([7, 2])
    assert sub.paths == [paths[7], paths[2]] and sub.y.tolist() == [labels[7], labels[2]]


def test_predict_reads_file_and_memory_splits_alike(tmp_path):
    paths, labels = write_images(tmp_path, 9)
    files = FileSplit(tmp_path, paths, labels, transforms=image_transforms("none", 12, (0, 0, 0), (1, 1, 1)))
    pixels = torch.stack([torch.full((3, 12, 12), i / 255.0) for i in range(9)])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 144, 4))
    ctx = RunContext(CPU, tmp_path, None)
    torch.testing.assert_close(
        predict(model, files, ctx, 4), predict(model, split_of(pixels, labels), ctx, 4)
    )


def test_uint8_split_decodes_per_batch():
    x = torch.randint(0, 256, (6, 3, 4, 4), dtype=torch.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.5)
    split = Split(x, torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=torch.long), mean, std)
    out = torch.cat([b for b, _ in batches(split, RunContext(CPU, Path("."), None), in_order(6, 4))])
    expected = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    torch.testing.assert_close(out, expected)
    assert split.x.dtype == torch.uint8 and split.subset([1]).mean == mean


def test_ece_and_history_against_hand_values():
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.45, 0.55]])
    labels = torch.tensor([0, 1, 1, 1])
    # 15 bins: confidences 0.9 (bin 13), 0.8 (bin 12), 0.7 (bin 10), 0.55 (bin 8), correctness 1, 0, 1, 1
    # ECE = (|1-0.9| + |0-0.8| + |1-0.7| + |1-0.55|) / 4 = 1.65 / 4
    assert expected_calibration_error(calibration_bins(probs, labels)) == pytest.approx(1.65 / 4)
    halves = calibration_bins(probs[:2], labels[:2]) + calibration_bins(probs[2:], labels[2:])
    assert expected_calibration_error(halves) == pytest.approx(1.65 / 4)  # shards add up
    accs = [0.1 * i for i in range(1, 13)] + [0.5]
    assert history_summary(accs) == {
        "test/acc_best": pytest.approx(1.2),
        "test/acc_last": 0.5,
        "test/acc_median10": pytest.approx(np.median(accs[-10:])),
    }


def test_warmup_is_linear_per_step_then_the_schedule_continues(tmp_path, monkeypatch):
    import runner.step as step

    rng = np.random.default_rng(0)
    split = split_of(rng.normal(size=(40, 3)).astype(np.float32), rng.integers(0, 2, 40))
    data = Data(split, split.subset([]), split.subset([]), 2, (3,))
    optimizers, lrs = [], []
    make = step.make_optimizer
    monkeypatch.setattr(
        step, "make_optimizer", lambda m, cfg, **kw: optimizers.append(make(m, cfg, **kw)) or optimizers[0]
    )

    class RecordLR(MethodHooks):  # the loss hook runs once per step: read the lr the step uses
        def loss(self, net, x, y_soft, idx, epoch):
            lrs.append(optimizers[0].param_groups[0]["lr"])
            return torch.nn.functional.cross_entropy(net(x), y_soft.argmax(1))

    cfg = OmegaConf.structured(
        TrainConfig(epochs=4, batch_size=10, lr=0.4, schedule="step", milestones=[3], warmup_epochs=2,
                    checkpoint=False, progress=False)
    )  # fmt: skip
    tracker = type("Tracker", (), {"log": lambda *a, **k: None, "truncate": lambda *a: None})()
    fit(torch.nn.Linear(3, 2), data, cfg, RunContext(CPU, tmp_path, tracker), RecordLR())
    # 4 steps per epoch, 8 warm-up steps: lr * (s + 1) / 9, then 0.4 in epoch 3 and 0.04 after milestone 3
    expected = [0.4 * (s + 1) / 9 for s in range(8)] + [0.4] * 4 + [0.04] * 4
    assert lrs == pytest.approx(expected)


@pytest.mark.slow
def test_smoke_bounds_any_order_and_writes_summary(cli, tmp_path):
    from runner.compose import compose

    a = compose(["+debug=smoke", "+experiment=csot_digits", "+method=csot"])
    b = compose(["+method=csot", "+experiment=csot_digits", "+debug=smoke"])
    assert a.debug == b.debug
    cli("logger=none", "train.batch_size=32", "+debug=smoke", "hydra.run.dir=smoke")
    summary = json.loads((tmp_path / "smoke" / "summary.json").read_text())
    saved = OmegaConf.load(tmp_path / "smoke" / "config.yaml")
    assert saved.train.epochs == 1 and saved.dataset.max_train == 64
    assert saved.dataset.max_eval == 2 * saved.train.eval_batch_size  # 64 on the CPU, 1024 elsewhere
    records = (tmp_path / "smoke" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 1 and "test/acc" in summary


DISJOINT = """
import json, os, sys, torch, torch.distributed as dist
from pathlib import Path
from runner.data.files import FileSplit, image_transforms
from runner.hardware import RunContext
from runner.batches import EpochBatches, batches
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
root = Path(sys.argv[1])
paths = sorted(str(p.relative_to(root)) for p in root.rglob("*.png"))
tf = image_transforms("none", 12, (0, 0, 0), (1, 1, 1))
split = FileSplit(root, paths, [0] * len(paths), transforms=tf)
sampler = EpochBatches(len(split), 8, rank, world, seed=3)
seen = []
ctx = RunContext(torch.device("cpu"), root, None, rank=rank, world_size=world, num_workers=2)
loader = batches(split, ctx, sampler)  # one loader, re-iterated: its persistent workers see each new epoch
for epoch in range(2):
    sampler.set_epoch(epoch)
    for x, idx in loader:
        assert torch.allclose(x[:, 0, 0, 0] * 255, torch.tensor([float(Path(paths[i]).stem) for i in idx]))
        seen.append([epoch] + idx.tolist())
Path(root, f"rank{rank}.json").write_text(json.dumps(seen))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ddp_ranks_read_disjoint_shards_of_files(tmp_path):
    write_images(tmp_path / "img", 37)
    script = tmp_path / "disjoint.py"
    script.write_text(DISJOINT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.run([*cmd, str(tmp_path / "img")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / "img" / f"rank{r}.json").read_text()) for r in range(2)]
    for epoch in range(2):
        per_rank = [sum((b[1:] for b in s if b[0] == epoch), []) for s in seen]
        assert len(per_rank[0]) == len(per_rank[1]) == (37 // 8) * 4
        assert set(per_rank[0]).isdisjoint(per_rank[1])
        assert len(set(per_rank[0]) | set(per_rank[1])) == (37 // 8) * 8


def test_fit_reports_the_time_split_of_an_epoch(tmp_path):
    # bench_gpu reads these: ms per step, the method's pass and its batch transforms
    rng = np.random.default_rng(0)
    split = split_of(rng.normal(size=(40, 3)).astype(np.float32), rng.integers(0, 2, 40))
    data = Data(split, split.subset([]), split.subset([]), 2, (3,))

    class Slow(MethodHooks):
        def on_epoch_start(self, epoch, model, data):
            time.sleep(0.05)

        def transform(self, x, y_soft, idx, model):
            time.sleep(0.01)
            return x, y_soft

    cfg = OmegaConf.structured(TrainConfig(epochs=1, batch_size=10, checkpoint=False, progress=False))
    tracker = type("Tracker", (), {"log": lambda *a, **k: None, "truncate": lambda *a: None})()
    m = fit(torch.nn.Linear(3, 2), data, cfg, RunContext(CPU, tmp_path, tracker), Slow())
    assert m["time/pass_s"] >= 0.05 and m["time/transform_s"] >= 0.04
    assert m["time/train_s"] >= m["time/transform_s"]
    assert m["time/step_ms"] == pytest.approx(1000 * m["time/train_s"] / 4)
