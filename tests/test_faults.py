"""Never lose a run (issue 16), each case in a subprocess (a refused resume in the test's process): a resume
refused up front, stop signals and kill -9 followed by a restart that ends exactly as an uninterrupted run,
a corrupt checkpoint, divergence, a full disk, a busy run dir, a failing task, a diverging Optuna trial,
one W&B run across restarts."""

import json
import math
import os
import random
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import run_cli, run_cli_here
from test_cli import wandb_records

from runner.checkpoint import CHECKPOINT
from runner.compose import CONF_DIR
from runner.faults import Interrupted, StopSignals
from runner.hardware import MEMORY_CAP_ENV, host_memory_available
from runner.optim import follow_config, make_optimizer, make_scheduler
from runner.schema import TrainConfig

# digits, a small MLP, 157 steps per epoch (mid-epoch stops are easy to hit), 2 epochs.
BASE = ["logger=none", "train.progress=false", "model.hidden=[32]", "train.batch_size=8", "train.epochs=2"]
BASE += ["model.dropout=0.2", "seed=3"]  # dropout: a resume must restore the RNG state
OFTEN = "train.checkpoint_every_minutes=0.0005"  # a checkpoint every 30 ms inside an epoch
ENV = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "0"}
SLOW = pytest.mark.slow  # `make test-slow`


def start(args, cwd, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "runner.cli", *args], cwd=cwd, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # fmt: skip


def wait_for(condition, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended first ({proc.returncode}): {proc.communicate()[1][-2000:]}")
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def position(run_dir: Path):
    """(epoch, step) of the run dir's checkpoint; step None: at the end of that epoch."""
    try:
        state = torch.load(run_dir / CHECKPOINT, weights_only=False)
    except (FileNotFoundError, RuntimeError, EOFError):
        return None
    return state["epoch"], state["step"]


def records(run_dir: Path) -> list[dict]:
    """metrics.jsonl without its timings."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in lines]


def results(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    return {k: v for k, v in summary.items() if not k.startswith("time/")}


def one_line(stderr: str) -> str:
    """The runner's own message: exactly one line, and no traceback."""
    assert "Traceback" not in stderr, stderr
    (line,) = [ln for ln in stderr.splitlines() if ln.startswith("runner: ")]
    return line


def assert_same_run(run_dir: Path, straight: Path) -> None:
    assert [r["step"] for r in records(run_dir)] == [0, 1]  # every epoch logged exactly once
    assert records(run_dir) == records(straight)
    assert results(run_dir) == results(straight)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run every restarted one must match."""
    root = tmp_path_factory.mktemp("straight")
    run_cli([*BASE, f"hydra.run.dir={root / 'run'}"], root)
    return root / "run"


def copy_run(straight: Path, tmp_path: Path) -> Path:
    shutil.copytree(straight, tmp_path / "run", ignore=shutil.ignore_patterns("run.lock"))
    return tmp_path / "run"


# ------------------------------------------------------------------------------- refused resumes


def test_a_refused_resume_is_one_line_and_leaves_the_run_dir_alone(tmp_path):
    """Resuming with train.resume or a changed config: refused before Hydra writes into the run dir (other bad
    input: tests/test_fuzz_cli.py's table)."""
    (tmp_path / "empty").mkdir()
    straight = tmp_path / "run"  # a finished run of BASE's config, made here: no process of its own to start
    run_cli_here([*BASE, "train.epochs=1", f"hydra.run.dir={straight}"], tmp_path)
    cases = [
        ([*BASE, f"hydra.run.dir={straight}", "seed=1", "train.lr=0.2", "train.epochs=5"],
         f"{straight} was started with another config (seed 3 -> 1; train.lr 0.1 -> 0.2): resume it with "
         "its own config.yaml, choose another run dir, or pass train.resume=force"),
        ([*BASE, f"hydra.run.dir={straight}", "train.resume=never"], "train.resume=never but"),
        ([*BASE, f"hydra.run.dir={tmp_path / 'empty'}", "train.resume=must"], "holds no checkpoint to"),
    ]  # fmt: skip
    saved = {p: p.read_bytes() for p in (straight / "config.yaml", straight / ".hydra" / "overrides.yaml")}
    for args, expected in cases:  # in this process: no start-up per case
        proc = run_cli_here(args, tmp_path, check=False)
        assert proc.returncode == 2 and expected in one_line(proc.stderr), (args, proc.stderr)
    assert {p: p.read_bytes() for p in saved} == saved  # the refused resumes left the record alone


# ------------------------------------------------------------------------- stops and restarts


SIGNALS = [signal.SIGTERM, pytest.param(signal.SIGINT, marks=SLOW), pytest.param(signal.SIGUSR1, marks=SLOW)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda sig: sig.name)
def test_stop_signal_mid_epoch_then_the_printed_command_resumes_exactly(straight, tmp_path, sig):
    """Stopped inside an epoch, the run checkpoints after its step and says how to resume; that command
    logs every epoch once, ends as the uninterrupted run, and goes on in the same W&B run."""
    run_dir = tmp_path / "run"
    proc = start([*BASE, OFTEN, "logger=wandb", f"hydra.run.dir={run_dir}"], tmp_path)
    wait_for(lambda: (p := position(run_dir)) is not None and p[0] >= 1 and p[1] is not None, proc)
    sent = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig and time.monotonic() - sent < 30
    epoch, step = position(run_dir)
    assert step is not None and 0 < step  # stopped inside an epoch, after a finished step
    assert [r["step"] for r in records(run_dir)] == list(range(epoch))
    line = one_line(err)
    assert line.startswith(f"runner: stopped by {sig.name}; resume with: runner ")
    argv = shlex.split(line.split("resume with: ", 1)[1])
    assert argv[-1] == f"hydra.run.dir={run_dir}"
    run_cli(argv[1:], tmp_path)
    assert_same_run(run_dir, straight)
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    runs = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)


@SLOW
def test_sigterm_to_the_process_group_with_dataloader_workers(tmp_path):
    """Slurm signals every process of a job, DataLoader workers too, which PyTorch then ends at once: the
    run still stops in one line on its last checkpoint, and resumes."""
    run_dir = tmp_path / "run"
    files = ["dataset=fake", "dataset.like=cifar10", "dataset.train_size=2000", "dataset.test_size=100",
             "hardware.num_workers=2", "model.hidden=[16]", "train.batch_size=16"]  # fmt: skip
    args = [*BASE, *files, OFTEN, f"hydra.run.dir={run_dir}"]
    proc = start(args, tmp_path, start_new_session=True)
    wait_for(lambda: (p := position(run_dir)) is not None and p[1] is not None, proc)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and one_line(err).startswith("runner: stopped by SIGTERM; resume with: ")
    run_cli(args, tmp_path)
    assert [r["step"] for r in records(run_dir)] == [0, 1]


@SLOW
def test_kill_9_at_a_random_moment_then_restart(straight, tmp_path):
    delay = random.uniform(0.0, 2.0)
    args = [*BASE, OFTEN, f"hydra.run.dir={tmp_path / 'run'}"]
    proc = start(args, tmp_path)
    lock = tmp_path / "run" / "run.lock"
    wait_for(lambda: lock.exists() and lock.read_text(), proc)  # the job has started
    time.sleep(delay)
    proc.kill()
    proc.wait()
    killed = lock.read_text()
    restart = run_cli(args, tmp_path)
    if killed:  # (else it had finished)
        assert f"taking over the stale lock of {killed.strip()}" in restart.stderr, delay
    assert_same_run(tmp_path / "run", straight)


@pytest.mark.slow
def test_corrupt_checkpoint_is_named_and_kept(straight, tmp_path):
    run_dir = copy_run(straight, tmp_path)
    path = run_dir / CHECKPOINT
    path.write_bytes(path.read_bytes()[:1000])  # cut off, as by a crash of the file system
    proc = run_cli([*BASE, "train.epochs=3", f"hydra.run.dir={run_dir}"], tmp_path, check=False)
    assert proc.returncode == 1
    assert one_line(proc.stderr).startswith(f"runner: error: cannot read checkpoint {path} (RuntimeError: ")
    assert len(path.read_bytes()) == 1000


def test_running_out_of_memory_outside_the_steps_is_one_line(tmp_path):
    # a hidden layer of 2^52 units: 2^60 bytes of weights, more than any address space holds (2^57 bytes)
    args = [*BASE, "model.hidden=[4503599627370496]", "hydra.run.dir=run"]
    proc = run_cli_here(args, tmp_path, check=False)
    assert proc.returncode == 1
    assert one_line(proc.stderr) == (
        "runner: error: ran out of host memory (it tried to allocate 1073741824.00 GiB) outside the training "
        "steps; lower the network's size, or train.eval_batch_size for the passes over whole splits"
    )


def test_host_memory_available_is_the_machines_or_the_tightest_cgroups(tmp_path):
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal: 16000000 kB\nMemAvailable: 9000000 kB\nSwapFree: 1000000 kB\n")
    assert host_memory_available(proc, cgroups) == 10_000_000 * 1024  # no cgroup file: the machine's
    (proc / "self/cgroup").write_text("0::/slurm/job_7/step_0\n")
    job, step = cgroups / "slurm/job_7", cgroups / "slurm/job_7/step_0"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")  # no limit of its own: its parent's holds
    (job / "memory.max").write_text(f"{8 * 2**30}\n")
    (job / "memory.current").write_text(f"{3 * 2**30}\n")
    assert host_memory_available(proc, cgroups) == 5 * 2**30
    (job / "memory.max").write_text(f"{64 * 2**30}\n")  # a limit above the machine's memory
    assert host_memory_available(proc, cgroups) == 10_000_000 * 1024
    assert host_memory_available(tmp_path / "elsewhere", cgroups) is None  # not Linux
    # cgroup v1 (the memory controller's own tree); "no limit" is a number far above the machine's memory
    (proc / "self/cgroup").write_text("5:cpuset,cpu:/slurm/job_8\n4:memory:/slurm/job_8/step_0\n")
    job, step = cgroups / "memory/slurm/job_8", cgroups / "memory/slurm/job_8/step_0"
    step.mkdir(parents=True)
    (step / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (step / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    (job / "memory.limit_in_bytes").write_text(f"{4 * 2**30}\n")
    (job / "memory.usage_in_bytes").write_text(f"{2**30}\n")
    assert host_memory_available(proc, cgroups) == 3 * 2**30


CAPPED = """
import re, resource, sys, torch
from runner.faults import out_of_memory
from runner.hardware import cap_host_memory
cap = cap_host_memory()
if cap is None:
    print(None, resource.getrlimit(resource.RLIMIT_DATA)[0])
    sys.exit()
held = int(re.search(r"VmData:\\s+(\\d+) kB", open("/proc/self/status").read())[1]) * 1024
tensors = []
try:
    while True:  # 1 GiB each, never touched: address space under the cap, no memory used
        tensors.append(torch.empty(2**30, dtype=torch.uint8))
except RuntimeError as e:
    print(cap, held, len(tensors), out_of_memory(e))
"""


def run_capped(limit=None, set_by_runner=False) -> list[str]:
    """CAPPED's output in a process that starts under RLIMIT_DATA `limit` (None: none), set by a runner
    process above it (as the CLI marks its cap for its children) or else by the user."""
    env = {k: v for k, v in os.environ.items() if k != MEMORY_CAP_ENV}
    if set_by_runner and limit:
        env[MEMORY_CAP_ENV] = str(limit)
    hard = resource.getrlimit(resource.RLIMIT_DATA)[1]

    def start_under_limit():
        resource.setrlimit(resource.RLIMIT_DATA, (limit or resource.RLIM_INFINITY, hard))

    out = subprocess.run([sys.executable, "-c", CAPPED], capture_output=True, text=True, timeout=120, env=env,
                         preexec_fn=start_under_limit)  # fmt: skip
    return out.stdout.split(maxsplit=3)


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_DATA and /proc are Linux's")
@pytest.mark.parametrize("inherited", [None, 2**40])
def test_the_host_memory_cap_makes_outgrowing_it_an_allocation_error(inherited):
    cap, held, allocated, memory = run_capped(inherited, set_by_runner=True)
    room = (int(cap) - int(held)) // 2**30  # whole GiB between what the process held and the cap
    assert int(allocated) <= room  # never past the cap
    # Under overcommit's heuristic (mode 0, Linux's default) or "always" (1), untouched memory is not counted
    # elsewhere, so the cap is what stops it (the loop's own bytes aside); strict accounting (2) stops sooner.
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() != "2":
        assert int(allocated) >= room - 1
    assert memory.startswith("host memory (it tried to allocate 1.00 GiB)")


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_DATA and /proc are Linux's")
def test_a_memory_limit_the_user_set_is_kept():
    assert run_capped(2**40) == ["None", str(2**40)]


@pytest.mark.slow
def test_non_finite_loss_stops_at_once_naming_the_last_good_checkpoint(straight, tmp_path):
    run_dir = copy_run(straight, tmp_path)
    before = (run_dir / CHECKPOINT).read_bytes()
    args = [*BASE, "train.epochs=3", "train.lr=1e6", "train.resume=force", f"hydra.run.dir={run_dir}"]
    proc = run_cli(args, tmp_path, check=False)
    assert proc.returncode == 1
    line = one_line(proc.stderr)
    assert line.startswith("runner: error: non-finite loss at epoch 3, step ")
    assert f"last good checkpoint: {run_dir / CHECKPOINT} (end of epoch 2)" in line
    assert (run_dir / CHECKPOINT).read_bytes() == before  # nothing non-finite was saved
    assert [r["step"] for r in records(run_dir)] == [0, 1]


@SLOW
def test_full_disk_while_saving_keeps_the_previous_checkpoint(straight, tmp_path):
    run_dir = copy_run(straight, tmp_path)
    before = (run_dir / CHECKPOINT).read_bytes()
    limit = len(before) // 2  # no file may grow beyond this: the next checkpoint cannot be written

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = [*BASE, "train.epochs=3", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-m", "runner.cli", *args], cwd=tmp_path, env=ENV, text=True,
                          capture_output=True, timeout=300, preexec_fn=small_disk)  # fmt: skip
    assert proc.returncode == 1
    line = one_line(proc.stderr)
    assert line.startswith(f"runner: error: cannot write {run_dir / CHECKPOINT} (")
    assert line.endswith("; the previous one is intact")
    assert (run_dir / CHECKPOINT).read_bytes() == before
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


HOLDER = """
import sys, time
from runner.rundir import lock
lock(sys.argv[1])
print("locked", flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_a_busy_run_dir_is_refused_at_once(straight, tmp_path):
    """A run in a dir whose lock a live process holds (as every run does while it lasts) refuses at once,
    before Hydra rewrites the dir's .hydra/ record."""
    run_dir = copy_run(straight, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], cwd=tmp_path, env=ENV, text=True,
                              stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        saved = {p: p.read_bytes() for p in (run_dir / "config.yaml", run_dir / ".hydra" / "overrides.yaml")}
        second = run_cli([*BASE, "seed=4", f"hydra.run.dir={run_dir}"], tmp_path, check=False)
        assert second.returncode == 2
        busy = f"runner: error: run dir {run_dir} is busy: PID {holder.pid} on "
        assert one_line(second.stderr).startswith(busy)
        assert {p: p.read_bytes() for p in saved} == saved  # the running run's record is untouched
    finally:
        holder.kill()
        holder.wait()


FAILING_TASK = """
import dataclasses
import sys
import runner.tasks.classify
from runner.cli import main

def boom(cfg, ctx):
    ctx.tracker.log({"epoch": 1}, step=0)
    raise RuntimeError("boom")

runner.tasks.classify.TASK = dataclasses.replace(runner.tasks.classify.TASK, run=boom)
sys.argv = ["runner", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
def test_a_failing_task_finishes_its_wandb_run_and_frees_the_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    args = ["logger=wandb", "train.progress=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run([sys.executable, "-c", FAILING_TASK, *args], cwd=tmp_path, env=ENV, text=True,
                          capture_output=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1 and "RuntimeError: boom" in proc.stderr
    assert "SweepSummary" not in proc.stderr and "hydra.job.num" not in proc.stderr
    (log_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    exits = [r.exit.exit_code for r in wandb_records(log_file) if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]  # the W&B run was finished, as failed
    assert (run_dir / "run.lock").read_text() == ""  # released


@pytest.mark.slow
def test_optuna_goes_on_past_a_diverging_trial(tmp_path):
    sweep = tmp_path / "study"
    # TPE with this seed asks lr 1e6 first, then 0.05 and 0.1 (optuna 4 and 5).
    trials = ["hydra/sweeper=optuna", "hydra.sweeper.sampler.seed=1", "hydra.sweeper.n_trials=3"]
    one_epoch = [a for a in BASE if not a.startswith("train.epochs=")] + ["train.epochs=1"]
    args = ["-m", *one_epoch, *trials, "train.lr=choice(0.05,1e6,0.1)", f"hydra.sweep.dir={sweep}"]
    proc = run_cli(args, tmp_path)
    assert "Failed experiment: runner: error: Diverged: non-finite loss at epoch 1" in proc.stdout  # Optuna
    assert "3 runs: 2 completed, 1 failed" in proc.stdout
    done = {}
    for path in sweep.glob("*/summary.json"):
        overrides = yaml.safe_load((path.parent / ".hydra" / "overrides.yaml").read_text())
        lr = float(next(o for o in overrides if o.startswith("train.lr=")).split("=")[1])
        done[lr] = json.loads(path.read_text())
    assert sorted(done) == [0.05, 0.1, 1e6]
    assert done.pop(1e6)["error"].startswith("Diverged: non-finite loss at epoch 1, step ")
    assert all("error" not in s and s["test/acc"] > 0.5 for s in done.values())
    best = (sweep / "optimization_results.yaml").read_text()
    assert "train.lr: 0.1" in best or "train.lr: 0.05" in best


def test_stop_signals_checkpoint_first_then_hand_sigusr2_to_submitit():
    """Under submitit, SIGUSR2 (its requeue signal) is deferred to the end of the step, then handed on."""
    calls = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))
    try:
        with StopSignals() as stop:
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.signum == signal.SIGUSR2 and calls == []  # only recorded: the step goes on
            with pytest.raises(Interrupted):
                stop.stop()
            assert calls == [signal.SIGUSR2]
        os.kill(os.getpid(), signal.SIGUSR2)  # the previous handler is back
        assert calls == [signal.SIGUSR2] * 2
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_slurm_preset_requeues():
    text = (CONF_DIR / "hydra" / "launcher" / "slurm_gpu.yaml").read_text()
    assert "max_num_timeout: 3" in text and "signal_delay_s:" in text
    assert "requeue" in text.lower()


def test_a_resume_follows_the_schedule_of_its_config():
    """Extending a run (train.epochs) stretches the cosine over the new length from the restored epoch;
    an unchanged config leaves the restored optimizer and scheduler untouched (an exact resume)."""
    model = torch.nn.Linear(2, 2)
    optimizer = make_optimizer(model, TrainConfig(epochs=3))
    scheduler = make_scheduler(optimizer, TrainConfig(epochs=3))
    for _ in range(2):
        optimizer.step()
        scheduler.step()
    before = repr((optimizer.state_dict(), scheduler.state_dict()))
    follow_config(optimizer, scheduler, TrainConfig(epochs=3))
    assert repr((optimizer.state_dict(), scheduler.state_dict())) == before
    follow_config(optimizer, scheduler, TrainConfig(epochs=5, momentum=0.5))
    for epoch in (2, 3, 4):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * (1 + math.cos(math.pi * epoch / 5)) / 2)
        assert optimizer.param_groups[0]["momentum"] == 0.5
        optimizer.step()
        scheduler.step()
