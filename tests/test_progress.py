"""An epoch's progress without a terminal (`runner.progress`), on a fake clock: when lines come, what
they say, and the one-time hint of a GPU preset started on the CPU."""

import logging

import pytest

from runner.progress import EpochProgress


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _steps(progress: EpochProgress, clock: FakeClock, seconds_per_step: float, steps: range, images=32):
    for step in steps:
        clock.now += seconds_per_step
        progress.step(step, images, loss=2.5)


def test_a_line_every_log_every_s_names_step_loss_speed_and_end(caplog):
    clock = FakeClock()
    progress = EpochProgress("epoch 1/3", 0, 100, 30.0, lines=True, hint_slow=False, told=set(), clock=clock)
    with caplog.at_level(logging.INFO, "runner.progress"):
        _steps(progress, clock, 4.0, range(20))  # 80 s: lines after 32 s (step 8) and 64 s (step 16)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    # step 8 of 100 after 32 s at 32 images per 4 s: 8 images/s, 92 steps of 4 s left
    assert lines[0].startswith("epoch 1/3: step 8/100  loss=2.5000  8 images/s  ends in 6.1 min ("), lines
    assert lines[1].startswith("epoch 1/3: step 16/100  loss=2.5000  8 images/s  ends in 5.6 min ("), lines


def test_a_resumed_epoch_estimates_from_its_own_steps(caplog):
    clock = FakeClock()
    progress = EpochProgress("epoch 2/3", 50, 100, 10.0, lines=True, hint_slow=False, told=set(), clock=clock)
    with caplog.at_level(logging.INFO, "runner.progress"):
        _steps(progress, clock, 5.0, range(50, 52))  # 2 steps in 10 s, 48 left: 240 s
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("epoch 2/3: step 52/100  loss=2.5000  6 images/s  ends in 4.0 min ("), line


def test_no_lines_where_the_bar_shows(caplog):
    clock = FakeClock()
    progress = EpochProgress("epoch 1/3", 0, 100, 1.0, lines=False, hint_slow=False, told=set(), clock=clock)
    with caplog.at_level(logging.INFO, "runner.progress"):
        _steps(progress, clock, 4.0, range(100))
    assert not caplog.records


@pytest.mark.parametrize("seconds_per_step,hinted", [(40.0, True), (30.0, False)])
def test_a_first_epoch_over_an_hour_on_the_cpu_names_debug_smoke_once(caplog, seconds_per_step, hinted):
    told: set = set()
    clock = FakeClock()
    with caplog.at_level(logging.INFO, "runner.progress"):
        for epoch in range(2):  # the second epoch, as slow, says nothing more
            progress = EpochProgress(f"epoch {epoch + 1}/2", 0, 100, 30.0, lines=False, hint_slow=True,
                                     told=told, clock=clock)  # fmt: skip
            _steps(progress, clock, seconds_per_step, range(3))
    hints = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # 100 steps of 40 s: 4000 s > 3600 s; of 30 s: 3000 s, under the hour
    assert hints == (["epoch 1/2 is estimated at 1.1 h on the CPU: this is a GPU preset; try it with "
                      "+debug=smoke (a few batches), or on a GPU"] if hinted else [])  # fmt: skip
