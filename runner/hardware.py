"""The one place that decides devices, precision, threads, determinism and distributed ranks."""

from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from runner.schema import ConfigError


@dataclass
class RunContext:
    """What a task needs besides its config: where to compute, write and log."""

    device: torch.device
    dir: Path
    tracker: Any
    precision: str = "fp32"  # fp32 | fp16 (autocast + grad scaler) | bf16 (autocast)
    rank: int = 0
    world_size: int = 1
    num_workers: int = 0  # DataLoader processes for file-backed splits

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    channels_last: bool = False  # image batches and conv weights in NHWC
    compile: bool = False  # torch.compile the network's training forward

    def autocast(self):
        """Autocast to `precision` (fp16, bf16) on this device; a no-op at fp32."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
        return torch.autocast(self.device.type, dtype=dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Loss scaling, on for fp16 only (bf16 has fp32's exponent range and needs none)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move `model` to the device (channels-last if asked); return the network to train through:
        compiled if asked, wrapped in DistributedDataParallel under DDP. Hooks keep using `model`."""
        model.to(self.device)
        if self.channels_last:
            model.to(memory_format=torch.channels_last)
        net = torch.compile(model) if self.compile else model
        if self.distributed:
            ids = [self.device.index] if self.device.index is not None else None
            net = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids)
        return net

    def to_input(self, x: torch.Tensor) -> torch.Tensor:
        """A batch moved to the device, in the memory format the model expects."""
        x = x.to(self.device, non_blocking=True)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    elif torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True


def setup(hw) -> tuple[torch.device, int, int]:
    """Select the device from `hardware` and join the process group under torchrun.

    Returns (device, rank, world_size). `hardware.distributed` reads RANK/WORLD_SIZE/LOCAL_RANK from
    torchrun and uses NCCL on CUDA, gloo on CPU.
    """
    if hw.threads:
        torch.set_num_threads(hw.threads)
    if hw.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("hardware.device=cuda but no CUDA device is visible; use hardware=cpu")
    rank, world_size, local_rank = 0, 1, 0
    if hw.distributed:
        if "WORLD_SIZE" not in os.environ:
            raise ConfigError(
                "hardware=ddp must be launched by torchrun (torchrun --nproc_per_node=N -m runner.cli ...)"
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if hw.device == "cuda" else "gloo")
    if hw.device == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), rank, world_size
    return torch.device("cpu"), rank, world_size


def teardown() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (identity when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values)
    return values
