"""One run per run dir, and a resume only of what was started with the same config.

`lock(run_dir)` takes `run.lock` (an OS lock on the file, which names the holder's PID and host): a second
run in a busy dir refuses at once; a lock file left by a process that is gone (killed, preempted) holds
no OS lock any more and is taken over with a warning. `check_resume(run_dir, cfg)` decides whether a
run resumes the checkpoint in its run dir (`train.resume`, see runner/schema.py) and refuses a resume
whose config differs from the run dir's `config.yaml` outside `RESUME_MAY_CHANGE`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.checks import ConfigError

log = logging.getLogger(__name__)

MULTIRUN_FLAGS = frozenset({"-m", "--multirun"})
LOCK = "run.lock"
CHECKPOINTS = "checkpoints"


def multirun_args(argv) -> bool:
    """Whether a command line asks Hydra for a multirun (`-m` / `--multirun`): a sweep dir of job dirs."""
    return not MULTIRUN_FLAGS.isdisjoint(argv)


def multirun_job(hydra_cfg) -> bool:
    """Whether the job Hydra runs is one of a multirun: `hydra_cfg` is `HydraConfig.get()`, or the
    `hydra` node of a job's config."""
    return hydra_cfg.mode.name == "MULTIRUN"


# Keys a resumed run may change: how long it trains, where it logs, what hardware it runs on, where the
# data lives. Any other change makes a different experiment; `train.resume=force` accepts it anyway.
RESUME_MAY_CHANGE = (
    "name",
    "train.epochs",
    "train.progress",
    "train.log_every_s",
    "train.resume",
    "train.checkpoint_every_minutes",
    "train.eval_batch_size",
    "logger.",
    "hardware.name",
    "hardware.device",
    "hardware.distributed",
    "hardware.threads",
    "hardware.num_workers",
    "dataset.root",
    "dataset.download",
    "dataset.bad_images",  # a run stopped at an unreadable image restarts with `skip`
)

_held: dict[Path, int] = {}  # lock path -> open descriptor holding its OS lock, in this process


def lock(run_dir) -> None:
    """Hold `run_dir/run.lock` until `unlock(run_dir)` or the process ends; re-entrant in one process."""
    path = (Path(run_dir) / LOCK).resolve()
    if path in _held:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another run"
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise ConfigError(
                f"run dir {run_dir} is busy: {holder} ({path.name}); let it finish or choose another dir"
            ) from None
        log.warning("cannot lock %s (%s): a second run in this dir would not be stopped", path, e.strerror)
        return
    previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
    if previous:  # its OS lock went with its process
        log.warning("taking over the stale lock of %s in %s: that process is gone", previous, run_dir)
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"PID {os.getpid()} on host {socket.gethostname()} since {when}\n".encode(), 0)
    _held[path] = fd


def unlock(run_dir) -> None:
    """Release the run dir's lock (an empty lock file is a free one)."""
    fd = _held.pop((Path(run_dir) / LOCK).resolve(), None)
    if fd is not None:
        os.ftruncate(fd, 0)
        os.close(fd)  # closing drops the OS lock


def has_checkpoint(run_dir) -> bool:
    return any((Path(run_dir) / CHECKPOINTS).glob("*.pt"))


def _flat(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def config_changes(saved: dict, cfg: dict) -> list[str]:
    """`key old -> new` for the keys of both configs that differ, outside RESUME_MAY_CHANGE. Keys in only
    one of them (added to or dropped from a schema since the run started) are not compared."""
    old, new = _flat(saved), _flat(cfg)
    return [
        f"{key} {old[key]!r} -> {new[key]!r}"
        for key in old.keys() & new.keys()
        if old[key] != new[key]
        and not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUME_MAY_CHANGE)
    ]


def check_resume(run_dir, cfg: DictConfig) -> bool:
    """Whether this run resumes the checkpoint in `run_dir`; ConfigError where `train.resume` forbids what
    is there, where the config differs from the saved one, or where it asks fewer epochs of a finished
    run (nothing in the run dir is touched)."""
    run_dir, mode = Path(run_dir), cfg.train.resume
    found = has_checkpoint(run_dir) and cfg.train.checkpoint
    if mode == "must" and not found:
        raise ConfigError(
            f"train.resume=must but {run_dir} holds no checkpoint to resume (train.checkpoint=true)"
        )
    if mode == "never" and found:
        raise ConfigError(
            f"train.resume=never but {run_dir} holds a checkpoint: choose another run dir, or resume it"
        )
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists():
        return found
    saved = OmegaConf.to_container(OmegaConf.load(saved_path))
    done = saved.get("train", {}).get("epochs")
    if _finished(run_dir) and isinstance(done, int) and cfg.train.epochs < done:
        raise ConfigError(
            f"train.epochs={cfg.train.epochs}: {run_dir} holds a finished run of {done} epochs; to train "
            f"fewer, use another run dir (hydra.run.dir=...); to evaluate it, runner-eval {run_dir}"
        )
    if not found:
        return found
    changes = sorted(config_changes(saved, OmegaConf.to_container(cfg)))
    if changes and mode != "force":
        raise ConfigError(
            f"{run_dir} was started with another config ({'; '.join(changes)}): resume it with its own "
            "config.yaml, choose another run dir, or pass train.resume=force"
        )
    if changes:
        log.warning("train.resume=force: resuming %s with changed %s", run_dir, "; ".join(changes))
    return True


def _finished(run_dir: Path) -> bool:
    """Whether the run in `run_dir` ended with its result: a summary.json without an error."""
    try:
        return "error" not in json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return False


def resume_command(run_dir, overrides) -> str:
    """The command that resumes the run in `run_dir`: its overrides and the run dir."""
    args = [o for o in overrides if not o.startswith("hydra.run.dir=")] + [f"hydra.run.dir={run_dir}"]
    return "runner " + " ".join(shlex.quote(a) for a in args)


def shared(run_dir, rank: int) -> Path:
    """Rank 0's run dir on every rank of a process group; a rank whose Hydra made another (its clock
    passed a second) removes that empty one, so a torchrun launch leaves one run dir."""
    from runner.distributed_passes import broadcast_from_main

    run_dir = Path(run_dir)
    main = Path(broadcast_from_main(str(run_dir)))
    if rank > 0 and run_dir != main:
        with contextlib.suppress(OSError):  # not empty: someone else's, left alone
            run_dir.rmdir()
    return main
