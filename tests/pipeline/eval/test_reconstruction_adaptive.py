"""reconstruction_adaptive: the sweep's crops, masks and states, each sequence at its adaptive depth."""
import sys
from pathlib import Path

import pytest
import torch

from conftest import HELDOUT_FASTA
from launchers.evaluate import read_sequences
from pipeline.eval.reconstruction import heldout_samples, reconstruction_adaptive, reconstruction_sweep
from pipeline.families import get_family

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from checkpoint_factory import tiny_config  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("recon"))
    torch.manual_seed(2)
    model = get_family(cfg.family).build_model(cfg.model).eval()
    samples = heldout_samples(read_sequences(HELDOUT_FASTA, "rna")[:24], get_family(cfg.family).make_transform(cfg), 0)
    return model, cfg, samples


def test_tol_zero_is_the_fixed_depth_sweep(setup):
    model, cfg, samples = setup
    fixed = reconstruction_sweep(model, cfg, samples, [4], batch_size=8)[4]
    adaptive = reconstruction_adaptive(model, cfg, samples, tol=0.0, max_depth=4, batch_size=8)
    assert adaptive["loss"] == pytest.approx(fixed["loss"], rel=1e-6) and adaptive["tokens"] == fixed["tokens"]
    assert adaptive["depths"] == [4] * len(samples) and adaptive["row_iterations"] == 4 * len(samples)


def test_a_loose_tolerance_stops_rows_early(setup):
    model, cfg, samples = setup
    out = reconstruction_adaptive(model, cfg, samples, tol=1e-3, max_depth=8, batch_size=8)
    assert out["row_iterations"] == sum(out["depths"]) < 8 * len(samples)
    assert len(out["depths"]) == len(samples) and min(out["depths"]) >= 1
