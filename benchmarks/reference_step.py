"""The speed of light of a training step: a preset's network trained by a short hand-written loop.

What a user would write for speed alone: a static synthetic batch already on the device, channels_last,
autocast at the given precision, plain cross-entropy on integer labels, a fused SGD with its lr in a
tensor, and the whole step (forward, loss, backward, optimizer) captured in one CUDA graph. `make
bench-gpu` measures it beside the runner's step of the same network, batch and precision; the runner's
machinery (its data path, hooks, checks and logging) is what the ratio between them costs.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

WARMUP = 3  # eager steps before the capture (cuDNN's autotuning, the momentum buffers)


def reference_step_ms(model: torch.nn.Module, batch: int, input_shape: tuple[int, ...], num_classes: int,
                      precision: str = "fp32", steps: int = 50, device: str = "cuda") -> float:  # fmt: skip
    """ms per step of `model` on a static batch of `batch` inputs of `input_shape`: the mean of `steps`
    replays of the captured step on CUDA (device time between CUDA events), of `steps` eager steps
    elsewhere (wall time, for `--smoke`)."""
    cuda = torch.device(device).type == "cuda"
    model = model.to(device).train()
    x = torch.randn(batch, *input_shape, device=device)
    if x.dim() == 4:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(num_classes, (batch,), device=device)
    lr = torch.tensor(0.01, device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4,
                                fused=True)  # fmt: skip
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    if not cuda:
        step()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return 1000 * (time.perf_counter() - start) / steps
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(WARMUP):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def host_marker_us(repeats: int = 5, ops: int = 2000) -> float:
    """The host's speed at what bounds a launch-bound step, Python calling into torch's dispatcher: µs per
    `torch.add` of two one-element CPU tensors, the best of `repeats` runs of `ops` (a record's marker:
    two machines' step times compare where their markers agree)."""
    a, b = torch.ones(1), torch.ones(1)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(ops):
            torch.add(a, b)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / ops
