"""The per-epoch solvers on torch tensors (issue 15) agree with their numpy path to 1e-6 in float64.

Every check runs on torch CPU tensors (so the torch code path is exercised on any machine) and, when
CUDA is present, on CUDA tensors; the results must come back on the input's device.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from runner.methods.csot import allocate, coherence_energy, csot_plan, curriculum_ot
from runner.methods.dbot import dbot, dbot_loss, dbot_predict

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    ),
]
ATOL = 1e-6


def on(device, *arrays):
    return [torch.as_tensor(x, device=device) for x in arrays]


def close(tensor, reference, device, atol=ATOL):
    assert isinstance(tensor, torch.Tensor) and tensor.device.type == device
    assert tensor.dtype in (torch.float64, torch.int64, torch.bool)
    np.testing.assert_allclose(tensor.cpu().numpy(), reference, rtol=0, atol=atol)


def noisy_chunk(seed, n=120, c=6, d=10):
    rng = np.random.default_rng(seed)
    labels = rng.integers(c, size=n)
    logits = 3.0 * np.eye(c)[labels] + rng.standard_normal((n, c))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    features = rng.standard_normal((c, d))[labels] + 0.5 * rng.standard_normal((n, d))
    return probs, features, labels


@pytest.mark.parametrize("device", DEVICES)
def test_csot_solvers_agree_with_numpy(device):
    probs, features, labels = noisy_chunk(0)
    n, c = probs.shape
    a, b = np.full(n, 1.0 / n), np.full(c, 0.4 / c)
    t_probs, t_features, t_labels = on(device, probs, features, labels)

    close(
        curriculum_ot(-torch.log(t_probs), *on(device, a, b), 0.1),
        curriculum_ot(-np.log(probs), a, b, 0.1),
        device,
    )
    ref, ref_log = csot_plan(probs, features, labels, 0.4, max_iter=20, log=True, warn=False)
    out, out_log = csot_plan(t_probs, t_features, t_labels, 0.4, max_iter=20, log=True, warn=False)
    close(out, ref, device)
    assert out_log["n_iter"] == ref_log["n_iter"]
    value, grad = coherence_energy(out, t_features, t_probs, t_labels)
    ref_value, ref_grad = coherence_energy(ref, features, probs, labels)
    assert abs(value - ref_value) < ATOL
    close(grad, ref_grad, device)


@pytest.mark.parametrize("device", DEVICES)
def test_csot_allocation_of_an_epoch_agrees_with_numpy(device):
    probs, features, labels = noisy_chunk(1, n=300)
    kwargs = dict(solve_batch=128, seed=7, max_iter=10, reg=0.1, warn=False)
    ref = allocate(probs, features, labels, 0.5, **kwargs)
    out = allocate(*on(device, probs, features, labels), 0.5, **kwargs)
    close(out[1], ref[1], device)  # confidences
    close(out[0], ref[0], device, atol=0)  # pseudo-labels
    close(out[2], ref[2], device, atol=0)  # selection


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["sinkhorn", "dual", "bregman"])
def test_dbot_solver_agrees_with_numpy(device, method):
    rng = np.random.default_rng(2)
    cost, a = rng.random((80, 7)), np.full(80, 1 / 80)
    r = rng.dirichlet(np.ones(7))
    ref, ref_log = dbot(cost, a, 0.8 * r, 1.2 * r, 0.1, method=method, tol=1e-10, log=True)
    out, out_log = dbot(*on(device, cost, a, 0.8 * r, 1.2 * r), 0.1, method=method, tol=1e-10, log=True)
    close(out, ref, device)
    assert out_log["n_iter"] == ref_log["n_iter"] and out_log["converged"]
    if method != "bregman":
        close(out_log["f"], ref_log["f"], device)


@pytest.mark.parametrize("device", DEVICES)
def test_dbot_inference_and_loss_agree_with_the_cpu_path(device):
    rng = np.random.default_rng(3)
    labels = rng.integers(5, size=400)
    logits = 2.0 * np.eye(5)[labels] + rng.standard_normal((400, 5))
    prior = np.bincount(labels, minlength=5) / 400
    for delta, batch in ((0.0, None), (0.2, None), (0.2, 64)):
        ref = dbot_predict(logits, prior, delta, batch_size=batch, tol=1e-9)
        close(
            dbot_predict(torch.as_tensor(logits, device=device), prior, delta, batch_size=batch, tol=1e-9),
            ref,
            device,
            atol=0,
        )

    t_logits = torch.as_tensor(logits[:64], device=device).requires_grad_()
    cpu_logits = torch.as_tensor(logits[:64]).requires_grad_()
    counts = np.bincount(labels, minlength=5) + 1.0
    for mode, sweeps in (("paper", 3), ("official", 2)):
        ref = dbot_loss(cpu_logits, torch.as_tensor(labels[:64]), counts, 0.2, sweeps, mode)
        out = dbot_loss(t_logits, torch.as_tensor(labels[:64], device=device), counts, 0.2, sweeps, mode)
        assert out.device.type == device and abs(float(out) - float(ref)) < 1e-5  # float32
        (ref_grad,) = torch.autograd.grad(ref, cpu_logits)
        (grad,) = torch.autograd.grad(out, t_logits)
        close(grad, ref_grad.numpy(), device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loss", ["dbot", "ldam", "cb_focal"])
def test_longtail_loss_hook_runs_on_the_device(device, loss):
    """The per-step work of runner/tasks/longtail.py: its hook's loss lives on ctx.device and equals the CPU
    one."""
    from types import SimpleNamespace

    from runner.hooks.dbot import LossHook

    cfg = SimpleNamespace(
        loss=loss, loss_mode="official", k_train=2, train_delta=0.1, la_tau=1.0, focal_gamma=2.0,
        cb_beta=0.999, ldam_max_margin=0.5, ldam_scale=30.0, drw_start=0.0, augment="none",
    )  # fmt: skip
    counts = np.array([50.0, 20.0, 5.0])
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)  # the hook computes in float32 (model(x).float()), as in training
    x, y = torch.randn(16, 4), torch.randint(3, (16,))
    y_soft = torch.nn.functional.one_hot(y, 3).double()  # another dtype than the logits: cast inside
    ref = LossHook(cfg, counts, torch.device("cpu"), epochs=4).loss(model, x, y_soft, None, epoch=2)
    hook = LossHook(cfg, counts, torch.device(device), epochs=4)
    assert hook.prior.device.type == device and hook.margins.device.type == device
    out = hook.loss(model.to(device), x.to(device), y_soft.to(device), None, epoch=2)
    assert out.device.type == device and abs(float(out) - float(ref)) < 1e-5  # float32


@pytest.mark.slow  # a fresh interpreter importing torch and POT: 14 s
def test_pot_is_imported_without_the_libraries_that_reserve_gpu_memory():
    """JAX reserves 75% of a GPU when POT loads it; runner turns POT's other array libraries off before
    POT is imported, and leaves a user's own setting alone."""
    code = "import runner, ot.backend as b, os; print(os.environ['POT_BACKEND_DISABLE_JAX'], b.jax is False)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("POT_BACKEND_DISABLE")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "True"]
    env["POT_BACKEND_DISABLE_JAX"] = "yes"  # the user's
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["yes", "True"]
