"""The learning-rate schedule (pipeline/train/optim.py): its horizon, fixed at a run's first start, and its factor."""
import math

import pytest

from pipeline.config import load_config
from pipeline.train import lr_factor, lr_lambda, schedule_horizon


def test_horizon_follows_the_budget_the_run_has():
    assert schedule_horizon(load_config(None, ["train.max_steps=300"]), 1000) == {"unit": "steps", "total": 300}
    assert schedule_horizon(load_config(None, ["optim.schedule_steps=50"]), 1000) == {"unit": "steps", "total": 50}
    assert schedule_horizon(load_config(None, ["train.max_words=2000000"]), 1000) == {"unit": "words",
                                                                                       "total": 2000000}
    assert schedule_horizon(load_config(None, ["train.max_epochs=3"]), 1000) == {"unit": "samples", "total": 3000}


def test_factor_warms_up_then_decays_over_steps_to_the_floor_and_stays_there():
    cfg = load_config(None, ["optim.warmup_steps=10", "optim.min_lr_ratio=0.1", "train.max_steps=110"])
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(60) == pytest.approx(0.55)
    assert f(110) == pytest.approx(0.1) and f(10**6) == pytest.approx(0.1)  # extending a run: the floor, no jump


def test_a_word_budget_decays_by_words_consumed_not_by_steps():
    cfg = load_config(None, ["optim.warmup_steps=2", "optim.min_lr_ratio=0.0", "train.max_steps=100000",
                             "train.max_words=1000"])
    horizon = schedule_horizon(cfg, 1)
    at = lambda words: lr_factor(cfg.optim, horizon, 50, {"words": words})  # noqa: E731
    assert at(0) == pytest.approx(1.0)
    assert at(500) == pytest.approx(0.5)
    assert at(1000) == pytest.approx(0.0) and at(5000) == pytest.approx(0.0)
    assert lr_factor(cfg.optim, horizon, 1, {"words": 900}) == pytest.approx(1.0)  # warmup is in steps
    assert math.isclose(at(250), 0.5 * (1 + math.cos(math.pi / 4)))
