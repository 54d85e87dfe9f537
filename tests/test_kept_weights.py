"""The kept best weights (`train.select=best:*`): copied where the model is, written to a checkpoint in one
read, and that checkpoint's bytes the same as when they were copied to the host tensor by tensor."""

import io

import torch

from runner.checkpoint import on_host, snapshot
from runner.device_tracking import STAND_IN
from runner.hardware import module_to_device, state_on_device


def _model() -> torch.nn.Module:
    """Float weights, an int64 buffer (batch norm's count) and a channels-last weight (its strides)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 5, 3), torch.nn.BatchNorm2d(5), torch.nn.Flatten(),
                                torch.nn.Linear(5 * 6 * 6, 7))  # fmt: skip
    model[0].weight.data = model[0].weight.data.to(memory_format=torch.channels_last)
    model.train()(torch.randn(4, 3, 8, 8))  # batch-norm statistics and a count of 1
    return model


def _saved(best: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save({"best": best}, buffer)
    return buffer.getvalue()


def test_a_checkpoint_holds_the_kept_weights_byte_for_byte_as_before():
    model = _model()
    kept = snapshot(model, {"val/acc": 0.5}, {}, ("val/acc", "max"), 3)
    # what the kept weights were before they stayed on the device: each tensor copied to the host alone
    before = {
        **kept,
        "state": {key: value.detach().cpu().clone() for key, value in model.state_dict().items()},
    }
    written = on_host(kept)
    for key, value in before["state"].items():
        ours = written["state"][key]
        assert ours.dtype == value.dtype and ours.stride() == value.stride() and torch.equal(ours, value), key
    assert _saved(written) == _saved(before)


def test_the_kept_weights_are_a_copy_and_come_back_into_the_model():
    model = _model()
    kept = snapshot(model, {"val/acc": 0.5}, {}, ("val/acc", "max"), 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(kept["state"])
    assert all(torch.equal(value, kept["state"][key]) for key, value in model.state_dict().items())


def test_a_state_read_on_the_host_goes_to_the_device_whole():
    state = _model().state_dict()
    moved = state_on_device(state, STAND_IN)
    assert list(moved) == list(state)
    assert all(
        moved[key].dtype == value.dtype and torch.equal(moved[key], value) for key, value in state.items()
    )


def test_a_model_moved_whole_keeps_its_tensors_values_and_strides():
    """`hardware.prepare`'s move (its one copy: tests/test_device_budgets.py counts the run's waits): the
    same parameter and buffer objects (an optimizer built before keeps them), in new storage, with their
    values, dtypes and strides."""
    model, before = _model(), _model()
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    storage = {name: t.data_ptr() for name, t in tensors.items()}
    module_to_device(model, STAND_IN)  # outside the tracker: a CPU device, elsewhere to the code
    assert dict(model.named_parameters()) | dict(model.named_buffers()) == tensors
    assert all(t.data_ptr() != storage[name] for name, t in tensors.items())
    for (key, value), (_, was) in zip(model.state_dict().items(), before.state_dict().items(), strict=True):
        assert value.dtype == was.dtype and value.stride() == was.stride() and torch.equal(value, was), key
