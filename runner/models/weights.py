"""`model.pretrained`: start a network from a local weights file."""

from __future__ import annotations

import logging

import torch
from torch import nn

from runner.checks import ConfigError
from runner.untrusted import torch_load

log = logging.getLogger(__name__)


def _own_key(key: str, own: dict, aliases) -> str:
    """`key` of a weights file as a key of `own`: without DDP's `module.` prefix, then renamed by the
    first alias (foreign prefix, ours) that matches a key `own` does not already have."""
    while key.startswith("module."):
        key = key[len("module.") :]
    if key in own:
        return key
    for foreign, ours in aliases:
        if key.startswith(foreign):
            return ours + key[len(foreign) :]
    return key


def _few(keys) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")


def load_weights(model: nn.Module, path: str) -> None:
    """Load the weights file `path` into `model` in place.

    The file (torch.save, or .safetensors) holds a state_dict, or a checkpoint dict with it under
    'state_dict' or 'model' (the runner's own checkpoints). Keys may carry DDP's `module.` prefix or
    the source library's names (`model.checkpoint_aliases`). The classifier is left as initialised
    when the file has none or its shape differs (another class count); any other missing, unexpected
    or mis-shaped tensor, or an unreadable file (pickled objects other than tensors are refused), is
    a ConfigError.
    """
    where = f"model.pretrained={path!r}"
    try:
        if path.endswith(".safetensors"):  # the format of timm's released weights
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = torch_load(path)  # a runner checkpoint's RNG states are numpy arrays
    except Exception as e:  # whatever makes the file unreadable, one line for the user
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
        raise ConfigError(
            f"{where}: not a readable weights file (torch.save of tensors only, or .safetensors): {reason}"
        ) from None
    if isinstance(state, dict):
        state = next((state[k] for k in ("state_dict", "model") if isinstance(state.get(k), dict)), state)
    if not (isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values())):
        raise ConfigError(f"{where}: no state_dict in it (nor under 'state_dict' or 'model')")
    own = model.state_dict()
    state = {_own_key(k, own, getattr(model, "checkpoint_aliases", ())): v for k, v in state.items()}
    head = {k for k in own if k.startswith("classifier.")}
    if any(state[k].shape != own[k].shape for k in head & state.keys()):
        log.info("%s: its classifier is for another class count; starting from a new one", where)
        state = {k: v for k, v in state.items() if k not in head}
    problems = {
        "missing": {k for k in own.keys() - state.keys() - head if not k.endswith("num_batches_tracked")},
        "unexpected": state.keys() - own.keys(),
        "mis-shaped": {k for k in state.keys() & own.keys() if state[k].shape != own[k].shape},
    }
    if any(problems.values()):
        found = "; ".join(f"{kind}: {_few(keys)}" for kind, keys in problems.items() if keys)
        raise ConfigError(f"{where} does not fit the {type(model).__name__}: {found}")
    model.load_state_dict(state, strict=False)
    log.info("%s: loaded %d tensors", where, len(state))
