"""bench/step_proxies.py counts what it names: sync kinds one by one, a sync added inside the loss or after the loop,
one more block, the core shapes of a schedule known in advance, and the same counts on every run. Tiny model (the
counts do not depend on widths); no threshold on the 80M figures here (docs/performance.md has them)."""
import collections
import dataclasses

import pytest
import torch

from bench import step_proxies as sp
from pipeline.families import get_family

# 1 + 1 x K + 1 blocks, depths capped at 3 so that a step is cheap; the config's depth law and anchor kept.
TINY = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64", "model.n_prelude=1",
        "model.n_core=1", "model.n_coda=1", "objective.k_cap=3"]


# 2 microbatches of 4 rows x 32 tokens (one row padded): every path of the full-size batch, a quarter of the work
BATCH = dict(length=32, lengths=(32, 30, 24, 17))


def count(overrides=(), **kw):
    return sp.count_step(TINY + list(overrides), batch=BATCH, **kw)


@pytest.fixture(scope="module")
def base():
    return count(repeats=2)


def test_sync_kinds_counted_once_each():
    x = torch.arange(6.0)
    mask = x > 2
    counter = sp.StepCounter()
    with counter.counting():
        x.sum()  # no sync
        float(x.sum())  # _local_scalar_dense
        x[0].item()  # Tensor.item, counted once (not again as its _local_scalar_dense)
        x.tolist()
        x.numpy()
        torch.nonzero(mask)
        x[mask]  # index with a bool index (its nonzero is not dispatched to the mode)
        x[torch.tensor([0, 1])]  # integer index: no sync
        y = x.clone()
        y[mask] = 0.0  # index_put_ with a bool index
        torch.unique(x)
        torch.repeat_interleave(x, torch.tensor([1, 2, 1, 1, 1, 1]))
        torch.repeat_interleave(x, 2)  # repeats known on the host: no sync
    kinds = {}
    for ph in counter.syncs.values():
        for (kind, _site), n in ph.items():
            kinds[kind] = kinds.get(kind, 0) + n
    assert kinds == {"aten::_local_scalar_dense": 1, "Tensor.item": 1, "Tensor.tolist": 1, "Tensor.numpy": 1,
                     "aten::nonzero": 1, "aten::index[bool]": 1, "aten::index_put_[bool]": 1, "aten::_unique2": 1,
                     "aten::repeat_interleave": 1}
    # attributed to this file, the innermost frame outside torch
    assert all(site.startswith("tests/bench/test_step_proxies.py:") for ph in counter.syncs.values()
               for (_k, site) in ph)
    assert torch.Tensor.tolist is not None and "read" not in torch.Tensor.tolist.__name__  # patches undone


def test_counts_add_up_and_repeat(base):
    assert base["repeat_equal"]  # two consecutive steps on one engine (a fresh engine: the next test)
    # the split adds up, and each phase really has work
    assert base["ops_step"] == (base["ops_forward"] + base["ops_backward"] + base["ops_optimizer"]
                                + base["ops_other"])
    assert min(base["ops_forward"], base["ops_backward"], base["ops_optimizer"]) > 0
    assert base["ops_by_phase"]["forward"].get("aten::mm", 0) > 0
    assert base["ops_by_phase"]["backward"].get("aten::mm", 0) > 0
    assert 0 <= base["sync_micro"] < base["sync_step"]


def test_a_sync_in_the_loss_and_one_after_the_loop(base):
    fam = get_family("eco_rna")

    def loss(*a, **k):
        out = fam.loss(*a, **k)
        out.sum_loss.detach().item()  # one host read per microbatch, inside the loop
        return out

    def derive(rec):  # called once, after the loop (pipeline/train/step.py)
        torch.zeros(2).tolist()
        return {}

    assert fam.derive_metrics is None  # else the replacement below would drop the family's own syncs
    r = count(family=dataclasses.replace(fam, loss=loss, derive_metrics=derive))
    n_micro = r["config"]["grad_accum_steps"]
    # A fresh engine counts what the fixture's did, plus exactly the added calls: deterministic from run to run.
    for ph in ("pre", "backward", "optimizer", "loop"):
        assert r["ops_by_phase"][ph] == base["ops_by_phase"][ph], ph
    fwd = collections.Counter(base["ops_by_phase"]["forward"])
    fwd["aten::detach"] += n_micro  # the added line's .detach()
    fwd["aten::_local_scalar_dense"] += n_micro  # and its .item()'s own op
    assert r["ops_by_phase"]["forward"] == dict(fwd)
    end, base_end = collections.Counter(r["ops_by_phase"]["end"]), collections.Counter(base["ops_by_phase"]["end"])
    assert not base_end - end and set(end - base_end) <= {"aten::zeros", "aten::empty", "aten::zero_", "aten::fill_"}
    assert n_micro == 2
    assert r["sync_micro"] == base["sync_micro"] + n_micro
    assert r["sync_step"] == base["sync_step"] + n_micro + 1
    added = {k: n - base["sync_sites"].get(k, 0) for k, n in r["sync_sites"].items()
             if n != base["sync_sites"].get(k, 0)}
    assert sorted(added.values()) == [1, 2] and all(k.split(" @ ")[1].startswith("tests/bench/test_step_proxies.py:")
                                                    for k in added)


def test_one_more_block_adds_forward_and_backward_ops(base):
    r = count(["model.n_coda=2"])
    assert r["ops_forward"] > base["ops_forward"]
    assert r["ops_backward"] > base["ops_backward"]
    assert r["ops_optimizer"] > base["ops_optimizer"]  # DeepSpeed's per-parameter work: the block's parameters
    assert r["sync_step"] == base["sync_step"]  # a block adds no host read


# Small token budget and length windows, no loader workers: a few cheap steps of the real loader.
SHAPE_RUN = ["train.max_tokens_per_microbatch=1024", "data.length_window=64", "data.num_workers=0",
             "data.context_length=128", "model.d_model=16", "model.n_heads=2", "model.n_kv_heads=1",
             "model.d_ff=32"]


def test_core_shapes_follow_the_schedule(sample_shards):
    # Fixed depth 3, window 2: every microbatch [B, L] calls the core 3 times on all B rows, the first without grad
    # (outside the backward window), so the core sees exactly {(B, L, False), (B, L, True)} per batch shape, and
    # every attention call (prelude, core, coda, anchor readout of all rows) is [B, L].
    fixed = ["objective.depth_law=fixed", "objective.train_depth=3", "objective.backward_window=2"]
    s = sp.shape_census(3, SHAPE_RUN + fixed, shards=sample_shards)
    batches = set(s["batches"])
    assert len(s["batches"]) == s["microbatches"] == 3 and len(batches) > 1
    assert s["core"] == {(b, n, g) for b, n in batches for g in (False, True)}
    assert s["attention"] == batches
    assert s["core_calls"] == 3 * 3
    assert sp.core_shapes(3, SHAPE_RUN + fixed, shards=sample_shards) == s["core"]  # deterministic
    # The sampled depths of the config's law: rows enter the wavefront at different steps, so the core sees row
    # counts below the batch's (the shapes the GPU kernel re-plans for).
    law = sp.shape_census(3, SHAPE_RUN, shards=sample_shards)
    assert {(b, n) for b, n, _g in law["core"]} - set(law["batches"])
    assert len(law["core"]) > len(s["core"])


def test_the_80m_step_keeps_its_lean_figures():
    """CI's hold on the GPU step (no GPU here): the 80M config's training step, counted on its narrow twin.
    Measured 2026-12-04: 20,895 operators and 65 reads inside the microbatch loop before (commit 354b0c0); 14,691
    and 0 after the fused norm, the host-side plan and the lean RoPE (docs/performance.md). Fails when a device
    read comes back into the loop, and when the fused norm stops being one operator (train.fused_norm=false gives
    19,973: the switch is the difference)."""
    lean = sp.count_step(sites=False)
    assert lean["sync_micro"] == 0, lean["micro_sites"]
    assert lean["ops_step"] <= 15_000, lean["ops_step"]
    plain = sp.count_step(["train.fused_norm=false"], sites=False)
    assert plain["ops_step"] - lean["ops_step"] >= 4_000, (plain["ops_step"], lean["ops_step"])
