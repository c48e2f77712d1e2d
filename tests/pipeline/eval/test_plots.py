"""pipeline/eval/plots.py: the y-range rule (tested on the pure function, not on pixels), the chance levels, and that
the depth and validation figures are written with no MLflow anywhere (an export, a run with tracking off)."""
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.eval import plots


def test_a_flat_loss_stays_flat():
    """The quickstart's depth sweep moves by 0.0003 nats from K = 1 to K = 8: drawn on min..max that is a cliff
    from the bottom of the panel to the top; the rule gives it at least 10 % of its level, so it fills < 1 %."""
    losses = [1.3412, 1.3410, 1.3409, 1.3409]
    lo, hi = plots.y_limits(losses, bounded=False)
    assert hi - lo >= plots.MIN_SPAN_REL * 1.341
    assert (max(losses) - min(losses)) / (hi - lo) < 0.01
    assert lo < min(losses) and hi > max(losses)


def test_a_real_change_keeps_its_own_range():
    """A loss falling from 3.2 to 0.1 nats needs no widening: the panel spans the data plus a 5 % margin."""
    lo, hi = plots.y_limits([3.2, 1.0, 0.1], bounded=False)
    assert lo == pytest.approx(0.1 - 0.05 * 3.1) and hi == pytest.approx(3.2 + 0.05 * 3.1)


def test_a_tiny_loss_gets_the_absolute_floor():
    """Near zero the relative rule gives nothing: the span is at least MIN_SPAN_ABS."""
    lo, hi = plots.y_limits([0.0010, 0.0012], bounded=False)
    assert hi - lo >= plots.MIN_SPAN_ABS


def test_accuracy_is_drawn_on_0_to_1_with_chance_inside():
    """Accuracy at 0.2 .. 0.25 is drawn against 0 .. 1, not stretched to fill the panel, and chance is in range."""
    lo, hi = plots.y_limits([0.20, 0.25], bounded=True, reference=0.2)
    assert lo <= 0.0 and hi >= 1.0 and hi - lo < 1.05
    assert plots.y_limits([-0.3, 0.5], bounded=True)[0] < -0.3  # a signed correlation widens it downwards
    assert plots.y_limits([1.30, 1.31], bounded=False, reference=1.609)[1] > 1.609  # chance loss kept in view


def test_non_finite_and_empty_values_do_not_break_the_rule():
    assert plots.y_limits([], bounded=False) == (0.0, 1.0)
    lo, hi = plots.y_limits([1.0, math.nan, math.inf], bounded=False)
    assert math.isfinite(lo) and math.isfinite(hi) and lo < 1.0 < hi


def test_bounded_names_and_panels():
    assert all(plots.is_bounded(c) for c in ("accuracy", "macro_accuracy", "AUC", "|MCC|", "|spearman|", "pass@5"))
    assert not plots.is_bounded("loss")
    assert plots.depth_panels(("K", "loss", "accuracy")) == ["accuracy", "loss"]
    assert plots.depth_panels(("K", "macro_accuracy", "anaphor_number_agreement")) == ["macro_accuracy"]
    assert plots.depth_panels(("K", "pass@5", "accuracy")) == ["pass@5"]


def test_chance_is_the_commonest_target_and_the_targets_entropy():
    """Five answers drawn equally often: 1/5 and ln 5, what the synthetic depth task's chance is."""
    c = plots.chance_levels([4, 5, 6, 7, 8] * 20)
    assert c["accuracy"] == pytest.approx(0.2) and c["loss"] == pytest.approx(math.log(5))
    assert plots.chance_levels([]) == {}


def test_the_depth_plot_is_written_without_mlflow(tmp_path):
    """launchers/evaluate.py draws OUT_STEM-vs-depth.png for every depth sweep before (and without) MLflow: a stub
    of a loaded export, which has no training run to log to."""
    from launchers.evaluate import depth_plot

    trained = SimpleNamespace(cfg=SimpleNamespace(family="eco_rna"), tag_dir=tmp_path / "export", client_state={})
    result = {"columns": ("K", "loss", "accuracy"), "sequences": 500, "seed": 0,
              "table": [(k, 1.6 - 0.4 * (k >= 3), 0.2 + 0.8 * (k >= 3)) for k in range(1, 9)],
              "chance": {"accuracy": 0.2, "loss": math.log(5)}}
    png = depth_plot(trained, "reconstruction", result, tmp_path / "eval-reconstruction.json", Path("heldout"))
    assert png == tmp_path / "eval-reconstruction-vs-depth.png"
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    no_depth = {"columns": ("masked", "loss", "perplexity", "accuracy"), "table": [(10, 1.0, 2.7, 0.5)]}
    assert depth_plot(trained, "mlm", no_depth, tmp_path / "eval-mlm.json", Path("x")) is None


def test_validation_png_holds_the_training_loss_and_is_skipped_without_a_loss(tmp_path):
    from pipeline.validation import plot_history

    history = [{"step": s, "val/loss_K1": 1.6, "val/loss_K3": 1.6 - s / 1000, "val/accuracy_K1": 0.2,
                "val/accuracy_K3": 0.2 + s / 1000} for s in (250, 500, 750)]
    train = [(s, 2.0 - s / 500) for s in range(1, 751)]
    path = plot_history(history, tmp_path / "validation.png", train, {"accuracy": 0.2, "loss": math.log(5)})
    assert path.stat().st_size > 10_000
    assert plot_history([{"step": 1, "val/seconds": 0.1}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
