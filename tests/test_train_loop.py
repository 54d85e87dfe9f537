"""What a paper-scale loop needs: gradient accumulation, clipping, an EMA of the weights, evaluation every
N epochs, the best / top-k checkpoints and early stopping, each surviving a resume."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import quick_first
from test_train import KillAt, blobs, setup

import runner.evaluate_run
import runner.evaluation
import runner.train
from runner.checkpoint import CHECKPOINT
from runner.checks import ConfigError
from runner.method_hooks import MethodHooks
from runner.models import build_model
from runner.train import fit


def run(tmp_path, *overrides, hooks=None, data=None, seed=0):
    model_cfg, train_cfg, ctx = setup(tmp_path, *overrides)
    torch.manual_seed(seed)
    model = build_model(model_cfg, (4,), 3)
    return model, fit(model, data or blobs(), train_cfg, ctx, hooks)


def rows(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_accumulating_micro_batches_takes_the_same_steps(tmp_path):
    # The MLP has no batch norm: K micro-batches of B/K give the batch's mean gradient, up to float32
    # summation order (~1e-7 relative per step, a few dozen steps).
    one, m1 = run(tmp_path / "k1", "train.epochs=3", "train.batch_size=20")
    two, m2 = run(tmp_path / "k2", "train.epochs=3", "train.batch_size=20", "train.accumulate=2")
    for a, b in zip(rows(tmp_path / "k1"), rows(tmp_path / "k2")):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-4)
    for p, q in zip(one.parameters(), two.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


class WholeBatch(MethodHooks):
    def loss(self, model, x, y_soft, idx, epoch):
        return (model(x).log_softmax(1) * -y_soft).sum(1).mean()


def test_accumulation_is_refused_where_a_method_needs_the_whole_batch(tmp_path):
    with pytest.raises(ConfigError, match=r"train.accumulate=2: this method needs each whole batch"):
        run(tmp_path, "train.accumulate=2", "train.batch_size=20", hooks=WholeBatch())
    with pytest.raises(ConfigError, match=r"train.batch_size=20: must split evenly .* train.accumulate=3"):
        run(tmp_path, "train.accumulate=3", "train.batch_size=20")


def test_hooks_that_do_not_subclass_method_hooks_are_refused(tmp_path):
    class Duck:  # a loss alone: the loop would read the hooks it lacks
        def loss(self, model, x, y_soft, idx, epoch):
            return model(x).sum()

    with pytest.raises(TypeError, match="runner.method_hooks.MethodHooks; Duck does not"):
        run(tmp_path, hooks=Duck())


def test_clipping_bounds_the_step_and_logs_the_norm_before_it(tmp_path):
    model, _ = run(tmp_path / "free", "train.epochs=1", "train.lr=1", "train.momentum=0")
    clipped, _ = run(tmp_path / "clip", "train.epochs=1", "train.lr=1", "train.momentum=0",
                     "train.clip_grad_norm=0.01", "train.weight_decay=0")  # fmt: skip
    norm = rows(tmp_path / "clip")[0]["train/grad_norm"]
    assert norm > 0.01  # the pre-clip norm: the clip was active
    torch.manual_seed(0)
    start = build_model(setup(tmp_path / "x")[0], (4,), 3)
    moved = torch.cat([(p - q).flatten() for p, q in zip(clipped.parameters(), start.parameters())]).norm()
    steps = 100 // 64
    assert moved <= 0.01 * steps * (1 + 1e-5)  # each step moves the weights by lr x at most 0.01
    assert "train/grad_norm" not in rows(tmp_path / "free")[0]


def test_ema_is_evaluated_beside_the_weights_and_resumes_exactly(tmp_path):
    _, straight = run(tmp_path / "a", "train.epochs=4", "train.ema=0.9")
    assert {"test/acc_ema", "val/acc_ema", "test/loss_ema"} <= set(straight)
    assert straight["test/loss_ema"] != straight["test/loss"]
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", "train.epochs=4", "train.ema=0.9", hooks=KillAt(2))
    _, resumed = run(tmp_path / "b", "train.epochs=4", "train.ema=0.9", seed=1)
    assert resumed["test/loss_ema"] == straight["test/loss_ema"]
    assert "ema" in torch.load(tmp_path / "b" / CHECKPOINT, weights_only=False)


def test_eval_every_skips_evaluations_but_not_the_last(tmp_path):
    run(tmp_path, "train.epochs=5", "train.eval_every=2")
    assert ["val/acc" in row for row in rows(tmp_path)] == [False, True, False, True, True]


class Scripted(MethodHooks):
    """val/acc as scripted per epoch (the evaluation replaced), so the monitor's choices are known."""

    def __init__(self, values):
        self.values, self.epoch = values, 0

    def evaluate(self, model):
        self.epoch += 1
        return {"val/acc": self.values[self.epoch - 1], "test/acc": 0.0}


def test_top_k_checkpoints_and_early_stop_follow_the_validation_metric(tmp_path, caplog):
    values = [0.5, 0.7, 0.6, 0.65, 0.64, 0.9, 0.95]
    with caplog.at_level("INFO", logger="runner.checkpoint"):
        _, metrics = run(tmp_path, "train.epochs=7", "train.save_top_k=2", "train.early_stop=3",
                         hooks=Scripted(values))  # fmt: skip
    folder = tmp_path / "checkpoints"
    # epochs 3, 4, 5 do not beat 0.7: stopped after epoch 5, epochs 6 and 7 never run
    assert len(rows(tmp_path)) == 5 and metrics["best_epoch"] == 2 and metrics["best/val/acc"] == 0.7
    assert sorted(p.name for p in folder.glob("best-*")) == ["best-2-0.7000.pt", "best-4-0.6500.pt"]
    assert (folder / "best.pt").resolve().name == "best-2-0.7000.pt"
    assert torch.load(folder / "best.pt", weights_only=False)["epoch"] == 1  # epoch 2's checkpoint
    assert "early stop: val/acc has not improved for 3 evaluations; the best, 0.7000, was at epoch 2" in (
        caplog.text
    )


def test_top_k_and_early_stop_survive_a_resume(tmp_path):
    values = [0.5, 0.7, 0.6, 0.65, 0.64, 0.9, 0.95]
    run(tmp_path, "train.epochs=3", "train.save_top_k=2", "train.early_stop=3", hooks=Scripted(values))
    hooks = Scripted(values)
    hooks.epoch = 3  # the evaluations of the epochs done
    _, metrics = run(tmp_path, "train.epochs=7", "train.save_top_k=2", "train.early_stop=3", hooks=hooks)
    assert len(rows(tmp_path)) == 5 and metrics["best_epoch"] == 2  # epochs 3-5: the patience ran out
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("best-*"))
    assert names == ["best-2-0.7000.pt", "best-4-0.6500.pt"]


def test_top_k_needs_a_validation_metric(tmp_path):
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.save_top_k=1", "train.epochs=1")
    data = blobs()
    data.val = data.val.subset([])
    with pytest.raises(ConfigError, match="follow val/acc, which this run does not report"):
        fit(build_model(model_cfg, (4,), 3), data, train_cfg, ctx)


def test_runner_eval_scores_the_best_checkpoint_again_and_on_other_data(cli_here, tmp_path, monkeypatch,
                                                                        capsys):  # fmt: skip
    cli_here("logger=none", "train.epochs=4", "train.lr=2", "train.save_top_k=1", "hydra.run.dir=run")
    best = min(rows(tmp_path / "run"), key=lambda row: (-row["val/acc"], row["epoch"]))
    capsys.readouterr()
    # in this process: no start-up per call (`runner-eval` as a command: the noisy-label run's test below)
    runner.evaluate_run.main([str(tmp_path / "run")])
    again = json.loads((tmp_path / "run" / "eval-test.json").read_text())
    out = capsys.readouterr().out
    assert again["checkpoint"].endswith("best.pt") and f"test/acc={best['test/acc']:.4f}" in out
    assert again["test/acc"] == pytest.approx(best["test/acc"], abs=1e-12)
    with pytest.raises(SystemExit) as stop:
        runner.evaluate_run.main([str(tmp_path / "run"), "model=cnn"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("runner-eval: error: ") and "does not fit cnn" in err, err
    runner.evaluate_run.main([str(tmp_path / "run"), "dataset.test_fraction=0.5"])
    assert (tmp_path / "run" / "eval-dataset.test_fraction=0.5.json").exists()

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has ...")

    monkeypatch.setattr(runner.evaluation, "evaluate_splits", out_of_memory)
    with pytest.raises(SystemExit) as stop:
        runner.evaluate_run.main([str(tmp_path / "run"), "train.eval_batch_size=512"])
    assert stop.value.code == 1 and capsys.readouterr().err == (
        "runner-eval: error: ran out of CUDA memory (it tried to allocate 3.00 GiB) at "
        "train.eval_batch_size=512; lower it\n"
    )


def test_runner_eval_scores_the_weights_a_run_selected_and_reported(cli_here, tmp_path, capsys):
    """train.select=best:KEY restores and reports the best epoch's weights (kept in the checkpoint beside
    the last epoch's); a task's tagged fit keeps its top k as `checkpoints/fit-best.pt`: runner-eval
    scores those, not the last epoch's `last.pt` / `fit.pt` weights."""
    cli_here("logger=none", "train.epochs=4", "train.lr=2", "train.select=best:val/acc", "hydra.run.dir=sel",
             "train.progress=false")  # fmt: skip
    reported = json.loads((tmp_path / "sel" / "summary.json").read_text())
    assert reported["tested_epoch"] < 4  # else the last epoch's weights are the selected ones
    runner.evaluate_run.main([str(tmp_path / "sel")])
    again = json.loads((tmp_path / "sel" / "eval-test.json").read_text())
    assert again["test/acc"] == pytest.approx(reported["test/acc"], abs=1e-12)

    cli_here("+method=lt_ce", "logger=none", "train.epochs=2", "train.save_top_k=1",
             "dataset.val_fraction=0.2", "hydra.run.dir=lt", "train.progress=false")  # fmt: skip
    epochs = [row for row in rows(tmp_path / "lt") if "fit/val/acc" in row]
    best = min(epochs, key=lambda row: (-row["fit/val/acc"], row["fit/epoch"]))
    runner.evaluate_run.main([str(tmp_path / "lt")])
    again = json.loads((tmp_path / "lt" / "eval-test.json").read_text())
    assert again["checkpoint"].endswith("checkpoints/fit-best.pt")
    assert again["test/acc"] == pytest.approx(best["fit/test/acc"], abs=1e-12)
    capsys.readouterr()


def evaluate(run_dir, *args, check=False):
    command = [sys.executable, "-m", "runner.evaluate_run", str(run_dir), *args]
    return subprocess.run(command, capture_output=True, text=True, check=check)


def test_a_run_resumed_inside_its_warm_up_continues_it_exactly(tmp_path):
    straight, _ = run(tmp_path / "a", "train.epochs=4", "train.warmup_epochs=3")
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", "train.epochs=4", "train.warmup_epochs=3", hooks=KillAt(1))
    assert "warmup_lr" in torch.load(tmp_path / "b" / CHECKPOINT, weights_only=False)
    resumed, _ = run(tmp_path / "b", "train.epochs=4", "train.warmup_epochs=3", seed=1)
    for p, q in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert [r["lr"] for r in rows(tmp_path / "a")] == [r["lr"] for r in rows(tmp_path / "b")]


ACCUMULATES = [("input_mixup", True), ("cutmix", True), ("comixup", False)]


@pytest.mark.parametrize("method, ok", quick_first(ACCUMULATES, lambda case: case[1]))
def test_mixup_methods_say_whether_they_accumulate(cli_here, method, ok):
    proc = cli_here("logger=none", f"+method={method}", "train.epochs=1", "train.accumulate=2",
                    "+debug=smoke", check=False)  # fmt: skip
    assert (proc.returncode == 0) == ok, proc.stderr[-500:]
    if not ok:
        assert "train.accumulate=2: this method needs each whole batch" in proc.stderr


class SeesTheNetwork(MethodHooks):
    """Records what the transform is given; the loss runs the eager module (no compile time here)."""

    def __init__(self):
        self.seen = []

    def transform(self, x, y_soft, idx, model):
        self.seen.append(type(model).__name__)
        return x, y_soft

    def loss(self, net, x, y_soft, idx, epoch):
        return (net._orig_mod(x).log_softmax(1) * -y_soft).sum(1).mean()


def test_the_transform_runs_through_the_compiled_network(tmp_path):
    hooks = SeesTheNetwork()
    model_cfg, train_cfg, ctx = setup(tmp_path, "train.epochs=1", "train.batch_size=50")
    ctx.compile = "default"
    fit(build_model(model_cfg, (4,), 3), blobs(), train_cfg, ctx, hooks)
    assert hooks.seen == ["OptimizedModule"] * 2  # a saliency pass gets the compiled speed-up too


@pytest.mark.slow  # a CSOT run and its evaluation: 14 s (`make test` keeps the classify runs' runner-eval)
def test_runner_eval_rebuilds_a_noisy_label_run_s_network(cli_here, tmp_path):
    cli_here("logger=none", "+experiment=csot_digits", "train.epochs=2", "method.warmup=1",
        "train.checkpoint=true", "hydra.run.dir=run")  # fmt: skip
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    evaluate(tmp_path / "run", check=True)
    again = json.loads((tmp_path / "run" / "eval-test.json").read_text())
    assert again["test/acc"] == pytest.approx(summary["test/acc"], abs=1e-12)  # standardised as the run


def test_a_run_states_its_config_and_parameter_count_and_carries_its_name_and_tags(cli_here, tmp_path):
    cli_here("logger=none", "+debug=smoke", "name=baseline", "logger.tags=[a,b]", "hydra.run.dir=run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["name"] == "baseline" and summary["tags"] == ["a", "b"]
    assert summary["model/params"] == summary["model/trainable_params"] > 0
    log = (tmp_path / "run" / "cli.log").read_text()
    assert log.count("config (validated):") == 1 and "name: baseline" in log
    assert f"{summary['model/params'] / 1e6:.2f}M parameters" in log


def test_the_solvers_import_nothing_of_the_runner_but_their_common_helpers():
    import ast
    from pathlib import Path

    import runner.methods

    for path in Path(runner.methods.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        mine = [name for name in names if name.split(".")[0] == "runner"]
        assert all(name.startswith("runner.methods.") for name in mine), (path.name, mine)


def test_resuming_a_finished_run_reports_its_last_epoch(tmp_path):
    # A run killed after its last checkpoint, before its summary: the restart trains nothing and must
    # still report the last epoch's row (epoch, lr, train/loss) beside the evaluation.
    _, straight = run(tmp_path, "train.epochs=2")
    _, again = run(tmp_path, "train.epochs=2")
    timeless = [{k: v for k, v in m.items() if not k.startswith("time/")} for m in (straight, again)]
    assert timeless[1] == timeless[0] and again["epoch"] == 2
