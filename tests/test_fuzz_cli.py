"""Bad command lines as a new user types them (issue 38): each ends with a short error naming the key it
is about, never a traceback. The table runs in this process (`run_in_process`), before any job starts;
the cases that need a job, a signal or a read-only place follow it."""

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import quick_first

from runner import sync
from runner.cli import run_in_process
from runner.evaluate_run import main as runner_eval
from runner.hardware import capped_workers
from runner.methods._common import usable_cores

# A log record's line (Hydra's format, `[time][logger][LEVEL] - message`), or its indented continuation.
LOG_RECORD = re.compile(r"^(\[\d{4}-\d\d-\d\d [\d:,]+\]\[[\w.]+\](\[[A-Z]+\])?|\s)")  # Hydra's own: no level

# (command line, the key the error must name, what else it must say: one fragment or several); all are refused
# with exit code 2.
BAD = [
    # the table
    (["train.phases=[{epochs:1,image_size:16,batch_size:32,lr:[0.1,0.0]}]", "train.epochs=1",
      "train.schedule=none"], "train.phases.0.image_size=16", "model=mlp takes the data's own image size"),
    (["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "train.lr=interval(0.5, 0.01)"],
     "train.lr=interval(0.5, 0.01)", "low <= high"),
    (["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2",
      "train.weight_decay=tag(log, interval(0, 0.01))"], "train.weight_decay=tag(log, interval(0, 0.01))",
     "low > 0"),
    (["-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=0"], "hydra.sweeper.n_trials=0", "[1, inf]"),
    (["+metric=bogus/acc", "train.early_stop=2", "train.epochs=3"], "metric=bogus/acc", "follow val/acc"),
    (["+metric=test/loss:min", "train.save_top_k=2"], "metric=test/loss:min", "train.save_top_k=2"),
    # the misleading one-liners
    (["model.pretrained=notes.txt"], "model.pretrained='notes.txt'", "not a weights file"),
    (["model.pretrained=folder"], "model.pretrained='folder'", "is a folder"),
    (["+method="], "method=''", "choices: balanced_cluster"),
    (["train.phases=[{epochs:1,bogus:2}]", "train.schedule=none", "train.epochs=1"],
     "train.phases.0.bogus", "valid keys: epochs, image_size, batch_size, lr"),
    (["name=héllo"], "name=héllo", """must be quoted: 'name="héllo"'"""),
    (["x" * 5000 + "=1"], "unknown key xxxx", "5000 characters"),
    (["-m", "hydra/sweeper=optuna", "train.batch_size=interval(16, 64)"], "train.batch_size",
     "train.batch_size=tag(int, interval(16, 64))"),
    (["hydra.sweeper.pruner=bogus", "-m", "hydra/sweeper=optuna"], "hydra.sweeper.pruner='bogus'", "median"),
    (["-m", "hydra/sweeper=optuna", "hydra.sweeper.direction=up"], "hydra.sweeper.direction='up'", "minim"),
    (["hydra.sweeper.n_jobs=0", "-m", "hydra/sweeper=optuna"], "hydra.sweeper.n_jobs=0", "[1, inf]"),
    (["train.milestones=[1,2"], "train.milestones=[1,2", "Hydra cannot read this override"),
    (["+method=csot", "dataset=cifar100", "dataset.root=nowhere"], "dataset.root=", "cifar100 not found"),
    # README's examples, and the bad input of the tests of the config, the CLI, faults and presets
    (["dataset=imagenett"], "dataset='imagenett'", "choices: blobs, cifar10"),
    (["train.lr=-1"], "train.lr=-1.0", "(0.0, inf]"),
    (["train.lr=-0.1"], "train.lr=-0.1", "(0.0, inf]"),
    (["model=transformer"], "model='transformer'", "choices: cnn, inception"),
    (["train.batch_size=-3"], "train.batch_size=-3", "out of range"),
    (["+method=erm", "method.alpha=1"], "method.alpha", "unknown key"),
    (["dataset=nope"], "dataset='nope'", ("digits", "synthetic")),
    (["+method=nope"], "method='nope'", "erm"),
    (["+experiment=nope"], "experiment='nope'", "csot_digits"),
    (["+method=comixup", "method.thres_type=hardest"], "method.thres_type='hardest'", "hard, soft, none"),
    (["train.nope=1"], "train.nope", "epochs, batch_size"),
    (["train.epochs=many"], "train.epochs", "many"),
    (["train.optimizer=rmsprop"], "train.optimizer='rmsprop'", "sgd, adam"),
    (["dataset.label_noise.kind=weird"], "dataset.label_noise.kind='weird'", "symmetric, asymmetric"),
    (["seed=0,1", "dataset=digits,nope"], "dataset='nope'", "choices"),
    (["logger.mode=sometimes"], "logger.mode='sometimes'", "offline, online"),
    (["seed=-1"], "seed=-1 is out of range; must be in [0, 4294967295]", "[0, 4294967295]"),
    (["train.lr=nan"], "train.lr=nan: must be a finite number", "finite"),
    (["train.lr=inf"], "train.lr=inf: must be a finite number", "finite"),
    (["train.weight_decay=nan"], "train.weight_decay=nan: must be a finite number", "finite"),
    (["+method=csot", "method.m0=nan"], "method.m0=nan: must be a finite number", "finite"),
    (["+method=dbot", "method.delta=nan"], "method.delta=nan: must be a finite number", "finite"),
    (["dataset.label_noise.kind=symmetric", "dataset.label_noise.rate=nan"], "label_noise.rate=nan: must",
     "finite"),
    (["train.epochs=0"], "train.epochs=0 is out of range; must be in [1, inf]", "[1, inf]"),
    (["+method=pwc", "method.k=0"], "method.k=0 is out of range; must be in [1, inf]", "[1, inf]"),
    (["+method=dbot_cluster", "method.tau=2"], "method.tau=2.0 is out of range; must be in [0.0, 1.0)",
     "[0.0, 1.0)"),
    (["+method=dbot", "method.delta=1.5"], "method.delta=1.5 is out of range; must be in [0.0, 1.0)",
     "[0.0, 1.0)"),
    (["dataset.label_noise.rate=1.5"], "dataset.label_noise.rate=1.5 is out of range; must be in [0.0, 1.0]",
     "[0.0, 1.0]"),
    (["train.resume=sometimes"], "train.resume='sometimes' is not a valid choice; choose one of: auto, must",
     "auto, must"),
    (["train.checkpoint_every_minutes=-1"], "train.checkpoint_every_minutes=-1.0 is out of range",
     "out of range"),
    (["-m", "+method=dbot_cluster", "method.eps=interval(-1, 0.5)"], "method.eps=-1.0 is out of range",
     "out of range"),
    (["-m", "hydra/sweeper=optuna", "train.lr=tag(log, interval(0.01, inf))"], "train.lr=inf: must be a",
     "finite"),
    (["-m", "train.batch_size=32,0"], "train.batch_size=0 is out of range; must be in [1, inf]", "[1, inf]"),
    (["+method=comixup", "method.solver=magic"], "method.solver='magic'", "gco_swap"),
    (["+experiment=csot_digits", "method.budget=soon"], "method.budget='soon'", "paper, code"),
    (["+method=focal", "method.loss=magic"], "method.loss='magic'", "ce,"),
    (["+method=hier_hash", "method.tables=[test,magic]"], "method.tables='magic'", "not a valid choice"),
    # more of the same kind
    (["seed=abc"], "seed='abc'", "int"),
    (["train.epochs=1.5"], "train.epochs", "1.5"),
    (["hardware.precision=fp8"], "hardware.precision='fp8'", "fp32, fp16, bf16"),
    (["hardware.num_workers=-1"], "hardware.num_workers=-1", "[0, inf]"),
    (["hardware=tpu"], "hardware='tpu'", "auto, cpu"),
    (["hardware.compile=fast"], "hardware.compile='fast'", "default, reduce-overhead, max-autotune"),
    (["train.accumulate=many"], "train.accumulate='many'", "or auto"),
    (["logger.name=bogus"], "logger.name='bogus'", "wandb, none"),
    (["+debug=verbose"], "debug='verbose'", "smoke"),
    (["+debug=smoke", "debug.max_batches=0"], "debug.max_batches=0", "[1, inf]"),
    (["dataset.augment=flip"], "dataset.augment='flip'", "crop_flip"),
    (["dataset.val_fraction=1"], "dataset.val_fraction=1", "[0.0, 1.0)"),
    (["dataset.imbalance=0.5"], "dataset.imbalance=0.5", "[1.0, inf]"),
    (["dataset.epoch_samples=5"], "dataset.epoch_samples=5", "noisy_labels"),
    (["train.ema=1"], "train.ema=1", "[0.0, 1.0)"),
    (["train.accumulate=0"], "train.accumulate=0", "[1, inf]"),
    (["train.eval_every=0"], "train.eval_every=0", "[1, inf]"),
    (["train.schedule=linear"], "train.schedule='linear'", "cosine"),
    (["model.dropout=1"], "model.dropout=1", "[0.0, 1.0)"),
    (["+metric=test/acc:up"], "metric=test/acc:up", "max or min"),
    (["+experiment=csot_clothing1m"], "model.pretrained=required", "model.pretrained=none"),
    (["train.phases=[{epochs:1}]", "train.epochs=2", "train.schedule=none"], "train.phases", "epochs=2"),
    (["train.phases=[{epochs:2}]", "train.epochs=2"], "train.schedule='cosine'", "train.schedule=none"),
    (["train.phases=[{epochs:1,lr:[0.1]}]", "train.epochs=1", "train.schedule=none"], "train.phases.0.lr",
     "[start, end]"),
    # issue 50, single runs
    (["train.phases=[{epochs:1,image_size:16"], "train.phases=[{epochs:1,image_size:16",
     "its [ { are never closed; close them: train.phases=[{epochs:1,image_size:16}]"),
    (["train.log_every_s=0"], "train.log_every_s=0", "(0.0, inf]"),
    # issue 50: sweeps
    (["-m", "seed=0,0"], "seed=0,0 lists seed=0 twice", "the same job twice"),
    (["-m", "seed=0,1", "train.lr=0.1,0.05,1e-1"], "train.lr=0.1", "list each value once"),
    (["+sweep=erm"], "+sweep=erm", "add -m"),
]  # fmt: skip


def _in_process(args: list[str], with_stdout: bool = False) -> tuple[int, str]:
    """`runner ARGS` in this process: its exit code and what it wrote to stderr (and to stdout with it, in
    the order written, where `with_stdout`: log records and lines alike)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err if with_stdout else io.StringIO()):
        try:
            run_in_process(args)
            code = 0
        except SystemExit as stop:
            code = stop.code
    return code, err.getvalue()


def _own_lines(stderr: str) -> list[str]:
    """What a person reads on stderr besides log records."""
    return [line for line in stderr.splitlines() if line.strip() and not LOG_RECORD.match(line)]


def test_the_table_holds_sixty_bad_command_lines():
    assert len(BAD) >= 60 and len({tuple(args) for args, *_ in BAD}) == len(BAD)


def _kind_of_check(entry):
    """`make test`'s family of an entry (`quick_first`): a plain key's bound, a range or a finite number, is
    one check (`runner.checks`) whichever key it is on; an entry of a sweep and any other is its own."""
    args, _, says = entry
    bound = says == "finite" or re.fullmatch(r"out of range|[\[(][-\d.]+, ([-\d.]+|inf)[\])]", str(says))
    return ("bound", says == "finite") if bound and "-m" not in args else tuple(args)


@pytest.mark.parametrize("args,key,says", quick_first(BAD, _kind_of_check),
                         ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else "")  # fmt: skip
def test_a_bad_command_line_is_one_short_error_naming_its_key(tmp_path, monkeypatch, args, key, says):
    (tmp_path / "notes.txt").write_text("not weights\n")
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    code, stderr = _in_process([*args, "logger=none"])
    lines = _own_lines(stderr)
    assert code == 2 and "Traceback" not in stderr and len(lines) <= 3, stderr
    says = (says,) if isinstance(says, str) else says  # one fragment of the message, or several
    assert lines[-1].startswith("runner: error: ") and key in lines[-1], lines
    assert all(fragment in lines[-1] for fragment in says), lines
    assert sum(line.startswith("runner: ") for line in lines) == 1, lines  # the error, nothing else of ours
    assert not (tmp_path / "outputs").exists()  # refused before any run dir is made


def test_printing_a_config_needs_neither_its_data_nor_a_writable_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _in_process(["--cfg", "job", "+method=csot", "dataset=cifar100", "dataset.root=nowhere"]) == (
        0,
        "",
    )
    assert not (tmp_path / "outputs").exists()


def test_a_method_that_refuses_micro_batches_says_so_before_how_to_split_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, stderr = _in_process(["+method=comixup", "train.accumulate=3", "logger=none", "+debug=smoke"])
    assert code == 2 and "Traceback" not in stderr
    assert "train.accumulate=3: this method needs each whole batch in one pass" in _own_lines(stderr)[-1]


def test_phases_at_another_image_size_are_evaluated_at_the_last_ones(tmp_path, monkeypatch):
    """A CNN trained on digits upscaled to 16 px and evaluated at their own 8 px scored chance (0.10)."""
    monkeypatch.chdir(tmp_path)
    run = ["model=cnn", "train.phases=[{epochs:2,image_size:16}]", "train.epochs=2", "train.schedule=none",
           "logger=none", "train.progress=false", "hydra.run.dir=run"]  # fmt: skip
    assert _in_process(run)[0] == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test/acc"] > 0.5


def test_loader_workers_beyond_the_cores_are_capped_with_a_warning(caplog):
    cores = usable_cores()
    assert capped_workers(cores) == cores and not caplog.records
    assert capped_workers(300) == cores
    assert "hardware.num_workers=300: capped at" in caplog.text


# ------------------------------------------------------------------ the other commands' misleading lines


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    assert _in_process(["logger=none", "train.epochs=1", "model.hidden=[16]", f"hydra.run.dir={run}"])[0] == 0
    return run


def test_a_corrupt_checkpoint_is_named_as_corrupt_by_runner_eval_and_a_resume(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checkpoints" / "last.pt").write_bytes(b"\xab" * 3000)  # no pickle: an unknown opcode first
    with pytest.raises(SystemExit) as stop:
        runner_eval([str(run)])
    line = capsys.readouterr().err.strip()
    assert stop.value.code == 1 and line.startswith("runner-eval: error: cannot read checkpoint"), line
    assert "corrupt, or not a file torch.save wrote" in line and "does not fit" not in line
    code, stderr = _in_process(["logger=none", "train.epochs=2", "model.hidden=[16]", f"hydra.run.dir={run}"])
    (line,) = _own_lines(stderr)
    assert code == 1 and "corrupt, or not a file torch.save wrote" in line and "pickled objects" not in line


def test_runner_sync_on_a_missing_path_says_there_is_none(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        sync.main([str(tmp_path / "nope")])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == f"runner-sync: error: {tmp_path / 'nope'}: no such folder; " \
        "give the run dir of a run (outputs/DATE/TIME)"  # fmt: skip


@pytest.mark.parametrize("method,kernel,instead", [
    ("comixup", "grid_dp", "method.solver=gco_swap"),
    ("hier_hash", "hash_flow", "method.solver=assignment"),
])  # fmt: skip
def test_a_kernel_without_a_compiler_is_one_line_naming_the_python_solver(
    cli_here, monkeypatch, tmp_path, method, kernel, instead
):
    """The C kernels are built on first use; with no compiler the run says what to install or choose."""
    from runner.methods import _native, comixup, hier_hash

    loaded = (_native.load, comixup._native_dp, hier_hash._native_hash_flow)  # each caches its library
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    for cached in loaded:
        cached.cache_clear()
    try:
        proc = cli_here(f"+method={method}", "+debug=smoke", "logger=none", check=False)
    finally:
        for cached in loaded:
            cached.cache_clear()
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert _own_lines(proc.stderr) == [
        f"runner: error: {kernel}.c: no C compiler found ({tmp_path / 'no-such-cc'}) to build it; "
        f"install one (apt install gcc) or choose {instead}"
    ]


# ------------------------------------------------------------------------------------ Ctrl-C at any moment

RUNNER = Path(sys.executable).with_name("runner")  # the console script: its imports are part of a start


def _default_sigint():
    """SIGINT as a terminal gives it, in a child: a background job (as under CI) starts with it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupted_after(delay: float, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([str(RUNNER), *args], cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "WANDB_SILENT": "true"},
                            preexec_fn=_default_sigint)  # fmt: skip
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


DROPPED = """
import gc, sys, time
from runner.interrupts import handle_dropped_exceptions
handle_dropped_exceptions()
class _MultiProcessingDataLoaderIter:  # raises in its finalizer, which Python runs and drops
    def __del__(self):
        raise {error}
try:
    c = _MultiProcessingDataLoaderIter(); c.me = c; del c
    gc.collect()
    time.sleep({wait})  # a dropped interrupt comes back within 0.05 s, and ends the sleep
    print("went on")
except KeyboardInterrupt:
    print("stopped")
"""


@pytest.mark.parametrize("error,out,err", [
    ("KeyboardInterrupt", "stopped", ""),  # as when SIGINT lands in a callback of the garbage collector
    ("RuntimeError('DataLoader worker (pid 7) is killed by signal: Terminated. ')", "went on", ""),
    ("RuntimeError('another')", "went on", "RuntimeError: another"),
])  # fmt: skip
def test_exceptions_python_drops_stop_or_stay_quiet(error, out, err):
    """Python drops an exception raised in a finalizer ("Exception ignored ... Traceback"): the runner's
    hook sends SIGINT again, so the KeyboardInterrupt reaches the code that ends the command; a DataLoader
    worker killed by the stop signal says nothing more; any other error is printed as before."""
    wait = 30 if out == "stopped" else 0
    done = subprocess.run([sys.executable, "-c", DROPPED.format(error=error, wait=wait)], capture_output=True,
                          text=True, preexec_fn=_default_sigint)  # fmt: skip
    assert done.stdout.strip() == out and (err in done.stderr if err else done.stderr == ""), done.stderr


@pytest.mark.slow
@pytest.mark.skipif(not RUNNER.exists(), reason="no runner console script beside this Python")
@pytest.mark.parametrize(
    "args,delay",
    [(["train.epochs=60"], delay) for delay in (0.2, 1.0, 2.0, 4.0)]
    + [(["-m", "seed=0,1,2", "train.epochs=400"], delay) for delay in (2.0, 5.0, 8.0, 12.0)],
)
def test_ctrl_c_at_any_moment_is_one_line(tmp_path, args, delay):
    """From the imports (the first second or two) to the epochs, of a run or a sweep: one line, exit 130,
    no traceback, no table of a sweep's partial results."""
    proc = _interrupted_after(delay, [*args, "logger=none"], tmp_path)
    lines = [line for line in _own_lines(proc.stdout + proc.stderr) if not re.match(r"#\d+ done ", line)]
    assert proc.returncode == 130 and "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr
    assert lines[-1].startswith(("runner: interrupted", "runner: stopped by SIGINT; resume with: runner ")), (
        lines
    )
    assert "no sweep summary" not in proc.stderr and "| seeds |" not in proc.stdout


# ----------------------------------------------------------------------------------- read-only places

READ_ONLY_DRIVER = """
import contextlib, io, json, os, sys
from runner import report
from runner.cli import run_in_process
root = sys.argv[1]
def case(call):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            call()
            code = 0
        except SystemExit as e:
            code = e.code
    return [code, err.getvalue()]
out = [case(lambda: run_in_process(["logger=none", f"hydra.run.dir={root}/ro/run"]))]
os.chdir(f"{root}/ro")
out.append(case(lambda: run_in_process(["logger=none"])))
os.chdir(root)
out.append(case(lambda: run_in_process(["logger=none", "train.epochs=2", "model.hidden=[16]",
                                        f"hydra.run.dir={root}/run"])))
out.append(case(lambda: report.main([f"{root}/run", "--out", f"{root}/ro/report"])))
print(json.dumps(out))
"""


def _can_mount_read_only() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-rm", "true"], capture_output=True).returncode == 0  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(
    not _can_mount_read_only(), reason="needs unshare -rm (a user namespace) to mount read-only"
)
def test_read_only_places_are_one_line_naming_the_path(finished_run, tmp_path):
    """A read-only run dir, working directory, resumed run dir and --out of runner-report (a read-only
    mount: the suite may run as root, for whom a folder's mode bits stop nothing)."""
    shutil.copytree(finished_run, tmp_path / "run")
    (tmp_path / "ro").mkdir()
    saved = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    mounts = (f"mount -t tmpfs -o ro none {tmp_path}/ro && mount --bind {tmp_path}/run {tmp_path}/run && "
              f"mount -o remount,ro,bind {tmp_path}/run")  # fmt: skip
    (tmp_path / "driver.py").write_text(READ_ONLY_DRIVER)
    driver = f"{shlex.quote(sys.executable)} {tmp_path}/driver.py {tmp_path}"
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", f"{mounts} && {driver}"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "WANDB_SILENT": "true"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = [
        f"runner: error: hydra.run.dir={tmp_path}/ro/run: cannot write in {tmp_path}/ro (a read-only file",
        f"cannot write in {tmp_path}/ro (a read-only file system); give hydra.run.dir=",
        f"runner: error: hydra.run.dir={tmp_path}/run: cannot write in {tmp_path}/run (a read-only file",
        f"runner-report: error: cannot write {tmp_path}/ro/report (Read-only file system); give --out",
    ]
    for (code, stderr), says in zip(json.loads(proc.stdout.splitlines()[-1]), expected, strict=True):
        lines = _own_lines(stderr)
        assert code == 2 and "Traceback" not in stderr and len(lines) == 1 and says in lines[0], stderr
    assert {p: p.read_bytes() for p in saved} == saved  # the refused resume left its run as it was


# ------------------------------------------------------------------------ issue 50: single runs' edges


@pytest.fixture(scope="module")
def two_epoch_run(tmp_path_factory) -> tuple[Path, str]:
    """A finished 2-epoch run without a terminal, with the flags that do nothing on the CPU, and a progress
    line at every step (train.log_every_s at a microsecond); its dir and all it wrote."""
    run = tmp_path_factory.mktemp("two") / "run"
    code, out = _in_process(["logger=none", "train.epochs=2", "model.hidden=[16]", "hardware.cuda_graph=true",
                             "train.accumulate=auto", "train.log_every_s=0.000001",
                             f"hydra.run.dir={run}"], with_stdout=True)  # fmt: skip
    assert code == 0, out
    return run, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the flags do something on a CUDA device")
def test_the_flags_that_do_nothing_on_the_cpu_say_so_once(two_epoch_run):
    _, out = two_epoch_run
    assert out.count("hardware.cuda_graph=true does nothing on cpu: CUDA graphs need a CUDA device") == 1
    assert out.count("train.accumulate=auto does nothing on cpu: it sizes micro-batches to a GPU's") == 1


def test_without_a_terminal_an_epoch_logs_its_progress(two_epoch_run):
    _, out = two_epoch_run  # stdout a StringIO: no terminal, no bar
    lines = re.findall(r"epoch (\d)/2: step (\d+)/(\d+)  loss=[\d.]+  \d+ images/s  ends in ", out)
    assert {epoch for epoch, *_ in lines} == {"1", "2"} and any(step == steps for _, step, steps in lines)


def test_a_finished_run_started_with_fewer_epochs_says_what_it_holds_and_changes_nothing(two_epoch_run):
    run, _ = two_epoch_run
    saved = {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != "run.lock"}
    code, stderr = _in_process(["logger=none", "train.epochs=1", "model.hidden=[16]", f"hydra.run.dir={run}"])
    assert code == 2 and _own_lines(stderr) == [
        f"runner: error: train.epochs=1: {run} holds a finished run of 2 epochs; to train fewer, use another "
        f"run dir (hydra.run.dir=...); to evaluate it, runner-eval {run}"
    ]
    assert {p: p.read_bytes() for p in saved} == saved and len(saved) == len(
        [p for p in run.rglob("*") if p.is_file() and p.name != "run.lock"]
    )


def test_runner_eval_prints_its_metrics_before_a_write_that_fails(two_epoch_run, tmp_path, capsys):
    """Where the json cannot be written (here under a regular file, which even root cannot write in), the
    metrics are on stdout and the one error line names the path and --out."""
    run, _ = two_epoch_run
    (tmp_path / "file").write_text("a file, not a folder\n")
    with pytest.raises(SystemExit) as stop:
        runner_eval([str(run), "--out", str(tmp_path / "file" / "eval.json")])
    out, err = capsys.readouterr()
    assert stop.value.code == 1 and re.match(rf"runner-eval {run} \(.*\): .*test/acc=0\.\d{{4}}", out), out
    assert err == f"runner-eval: error: cannot write {tmp_path / 'file' / 'eval.json'} (Not a directory); " \
        "give --out PATH\n"  # fmt: skip
    runner_eval([str(run), "--out", str(tmp_path / "eval.json")])
    assert json.loads((tmp_path / "eval.json").read_text())["test/acc"] > 0.5


def test_runner_eval_of_a_corrupt_checkpoint_gives_an_evaluation_hint(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "checkpoints" / "last.pt").write_bytes(b"\xab" * 3000)
    with pytest.raises(SystemExit):
        runner_eval([str(run)])
    line = capsys.readouterr().err.strip()
    assert line.endswith("the file is kept: restore it from a copy of the run to evaluate it"), line
    assert "start the run over" not in line


def test_selecting_on_a_val_split_there_is_not_names_the_key_that_makes_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, stderr = _in_process(["logger=none", "train.epochs=1", "model.hidden=[16]",
                                "dataset.val_fraction=0", "train.select=best:val/acc"])  # fmt: skip
    (line,) = _own_lines(stderr)
    assert code == 2 and line.startswith("runner: error: train.select=best:val/acc: this run has no val")
    assert line.index("dataset.val_fraction=0.1") < line.index("best:test/acc"), line


def test_a_download_that_fails_says_so_with_its_url_and_where_the_files_go(tmp_path, monkeypatch):
    from urllib.error import URLError

    from torchvision.datasets import cifar

    def offline(url, *args, **kwargs):
        raise URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(cifar, "download_and_extract_archive", offline)
    monkeypatch.chdir(tmp_path)
    code, stderr = _in_process(["logger=none", "dataset=cifar10", "dataset.download=true",
                                f"dataset.root={tmp_path / 'data'}", "+debug=smoke"])  # fmt: skip
    (line,) = _own_lines(stderr)
    assert code == 2 and line.startswith(
        f"runner: error: dataset.download=true: the download of cifar10 from {cifar.CIFAR10.url} failed ("
    ), line
    assert line.endswith(f"extract it in {tmp_path / 'data'} (it holds cifar-10-batches-py/)")
    assert "run with dataset.download=true" not in line


@pytest.mark.slow  # a console-script start piped to a reader that quits: 14 s
@pytest.mark.skipif(not RUNNER.exists(), reason="no runner console script beside this Python")
def test_a_reader_that_goes_away_ends_the_output_quietly(tmp_path):
    """`runner print_config=true ... | head -3`: the run goes on and ends with its own exit code."""
    args = ["print_config=true", "logger=none", "train.epochs=1", "model.hidden=[16]", "hydra.run.dir=run"]
    proc = subprocess.Popen([str(RUNNER), *args], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "WANDB_SILENT": "true"})  # fmt: skip
    head = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()  # as head does after its lines
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 0 and err == "", err
    assert "config (validated):" in "".join(head) and (tmp_path / "run" / "summary.json").exists()


# ----------------------------------------------------------------------------------------- issue 50: sweeps


def test_a_metric_no_summary_holds_is_named_when_the_job_ends(tmp_path):
    """The keys a task reports are known only as it runs (tasks/ declares none): `+metric=bogus/acc` passes
    the preflight, and the job's end names it beside the keys there are, in a sweep too (where its result
    line was a KeyError that failed the job)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        run_in_process(["-m", "seed=0", "+metric=bogus/acc", "logger=none", "train.epochs=1",
                        "model.hidden=[16]", f"hydra.sweep.dir={tmp_path}"])  # fmt: skip
    assert "#0 done  seed=0" in out.getvalue() and "Traceback" not in err.getvalue(), err.getvalue()
    (log_file,) = (tmp_path / "0").glob("*.log")
    says = r"metric=bogus/acc is no key of this run's summary .*; its keys: .*test/acc"
    assert re.search(says, log_file.read_text())
