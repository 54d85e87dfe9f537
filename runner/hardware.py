"""The one place that decides devices, precision, threads, determinism and distributed ranks."""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from runner.checks import ConfigError
from runner.methods._common import to_device, usable_cores

log = logging.getLogger(__name__)


def auto_device() -> str:
    """hardware=auto's device: cuda when a CUDA device is visible, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def auto_precision(device: str) -> str:
    """hardware=auto's precision on `device`: bf16 autocast where the GPU computes in it (Ampere and
    later; not an emulation), else fp32."""
    return "bf16" if device == "cuda" and torch.cuda.get_device_capability()[0] >= 8 else "fp32"


def auto_fast_step(device: str) -> bool:
    """hardware=auto's channels_last and whole-step CUDA graph on `device`: on where the GPU computes in
    bf16 (compute capability 8 and later), the cards `make bench-gpu` measured them faster on; else off."""
    return auto_precision(device) == "bf16"


def auto_workers(device: str) -> int:
    """hardware=auto's DataLoader workers on `device`: on CUDA one per core this process may use but its
    own, at most 8 (gpu.yaml's; past that decoding outpaces the GPU); none on the CPU, whose cores train."""
    if device != "cuda":
        return 0
    return max(1, min(8, usable_cores() - 1))


def capped_workers(asked: int) -> int:
    """`hardware.num_workers`, at most one per core this process may use: more decoding processes than
    cores only contend (300 of them on 2 cores: an epoch of 50 s against 0.46 s); a warning says so."""
    cores = usable_cores()
    if asked <= cores:
        return asked
    log.warning("hardware.num_workers=%d: capped at %d, the cores this process may use", asked, cores)
    return cores


# conf/hardware/auto.yaml reads these when a job's config is resolved: on the machine that runs the job.
OmegaConf.register_new_resolver("auto.device", auto_device)
OmegaConf.register_new_resolver("auto.precision", auto_precision)
OmegaConf.register_new_resolver("auto.workers", auto_workers)
OmegaConf.register_new_resolver("auto.fast_step", auto_fast_step)


def is_accelerator(device: torch.device) -> bool:
    """Whether `device` computes apart from the host (CUDA), so that reading its results waits for it.
    The one question the code asks of a device (`runner.device_tracking` answers yes for its stand-in)."""
    return device.type == "cuda"


def state_on_device(state: dict, device: torch.device) -> dict:
    """A state dict of host tensors (as `load_checkpoint(path, "cpu")` gives) on `device` in one copy:
    packed into one byte buffer, copied without waiting (`to_device`), cut back into tensors."""
    return unpacked_bytes(to_device(packed_bytes(state), device), state) if state else {}


def module_to_device(model: torch.nn.Module, device: torch.device) -> None:
    """`model.to(device)` in one copy the host does not wait for: its parameters and buffers elsewhere
    packed into one buffer, copied (`to_device`), cut back (with their strides) into their new storage, the
    same tensor objects (as `Module.to` keeps them); not one blocking copy per tensor."""
    away = {name: t for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
            if t.device != device}  # fmt: skip
    if not away:
        return
    moved = unpacked_bytes(to_device(packed_bytes(away), device), away, strided=True)
    for name, t in away.items():
        t.data = moved[name]


def packed_bytes(state: dict) -> torch.Tensor:
    """The bytes of every tensor of `state`, one after the other, as one uint8 tensor where they are."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in state.values()]) if state else torch.empty(0)


def unpacked_bytes(packed: torch.Tensor, like: dict, strided: bool = False) -> dict:
    """`packed_bytes`' inverse: tensors of `like`'s shapes and dtypes (and strides, `strided`) cut from
    `packed`, where it is, each in its own memory (a checkpoint saves each tensor's storage whole)."""
    out, offset = {}, 0
    for key, t in like.items():
        size = t.numel() * t.element_size()
        # cloned before the view: a wider dtype's view needs its bytes aligned, as a fresh buffer's are
        flat = packed[offset : offset + size].clone().view(t.dtype).view(t.shape)
        if strided:
            flat = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=packed.device).copy_(flat)
        out[key] = flat
        offset += size
    return out


class Stopwatch:
    """The time spent in `span()`s, summed; on CUDA measured between events recorded on the stream, so a
    span waits for nothing and `seconds()` (once per epoch) waits once. `timing=False`: spans are not
    timed (inside a captured CUDA graph, whose events the host cannot read), `seconds()` stays 0."""

    def __init__(self, cuda: bool, timing: bool = True):
        self.cuda, self.timing, self.total, self.events = cuda, timing, 0.0, []

    @contextlib.contextmanager
    def span(self):
        if not self.timing:
            yield
            return
        if not self.cuda:
            start = time.perf_counter()
            yield
            self.total += time.perf_counter() - start
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.events.append((start, end))

    def seconds(self) -> float:
        if self.events:
            self.events[-1][1].synchronize()
            self.total += sum(start.elapsed_time(end) for start, end in self.events) / 1000
            self.events.clear()
        return self.total


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
    compile: str = "false"  # a torch.compile mode (schema.COMPILE_MODES) for the training step, or "false"
    cuda_graph: bool = False  # replay a capturable training step as one CUDA graph (`train.GraphedStep`)
    sync_bn: bool = False  # under DDP, batch-norm statistics over the global batch
    info: dict = field(default_factory=dict)  # facts for summary.json (the model's parameter count)
    told: set = field(default_factory=set)  # the notes a run says once (`runner.progress`), once said
    eval_image_size: int = 0  # evaluation passes resize images to this side (train.phases' last; 0: as read)

    @property
    def accelerator(self) -> bool:
        """On an accelerator: reads of device results wait for it (see `is_accelerator`)."""
        return is_accelerator(self.device)

    def stopwatch(self) -> Stopwatch:
        return Stopwatch(self.device.type == "cuda")

    def synchronize(self) -> None:
        """Wait for the device's queued work (before reading a wall clock that should include it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def memory(self) -> dict:
        """Peak allocated and reserved GPU memory since the last call (GB); empty off CUDA."""
        if self.device.type != "cuda":
            return {}
        out = {
            "mem/peak_gb": torch.cuda.max_memory_allocated(self.device) / 2**30,
            "mem/reserved_gb": torch.cuda.max_memory_reserved(self.device) / 2**30,
        }
        torch.cuda.reset_peak_memory_stats(self.device)
        return out

    def autocast(self):
        """Autocast to `precision` (fp16, bf16) on this device; a no-op at fp32."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
        return torch.autocast(self.device.type, dtype=dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Loss scaling, on for fp16 only (bf16 has fp32's exponent range and needs none)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

    @property
    def fused_optimizer(self) -> bool:
        """Whether optimizers run as fused kernels: on CUDA (one kernel for every parameter, a tensor lr
        without a host read, so the step can be captured) and for a captured step anywhere (the CPU runs
        it eagerly in the tests); a CPU run otherwise keeps foreach, its recorded numbers."""
        return self.device.type == "cuda" or self.cuda_graph

    def prepare(self, model: torch.nn.Module, compile_network: bool = True) -> torch.nn.Module:
        """Move `model` to the device (channels-last if asked; batch norm synchronised over CUDA ranks with
        `sync_bn`); return the network to train through: wrapped in DistributedDataParallel under DDP,
        then compiled in `compile`'s mode if asked and `compile_network` (False: the caller compiles the
        whole training step instead) (PyTorch's order: the compiled graph breaks at DDP's gradient
        buckets, so their all-reduce overlaps the backward). Hooks keep using `model`."""
        module_to_device(model, self.device)
        if self.channels_last:
            model.to(memory_format=torch.channels_last)
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.info.update({"model/params": total, "model/trainable_params": trainable})
        if self.is_main:
            log.info("model: %s, %.2fM parameters (%.2fM trainable)", type(model).__name__, total / 1e6,
                     trainable / 1e6)  # fmt: skip
        net = model
        if self.distributed:
            if self.sync_bn and self.device.type == "cuda":  # SyncBatchNorm runs on CUDA only (NCCL)
                torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # the same parameters and buffers
            ids = [self.device.index] if self.device.type == "cuda" else None
            net = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        return self.compiled(net) if compile_network else net

    def compiled(self, fn):
        """`fn` (a network or a function) under torch.compile in `compile`'s mode; as it is at "false"."""
        if self.compile == "false":
            return fn
        return torch.compile(fn, mode=None if self.compile == "default" else self.compile)

    def to_input(self, x: torch.Tensor) -> torch.Tensor:
        """A batch moved to the device, in the memory format the model expects."""
        x = x.to(self.device, non_blocking=True)
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x


def seed_everything(seed: int, deterministic: bool = False, rank: int = 0) -> None:
    """Seed every generator from `seed`; the CUDA generators also from `rank`, so that ranks draw
    different device-side randomness (augmentations, dropout) while the host's data order stays shared."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if rank:
        torch.cuda.manual_seed_all(seed + 7919 * rank)  # a no-op without CUDA
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
        raise ConfigError(
            f"hardware={hw.name} needs CUDA but no CUDA device is visible; use hardware=auto or hardware=cpu"
        )
    rank, world_size, local_rank = 0, 1, 0
    if hw.distributed:
        if "WORLD_SIZE" not in os.environ:
            raise ConfigError(
                "hardware=ddp must be launched by torchrun (torchrun --nproc_per_node=N -m runner.cli ...)"
            )
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cpu")
    if hw.device == "cuda":
        # Slurm with one GPU per task shows each rank its own device as the only one: ordinal 0.
        device = torch.device("cuda", local_rank if torch.cuda.device_count() > 1 else 0)
        torch.cuda.set_device(device)  # before the process group, which binds NCCL to it
    if hw.distributed and not dist.is_initialized():
        if device.type == "cuda":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    return device, rank, world_size


def host_memory_available(proc=Path("/proc"), cgroups=Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process could still allocate before the kernel's OOM killer steps in: the machine's
    available memory and free swap, or less where its cgroup (a container's or a Slurm job's) or one above
    it sets a lower limit: cgroup v2's `memory.max`, or v1's `memory.limit_in_bytes` (older clusters'
    Slurm), less what the group uses. None where /proc/meminfo cannot be read (not Linux)."""
    try:
        meminfo = (proc / "meminfo").read_text()
    except OSError:
        return None
    kb = {key: int(value) for key, value in re.findall(r"^(\w+):\s+(\d+) kB", meminfo, re.MULTILINE)}
    available = 1024 * (kb.get("MemAvailable", kb.get("MemFree", 0)) + kb.get("SwapFree", 0))
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / "self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if not controllers:  # v2: one hierarchy
                root, limit_file, used_file = cgroups, "memory.max", "memory.current"
            elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
                root, limit_file, used_file = (
                    cgroups / "memory",
                    "memory.limit_in_bytes",
                    "memory.usage_in_bytes",
                )
            else:
                continue
            group = root / path.strip("/")
            for folder in (group, *group.parents):  # a container sees its own group as the root
                if not folder.is_relative_to(root):
                    break
                limit = folder / limit_file
                if limit.exists() and (value := limit.read_text().strip()) != "max":  # v1's "none" is huge
                    available = min(available, int(value) - int((folder / used_file).read_text()))
    return max(available, 0)


_memory_cap: int | None = None  # the RLIMIT_DATA soft limit this process set itself
# the one a runner process set last, this one or one above it (a sweep's workers, a test's subprocesses)
MEMORY_CAP_ENV = "RUNNER_MEMORY_CAP"


def cap_host_memory() -> int | None:
    """Cap what this process can allocate (RLIMIT_DATA, its private writable memory) at what it holds now
    plus `host_memory_available()`: a CPU run that outgrows the memory then fails an allocation, which it
    reports in one line with what to lower, where the OOM killer would end it without a word. The CLI sets
    it for runs on the CPU, and `fit` renews it at every epoch start (`renew_host_memory_cap`), so that
    memory freed elsewhere since counts. A lower limit the user set stays. Returns the cap in bytes, or
    None (not Linux, or the user's limit), changing nothing."""
    global _memory_cap
    import resource

    available = host_memory_available()
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    # none yet, or one a runner set (this process, or one above it): not a limit the user chose
    renewable = soft == resource.RLIM_INFINITY or str(soft) == os.environ.get(MEMORY_CAP_ENV)
    if available is None or sys.platform != "linux" or not renewable:
        return None
    held = re.search(r"VmData:\s+(\d+) kB", Path("/proc/self/status").read_text())
    cap = 1024 * int(held[1]) + available
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    _memory_cap = cap
    os.environ[MEMORY_CAP_ENV] = str(cap)
    log.debug("host memory: allocations capped at %.1f GB (held now + available)", cap / 1e9)
    return cap


def renew_host_memory_cap() -> None:
    """`cap_host_memory()` again where this process set a cap before (a CLI run on the CPU); else nothing."""
    if _memory_cap is not None:
        cap_host_memory()


def describe(hw, device: torch.device) -> str:
    """The device line a run's log starts with: the device, how it was chosen, its precision and workers."""
    if hw.name != "auto":
        chosen = "forced"
    elif torch.cuda.is_available():
        chosen = "CUDA visible" if device.type == "cuda" else "CUDA visible, hardware.device=cpu given"
    else:
        chosen = "no CUDA device visible"
    if device.type == "cuda":
        chosen += f", {torch.cuda.get_device_name(device)}"
    return f"device: {device} (hardware={hw.name}: {chosen}; {hw.precision}, {hw.num_workers} loader workers)"


def idle_flags(cfg, device: torch.device) -> list[str]:
    """A line for each flag of `cfg` (a job's config) that does nothing on `device`, naming it and why."""
    lines = []
    if device.type != "cuda" and cfg.hardware.cuda_graph:
        lines.append(f"hardware.cuda_graph=true does nothing on {device.type}: CUDA graphs need a CUDA "
                     "device; the training step runs eagerly")  # fmt: skip
    if not is_accelerator(device) and cfg.train.accumulate == "auto":
        lines.append(f"train.accumulate=auto does nothing on {device.type}: it sizes micro-batches to a "
                     "GPU's memory; each batch is one pass (train.accumulate=1)")  # fmt: skip
    return lines


def teardown() -> None:
    """Leave the process group, if this process joined one. Garbage reference cycles hold on to a
    DistributedDataParallel wrapper after its run, until the cycle collector runs; freed by the
    interpreter's own teardown, its reducer aborts the process (SIGABRT, "terminate called without an
    active exception"): 7 of 60 2-rank gloo runs of a small script here, 0 of 60 collecting first. Where
    a failed run's error still holds the wrapper, the collection frees the cycles and the exit the rest:
    9 aborts in 60 such runs without it, 0 with it."""
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (identity when not distributed)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values)
    return values
