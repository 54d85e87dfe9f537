"""The GPU path, proven on the CPU: host-device synchronisations per training step, counted by
`runner.device_tracking` on every method family's paper preset shrunk to CPU size (generated data of the
preset's classes at a quarter of its image side, batches of 16 (32 for DB-OT and hashing); the preset's
network, method and precision), with the step captured where it can be (`hardware.cuda_graph`, as on a
GPU). What is counted is ops, not their sizes: the counts at the preset's own side (32 px, `make test-slow`)
are the same."""

import json

import pytest
import torch
from conftest import quick_first

from runner import cli, device_tracking
from runner.device_tracking import STAND_IN, DeviceTracker
from runner.step import GraphedStep

SHRUNK = ["logger=none", "dataset=fake", "dataset.like=cifar100", "dataset.train_size=128",
          "dataset.test_size=32", "hardware.num_workers=0", "train.batch_size=16",
          "train.epochs=1", "hardware.cuda_graph=true"]  # fmt: skip
# Small batches on a shared CPU: a second thread only waits for the first (2-5x the time under load).
ONE_THREAD = "hardware.threads=1"
SIDES = [8, pytest.param(32, marks=pytest.mark.slow)]  # the preset's own side: the same counts
MIXUP = "+experiment=comixup_cifar100_preactresnet18"
PRESETS = {
    "erm": [MIXUP, "+method=erm"],
    "input_mixup": [MIXUP, "+method=input_mixup"],
    "manifold_mixup": [MIXUP, "+method=manifold_mixup"],
    "cutmix": [MIXUP, "+method=cutmix"],
    "puzzle_mix": [MIXUP, "+method=puzzle_mix"],
    "comixup": [MIXUP, "+method=comixup"],
    # the warm-up epoch, then an epoch after CSOT's first selection (an allocation of several chunks)
    "csot": ["+experiment=csot_cifar100", "method.warmup=1", "train.epochs=2", "method.solve_batch=64"],
    # fake labels are the sample index mod 100: every test class needs 100 test samples
    "dbot": [
        "+experiment=dbot_cifar100_lt",
        "train.warmup_epochs=0",
        "dataset.imbalance=2",
        "dataset.train_size=600",
        "dataset.test_size=100",
        "train.batch_size=32",  # at 16 at this side, the logits outgrow what the Sinkhorn kernel can hold
        # the DB-OT rules' solves run all their sweeps on the device, each op a Python call under the tracker:
        # 200, past the sweep where this run's solves converge (the same metrics as at the preset's 1000)
        "method.max_iter=200",
    ],
    "hashing": [
        "+experiment=hier_hash_cifar100_triplet",
        "method.iters=8",
        "method.base_iters=8",
        "method.classes_per_batch=16",  # batches of 32
        "dataset.train_size=256",
        "method.ks=[1]",
        "method.margin=[0.5]",
        "method.npairs_l2=[0.03]",
        "method.baselines=[th]",
        "method.input_norm=dataset",
    ],
}
PAIR_MIXUPS = ("input_mixup", "manifold_mixup", "cutmix")  # one family: draws before the step, one pass
SYNCS_PER_STEP = 2  # the deferred non-finite check (every 16 steps) and a method's one inherent read
# Every wait of DB-OT's run, all included: the model moved to the device (one copy it does not wait for),
# training (the epoch's deferred checks, its loss and lr in one read), the kept best weights and the
# checkpoint, the evaluations, the test predictions, and the DB-OT rules' solves on the device (every
# solve of every resampled test set read in one copy: test_dbot_evaluation_reads_the_device_once).
RUN_SYNCS_PER_STEP = 2

# The eager device ops of a steady training step (`eager_ops_per_step`), argued from what must run outside a
# captured region: the batch and the loss pass it in one micro-batch. The step replayed from its graph
# copies its inputs into the static buffers (the batch and its indices, and each drawn tensor) and the
# loss out (1). A method with a `draw` hook also runs, per micro-batch, x.chunk and idx.chunk (2 views),
# the targets (`_targets`: index, one_hot, float: 3) and one host -> device copy per drawn tensor.
REPLAY = 2 + 1


def _with_draws(drawn: int) -> int:
    return REPLAY + 2 + 3 + 2 * drawn  # each drawn tensor: made on the device, then copied to its buffer


EAGER_OPS_PER_STEP = {
    "erm": REPLAY,
    "dbot": REPLAY,  # no host draws
    "input_mixup": _with_draws(2),  # lambda, partners
    "cutmix": _with_draws(4),  # lambda, partners, the box, x's share
    "manifold_mixup": _with_draws(3),  # lambda, partners, the mixing site
    "csot": _with_draws(0),  # a draw hook that draws nothing at this stage
}
# Co-Mixup, Puzzle Mix and hashing read the host inside the step: the read and the copies around it.
SPLIT_STEP_OPS = 40
EPOCH_START_SYNCS = 100  # CSOT's allocation: the chunks solved as one batched problem


def _track(tmp_path, overrides) -> dict:
    """`python -m runner.device_tracking` in this process (as `make bench-gpu` runs its rows): no imports
    per run; this process's thread count is kept."""
    out, threads = tmp_path / "counts.json", torch.get_num_threads()
    try:
        device_tracking.main([*SHRUNK, ONE_THREAD, *overrides, f"hydra.run.dir={tmp_path / 'run'}", "--json",
                              str(out)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return json.loads(out.read_text())


# Regions a training step enters: one, or two for a step split around its host read; the hashing preset's base
# net trains first (one region), then as many steps of the hash net (two).
REGIONS_PER_STEP = {"comixup": 2, "puzzle_mix": 2, "hashing": 1.5}
# The captures of a run, each warmed up `GraphedStep.WARMUP` steps: one (one batch shape, one key); one per
# net of the hashing preset. Puzzle Mix's grid is drawn per batch, and CSOT's second epoch (its selected
# samples: 1 step here) is warm-up alone: their warm-up steps are not a whole number of captures.
CAPTURES = {"hashing": 2, "puzzle_mix": None, "csot": None}


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", quick_first(PRESETS, lambda name: "pair" if name in PAIR_MIXUPS else name))
def test_training_step_is_captured_waits_at_most_twice_and_leaves_little_eager_work(tmp_path, name, side):
    # Puzzle Mix warms up each grid it draws: of the 4 dividing 32 px, 13 steps capture one at least
    steps = ["dataset.train_size=224"] if name == "puzzle_mix" and side == 32 else []
    report = _track(tmp_path, [f"dataset.image_size={side}", *PRESETS[name], *steps])
    sites = "\n".join(report["sites"][:15])
    assert report["steps"] >= 8, report
    if CAPTURES.get(name, 1) is not None:
        assert report["warm_up_steps"] == CAPTURES.get(name, 1) * GraphedStep.WARMUP, report
    assert_captured_whole(report, REGIONS_PER_STEP.get(name, 1))
    assert report["syncs_per_step"] <= SYNCS_PER_STEP, sites
    counts = report["counts"]
    for phase, kinds in counts.items():  # each would be an error on CUDA
        assert kinds.get("mix", 0) == 0 and kinds.get("numpy", 0) == 0, (phase, sites)
    epochs = 2 if name == "csot" else 1
    assert counts.get("epoch_start", {}).get("sync", 0) <= EPOCH_START_SYNCS * epochs, sites
    # evaluation: per split, the labels copied to the device and the sums read once (not per batch)
    assert counts.get("eval", {}).get("sync", 0) <= 2 * 3 * epochs + 2, sites
    if name == "dbot":  # tests its best epoch: the kept weights, restored, and the last epoch's evaluated
        run = sum(kinds.get("sync", 0) for kinds in counts.values())
        assert run <= RUN_SYNCS_PER_STEP * report["steps"], sites
    budget = EAGER_OPS_PER_STEP.get(name, SPLIT_STEP_OPS)
    assert report["eager_ops_per_step"] <= budget, "\n".join(report["eager_sites"][:20])


def assert_captured_whole(report: dict, regions_per_step: float = 1) -> None:
    """Every training step of a tracked run is in the captured region but the warm-up ones of each capture
    (eager on CUDA too, where lazy state is made; a key that changes is warmed up anew), and that region
    reads nothing from the host and makes no host tensor. A split step enters two regions: the part before
    its host read, and the rest."""
    captured = report["steps"] - report["warm_up_steps"]
    assert report["entered"].get(device_tracking.CAPTURED, 0) == regions_per_step * captured > 0, report
    assert report["counts"].get(device_tracking.CAPTURED, {}) == {}, report["sites"]


def _in_phase(tracker, monkeypatch, module, names, phase):
    """`module.NAME` for each of `names` counted in `phase` while the test runs."""

    def counted(fn):
        def wrapped(*args, **kwargs):
            with tracker.in_phase(phase):
                return fn(*args, **kwargs)

        return wrapped

    for name in names:
        monkeypatch.setattr(module, name, counted(getattr(module, name)))


@pytest.mark.parametrize("preset", ["dbot", "dbot_cluster"])
def test_dbot_evaluation_reads_the_device_once_per_tested_model(tmp_path, monkeypatch, preset):
    """DB-OT's evaluation after training. Long-tailed classification: the test logits and features are
    predicted in one pass and copied to the host together, then on each of the 3 resampled test sets the two
    DB-OT rules solve on the device, their checks kept there: every solve's input checks, convergence tests
    and labels come back in one read. Clustering: the one split's inputs decoded and copied to the host, the
    solver on the host."""
    import runner.tasks.clustering
    import runner.tasks.longtail

    blobs = ["logger=none", "hardware.num_workers=0", "+experiment=dbot_cluster_blobs", "method.plot=false"]
    overrides = [*SHRUNK, f"dataset.image_size={SIDES[0]}", *PRESETS["dbot"]] if preset == "dbot" else blobs
    with device_tracking.tracking() as tracker:
        _in_phase(tracker, monkeypatch, runner.tasks.longtail, ("predict_all", "evaluate_rules"), "dbot_eval")
        _in_phase(tracker, monkeypatch, runner.tasks.clustering, ("_samples", "dbot_cluster"), "dbot_eval")
        cli.run_in_process([*overrides, f"hydra.run.dir={tmp_path / 'run'}"])
    report = tracker.report()
    evaluation, sites = report["counts"].get("dbot_eval", {}), "\n".join(report["sites"][:15])
    assert evaluation.get("mix", 0) == 0 and evaluation.get("numpy", 0) == 0, sites
    # the CIFAR-LT preset tests its best epoch, so the last epoch's weights are evaluated too (<key>_last):
    # per model, the copy of its logits and features and the one read of its DB-OT rules' solves; the blobs:
    # their one split's copy to the device and its decoded samples' back
    reads = 2 * 2 if preset == "dbot" else 2
    assert 0 < evaluation.get("sync", 0) <= reads, sites
    if preset == "dbot":  # the DB-OT rules did solve on the device
        assert any(site.endswith(" read_pending") for site in report["sites"]), sites


def test_the_tracker_counts_what_would_wait_and_what_would_fail():
    with DeviceTracker() as tracker, tracker.in_phase("train"):
        host = torch.arange(6.0)
        x = host.to(STAND_IN, non_blocking=True)  # free (pinned on CUDA)
        y = torch.ones(6, device=x.device)  # made on the device: x.device names it
        z = (x * y).sum()
        float(z)  # 1: a read
        x[x > 2]  # 2: a boolean mask
        host.to(STAND_IN)  # 3: a blocking copy
        x.cpu()  # 4: to the host
        x + host  # a mix: fails on CUDA
        x.numpy()  # fails on CUDA
        (host * 2).sum().item()  # host only: free
    counts = tracker.counts["train"]
    assert counts == {"sync": 4, "mix": 1, "numpy": 1}, tracker.report()["sites"]


def test_tensors_from_numpy_are_host_tensors():
    import numpy as np

    from runner.device_tracking import tracking

    with tracking() as tracker, tracker.in_phase("train"):
        x = torch.ones(3, device=STAND_IN)
        x + torch.from_numpy(np.ones(3, dtype=np.float32))
    assert tracker.counts["train"] == {"mix": 1}
