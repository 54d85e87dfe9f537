"""Count, on the CPU, what a run would make the host wait for on a GPU.

`DeviceTracker` is a `torch.overrides.TorchFunctionMode`: every tensor is "on the device" or "on the
host", the tag following each op (device if any input is on the device; a factory's `device=`; `.to`,
`.cpu()`), and the device is a stand-in (`STAND_IN`, a CPU device with an index, so that `tensor.device`
and `device=` arguments still name it). Counted, per phase (`train`, `captured`, `epoch_start`, `eval`,
`other`):

    sync      an op that would block the host until the device is done: `item`, `tolist`,
              `float`/`int`/`bool` of a device tensor, a device -> host copy, `nonzero`, `unique`,
              boolean-mask or host-index indexing of a device tensor, a blocking host -> device copy
              (`.to(device)` without `non_blocking=True`, `torch.tensor(data, device=...)`)
    mix       an op with device and host tensor inputs (a CUDA error; 0-dim host tensors are allowed)
    numpy     `.numpy()` of a device tensor (a CUDA error)
    host      (in `captured`, what a CUDA graph replays) a tensor made on the host: its first value
              would be replayed every step

Tensors the tracker did not see made (autograd's gradients, module parameters) are on the device.

Apart, the eager work of a training step: every op of a step (`Instruments.step`) outside a captured
region and outside the warm-up steps before a capture (`Instruments.warm_up`) that makes a tensor on the
device or copies into one (`eager_ops`; a view counts too: what the tracker sees is the Python call, not
the kernels; an attribute read such as `.grad` does not). On a GPU each is a launch from Python that the
device may wait for; a step replayed from a CUDA graph leaves only the copies of its inputs into the static
buffers and of its loss out.

`python -m runner.device_tracking OVERRIDES... [--json PATH]` runs the CLI under the tracker with the
stand-in as the CUDA device (`RunContext.accelerator` true) and prints syncs and eager device ops per
training step (`eager_ops_per_step`, over the steps after the warm-up ones).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from runner.instruments import NOTHING, Instruments, watching

STAND_IN = torch.device("cpu", 0)
CAPTURED = "captured"  # the phase of what a CUDA graph replays (`Instruments.captured`)
TAG = "_on_device"  # the attribute that holds a tensor's tag (absent: made out of sight, so on the device)

T = torch.Tensor
_READS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.__complex__}
_NUMPY = {T.numpy, T.__array__}
_DATA_DEPENDENT = {torch.nonzero, T.nonzero, torch.unique, T.unique, torch.masked_select, T.masked_select,
                   torch.argwhere, T.argwhere, torch.unique_consecutive, T.unique_consecutive,
                   torch.equal, T.equal, torch.allclose, T.allclose, torch.bincount, T.bincount}  # fmt: skip
_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
              torch.linspace, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm,
              torch.logspace, torch.empty_strided, torch.scalar_tensor}  # fmt: skip
_FROM_DATA = {torch.tensor, torch.as_tensor}  # a device= here copies host data: a blocking copy
_INDEXING = {T.__getitem__, T.__setitem__, T.index_put_, T.index_put, torch.index_put}
_COPIES = {T.copy_}
_TO = {T.to, T.cuda, T.cpu}
_DEVICE = inspect.getattr_static(T, "device")
_DATA = inspect.getattr_static(T, "data")


def _where(t: torch.Tensor) -> bool:
    return getattr(t, TAG, True)


def _tensors(obj, found: list | None = None) -> list[torch.Tensor]:
    """The tensors in `obj` and its nested tuples, lists and dicts (an op's arguments or result): what
    torch's pytree flattening finds there, at a fraction of its cost on every op."""
    found = [] if found is None else found
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _tensors(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, found)
    return found


def _tag(out, on_device: bool):
    for t in _tensors(out):
        with contextlib.suppress(AttributeError, RuntimeError):
            setattr(t, TAG, on_device)
    return out


def _is_stand_in(device) -> bool:
    return device is not None and torch.device(device) == STAND_IN


def _site() -> str:
    """The innermost frame of the project's code (runner/, benchmarks/) that made the call."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if any(part in name for part in ("/runner/", "/benchmarks/")) and not name.endswith(
            "device_tracking.py"
        ):
            return f"{Path(name).parent.name}/{Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def _in_torch_optim() -> bool:
    """Whether the op was called from torch's optimizers' code."""
    return f"{os.sep}torch{os.sep}optim{os.sep}" in sys._getframe(3).f_code.co_filename


class DeviceTracker(TorchFunctionMode):
    """See the module docstring. `counts[phase][kind]`, `sites[(phase, kind, where)]`, `steps`."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.sites: Counter = Counter()
        self.phase = "other"
        self.steps = 0
        self.entered: Counter = Counter()  # entries of each phase's instrumentation point (`tracking`)
        self.stepping = False  # inside a training step
        self.warm_steps = 0  # the steps that warmed up a capture (not the steady cost: `eager_ops_per_step`)
        self.eager_sites: Counter = Counter()  # the steady steps' eager device ops, by site
        self.step_sites: Counter = Counter()  # the current step's

    @contextlib.contextmanager
    def in_phase(self, name: str):
        outer, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = outer

    def count(self, kind: str, what: str) -> None:
        self.counts[self.phase][kind] += 1
        self.sites[(self.phase, kind, f"{what} at {_site()}")] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is _DEVICE:  # a device tensor names the stand-in, so `device=x.device` keeps it there
            return STAND_IN if _where(args[0]) else func(*args)
        if owner is _DATA and func.__name__ == "__set__":  # `param.data = moved` (Module.to) moves it
            setattr(args[0], TAG, _where(args[1]))
            return func(*args, **kwargs)
        tensors = _tensors(kwargs, _tensors(args))
        on_device = [t for t in tensors if _where(t)]
        name = getattr(func, "__name__", str(func))
        if func in _TO:
            out = self._to(func, args, kwargs, name)
            if out is not args[0]:
                self._eager(name, out, _where(out))
            return out
        if func in _READS and on_device:
            self.count("sync", name)
        elif func in _NUMPY and on_device:
            self.count("numpy", name)
        elif func in _DATA_DEPENDENT and on_device:
            self.count("sync", name)
        elif func in _INDEXING and on_device:
            self._indexing(args, name)
        elif func in _COPIES and len(tensors) == 2 and _where(args[0]) != _where(args[1]):
            if _where(args[0]) is False or not kwargs.get("non_blocking", len(args) > 2 and args[2]):
                self.count("sync", "copy_")  # device -> host, or a blocking host -> device copy
            return func(*args, **kwargs)
        elif on_device and len(on_device) < len(tensors) and func not in _INDEXING:
            host = [t for t in tensors if not _where(t) and t.dim() > 0]
            if host:
                self.count("mix", f"{name} {tuple(host[0].shape)}")
        out = func(*args, **kwargs)
        self._eager(name, out, bool(on_device) or _is_stand_in(kwargs.get("device")))
        if func in _FACTORIES or name.endswith("_like") or name.startswith("new_"):
            device = kwargs.get("device")
            if device is not None:
                if func in _FROM_DATA and _is_stand_in(device) and not (tensors and on_device):
                    self.count("sync", f"{name}(host data, device=...)")
                return self.made(out, _is_stand_in(device), name)
            if func in _FACTORIES and func not in _FROM_DATA:
                return self.made(out, False, name)
        if tensors:
            _tag(out, bool(on_device))
        elif func in _FROM_DATA:
            self.made(out, False, name)
        return out

    def _eager(self, name: str, out, on_device: bool) -> None:
        """Count an op as an eager device op where it made or wrote a tensor on the device (`on_device`:
        its inputs there, or a factory's `device=` the stand-in) inside a step, outside a captured region
        and the warm-up steps."""
        if not (self.stepping and on_device) or self.phase == CAPTURED or not _tensors(out):
            return
        if name == "__get__":  # an attribute read (a parameter's `.grad`): no device work
            return
        self.step_sites[f"{name} at {_site()}"] += 1

    @contextlib.contextmanager
    def training_step(self):
        """One training step: its eager device ops kept unless it was a warm-up step (whose draws, made
        before the step knows it warms up, go with it)."""
        self.steps += 1
        warm, self.stepping = self.warm_steps, True
        try:
            yield
        finally:
            self.stepping = False
            if self.warm_steps == warm:
                self.eager_sites.update(self.step_sites)
            self.step_sites.clear()

    def made(self, out, on_device: bool, name: str):
        """`out`, a tensor a factory made, tagged; one made on the host inside a captured region counted
        (`host`): a CUDA graph would replay its first value."""
        if not on_device and self.phase == CAPTURED:
            self.count("host", name)
        return _tag(out, on_device)

    def train_syncs(self) -> int:
        """The syncs of the training steps, a captured region's included."""
        return sum(self.counts[phase]["sync"] for phase in ("train", CAPTURED) if phase in self.counts)

    def _to(self, func, args, kwargs, name):
        src, non_blocking = args[0], kwargs.get("non_blocking", False)
        if func is T.cpu:
            target, dtype, memory_format = torch.device("cpu"), None, None
        elif func is T.cuda:
            target, dtype, memory_format = STAND_IN, None, None
        elif len(args) > 1 and isinstance(args[1], torch.Tensor):  # .to(other): its device and dtype
            target = STAND_IN if _where(args[1]) else torch.device("cpu")
            dtype, memory_format = args[1].dtype, None
        else:
            parse = {k: v for k, v in kwargs.items() if k != "copy"}
            target, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args[1:], **parse)
        if target is None:
            return _tag(func(*args, **kwargs), _where(src))
        # torch's optimizers move a per-device value (fused Adam's tensor lr) to each parameter's device,
        # which on the stand-in is the real CPU's: a move from the device to the device
        to_device = _is_stand_in(target) or (_where(src) and _in_torch_optim())
        if to_device and _where(src):  # already there: no copy (a CPU `.to(cpu:0)` would copy)
            kw = {"dtype": dtype, "memory_format": memory_format}
            return _tag(src.to(**{k: v for k, v in kw.items() if v is not None}), True)
        if not to_device and _where(src):
            self.count("sync", f"{name} to host")
        elif to_device and not non_blocking:
            self.count("sync", f"{name} blocking host -> device")
        kw = {"dtype": dtype, "memory_format": memory_format}
        moved = src.to(torch.device("cpu"), **{k: v for k, v in kw.items() if v is not None}, copy=True)
        return _tag(moved, to_device)

    def _indexing(self, args, name):
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, (tuple, list)) else (index,)
        for part in parts:
            if isinstance(part, torch.Tensor) and part.dtype == torch.bool and part.dim() > 0:
                self.count("sync", f"{name}[boolean mask]")
                return
            if isinstance(part, torch.Tensor) and not _where(part) and part.dim() > 0:
                self.count("sync", f"{name}[host index]")
                return
            if isinstance(part, list):
                self.count("sync", f"{name}[list index]")
                return
        if name == "__setitem__" and len(args) > 2 and isinstance(args[2], torch.Tensor):
            if not _where(args[2]) and args[2].dim() > 0:
                self.count("sync", f"{name}(host value)")

    def report(self) -> dict:
        """Counts by phase, syncs and eager device ops per training step, and the sites (most frequent
        first)."""
        steps = max(self.steps, 1)
        return {
            "steps": self.steps,
            "warm_up_steps": self.warm_steps,
            "entered": dict(self.entered),
            "counts": {phase: dict(c) for phase, c in self.counts.items()},
            "syncs_per_step": self.train_syncs() / steps,
            "eager_ops_per_step": sum(self.eager_sites.values()) / max(self.steps - self.warm_steps, 1),
            "sites": [f"{n} x {phase} {kind}: {what}" for (phase, kind, what), n in self.sites.most_common()],
            "eager_sites": [f"{n} x {what}" for what, n in self.eager_sites.most_common()],
        }


class _Phases(Instruments):
    """The tracker's phases at the loop's instrumentation points: each point entered counted (`entered`),
    each training step counted (`steps`)."""

    def __init__(self, tracker: DeviceTracker):
        self.tracker = tracker

    def _phase(self, name: str):
        self.tracker.entered[name] += 1
        return self.tracker.in_phase(name)

    def method_pass(self):
        return self._phase("epoch_start")

    def epoch(self, tag, epoch, steps):
        return self._phase("train")

    @contextlib.contextmanager
    def step(self, s, x, idx, epoch):
        with self._phase("train"), self.tracker.training_step():
            yield

    def captured(self):
        return self._phase(CAPTURED)

    def warm_up(self):
        self.tracker.warm_steps += 1
        return NOTHING

    def evaluation(self):
        return self._phase("eval")


@contextlib.contextmanager
def tracking():
    """The tracker, with the run's device the stand-in (an accelerator to the code) and fit's parts in
    their phases (`runner.instruments`); leaves everything as it was on exit."""
    import runner.hardware as hardware

    tracker = DeviceTracker()
    saved = {(hardware, "setup"): hardware.setup, (hardware, "is_accelerator"): hardware.is_accelerator}

    def setup(hw):  # hardware=gpu or cpu: the stand-in
        on_cpu = copy.copy(hw)
        on_cpu.device = "cpu"
        _, rank, world_size = saved[(hardware, "setup")](on_cpu)
        return STAND_IN, rank, world_size

    from_numpy = torch.from_numpy  # a factory the mode does not see: its tensors are host tensors
    torch.from_numpy = lambda array: tracker.made(from_numpy(array), False, "from_numpy")
    saved[(torch, "from_numpy")] = from_numpy
    hardware.setup = setup
    accelerated = saved[(hardware, "is_accelerator")]
    hardware.is_accelerator = lambda device: _is_stand_in(device) or accelerated(device)
    try:
        with tracker, watching(_Phases(tracker)):
            yield tracker
    finally:
        for (module, attr), value in saved.items():
            setattr(module, attr, value)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = None
    if "--json" in argv:
        i = argv.index("--json")
        out = Path(argv[i + 1])
        del argv[i : i + 2]
    from runner import cli

    with tracking() as tracker:
        cli.run_in_process(argv)
    report = tracker.report()
    if out is not None:
        out.write_text(json.dumps(report, indent=1))
    per_step, steps = report["syncs_per_step"], report["steps"]
    print(f"device tracking: {per_step:.2f} syncs per training step over {steps} steps; "
          f"{report['eager_ops_per_step']:.1f} eager device ops per step after {report['warm_up_steps']} "
          "warm-up steps")  # fmt: skip
    for phase, counts in sorted(report["counts"].items()):
        print(f"  {phase}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for line in report["sites"][:25]:
        print("  " + line)


if __name__ == "__main__":
    main()
