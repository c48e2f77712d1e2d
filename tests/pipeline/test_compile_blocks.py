"""train.compile: blocks against eager over 100 real loader steps, on both layouts (bench/compiled.py's COMPILE): the
shipped 80M config's rules (length windows, its token buckets on the packed layout) at a CPU-sized 2,048-token budget,
the SHAPES model. Forward, loss and backward each step: no graph break in the compiled regions (Family.compiled:
Eco-RNA's core step, prelude and readout; nothing host-only inside them: the packed layout's kernel inputs are made
outside, its CPU attention is one operator), graphs bounded by the token buckets while the batches change their
shapes at nearly every step, and the losses and gradients of eager to fp32 tolerance."""
import pytest

from bench import compiled as bench
from pipeline.parallel.kernels import RECOMPILE_LIMIT


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_compiled_regions_train_as_eager_over_100_loader_steps(layout, sample_shards):
    r = bench.compile_census(100, layout, shards=sample_shards)
    assert r["breaks"] == 0
    assert r["shapes"] > 3 * r["graphs"], r  # dynamic shapes: far fewer graphs than shapes
    assert 1 <= r["graphs"] <= r["buckets"] == 40 and r["graphs"] < 3 * 2 * RECOMPILE_LIMIT, r
    assert r["loss_diff"] < 1e-5 and r["grad_diff"] < 1e-4, r
