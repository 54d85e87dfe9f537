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
    amp: bool = False
    rank: int = 0
    world_size: int = 1
    num_workers: int = 0  # DataLoader processes for file-backed splits

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def autocast(self):
        """Mixed precision on CUDA when `hardware.amp`; a no-op otherwise."""
        if not (self.amp and self.device.type == "cuda"):
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.float16)


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
