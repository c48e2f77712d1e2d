"""The console's elapsed time and ETA (pipeline/train/callbacks.py, Console): the duration format and the estimate to
whichever limit (train.max_steps, max_words, max_epochs, max_hours) ends the run first."""
import time
from types import SimpleNamespace

import pytest

from pipeline.train.callbacks import Console, duration, estimate_remaining


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (42.4, "42s"), (59.6, "1m00s"), (62, "1m02s"), (190, "3m10s"),
                                           (3599, "59m59s"), (3600, "1h00m"), (7380, "2h03m"),
                                           (4 * 86400 + 5 * 3600, "4d05h"), (-3, "0s")])
def test_duration(seconds, text):
    assert duration(seconds) == text


def test_the_estimate_follows_the_pace_and_the_first_limit_reached():
    # 10 steps in 60 s, 90 left: 540 s
    assert estimate_remaining(60.0, {"train.max_steps": (10, 90)}) == (540.0, "train.max_steps")
    # the word budget is 3/4 spent after those 10 steps: it ends the run first
    assert estimate_remaining(60.0, {"train.max_steps": (10, 90), "train.max_words": (750, 250)}) == (
        20.0, "train.max_words")
    # a deadline (seconds, no pace) closer than the steps' end wins; a farther one does not
    assert estimate_remaining(60.0, {"train.max_steps": (10, 90), "train.max_hours": (None, 100.0)}) == (
        100.0, "train.max_hours")
    assert estimate_remaining(60.0, {"train.max_steps": (10, 90), "train.max_hours": (None, 1e6)})[1] == \
        "train.max_steps"
    assert estimate_remaining(60.0, {"train.max_steps": (10, 0)}) == (0.0, "train.max_steps")  # the last step
    assert estimate_remaining(60.0, {"train.max_hours": (None, -5.0)}) == (0.0, "train.max_hours")
    assert estimate_remaining(0.0, {"train.max_words": (0, 100)}) is None  # nothing done yet: no pace


def fake_trainer(step=0, max_steps=100, max_words=None, words=0.0, deadline=None):
    train = SimpleNamespace(max_steps=max_steps, max_words=max_words, max_epochs=None)
    return SimpleNamespace(cfg=SimpleNamespace(train=train),
                           state=SimpleNamespace(step=step, cumulative={"words": words}),
                           stop=SimpleNamespace(deadline=deadline), plan=SimpleNamespace(dataset_samples=1000))


def test_the_console_line_ends_with_elapsed_and_eta_of_this_attempt():
    console, trainer = Console(), fake_trainer(step=20)  # resumed at step 20
    console.on_fit_start(trainer)
    console.started -= 62.0  # 62 s into this attempt
    trainer.state.step = 30  # 10 steps in 62 s, 70 left: 434 s
    assert console.timing(trainer) == "elapsed 1m02s eta 7m14s"
    trainer.cfg.train.max_words, trainer.state.cumulative["words"] = 2000, 1000.0  # the words: 62 s more
    assert console.timing(trainer) == "elapsed 1m02s eta 1m02s (train.max_words)"
    trainer.cfg.train.max_words, trainer.stop.deadline = None, time.monotonic() + 30.4  # train.max_hours comes first
    assert console.timing(trainer) == "elapsed 1m02s eta 30s (train.max_hours)"


def test_the_console_still_closes_the_run_with_the_summary(capsys, monkeypatch):
    from pipeline.train import callbacks

    console, trainer = Console(), fake_trainer(step=3)
    console.on_fit_start(trainer)
    trainer.state.step, trainer.rank = 7, 0
    monkeypatch.setattr(callbacks, "run_summary", lambda t, status, steps, seconds: f"==== {status}: {steps} steps ====")
    console.on_fit_end(trainer, "FINISHED")
    assert capsys.readouterr().out == "==== FINISHED: 4 steps ====\n"
