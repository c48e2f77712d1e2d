"""Exact token normalization (paper A.7) under real 2-process DeepSpeed, ZeRO 1-3, against single-process references."""
import pytest
import torch

from conftest import REPO, run_launch, torchrun
from pipeline.data.batch import Batch
from pipeline.objectives.eco_rna import per_row_ce, plan, relative_displacement
from pipeline.objectives.masking import IGNORE_INDEX
from token_norm_worker import initial_model, microbatches, run_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deepspeed_step(sample_shards, tmp_path_factory):
    """(stage, aux) -> the worker's step on 2 ranks: one launch per ZeRO stage makes the steps of both objectives
    (without the auxiliary losses and with them), which the two tests of that stage read."""
    done = {}

    def step(stage, aux):
        if stage not in done:
            out = tmp_path_factory.mktemp(f"z{stage}") / "steps.pt"
            # torchrun: the subject is the normalization, not the launcher (conftest.torchrun: half the runner's
            # start-up)
            cmd = torchrun(2, REPO / "tests/pipeline/token_norm_worker.py",
                           ["--stage", str(stage), "--shards", str(sample_shards), "--out", str(out)])
            proc = run_launch(cmd, timeout=300)
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            done[stage] = torch.load(out, weights_only=True)
        return done[stage][aux]
    return step


def plans_for(batches, cfg):
    """The plan each microbatch got in the worker: seeded by its origin (loader stream, index), whichever rank read it."""
    plans = [plan(b, cfg, step=0, stream=b.origin[0], index=b.origin[1]) for b in batches]
    for b, p in zip(batches, plans):  # drawn as the worker's loss draws it (on the CPU: the host stream)
        p.draw_state(cfg.model, b.attention_mask)
    return plans


def sgd_update(model, loss):
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return {n: (p - g).detach() for (n, p), g in zip(model.named_parameters(), grads)}


def concatenate(batches, plans, d_model):
    """One batch of all rows, padded to the longest: the single-process 'whole batch'."""
    L = max(b.input_ids.shape[1] for b in batches)
    pad = lambda t, v: torch.nn.functional.pad(t, (0, L - t.shape[1]), value=v)  # noqa: E731
    ids = torch.cat([pad(b.input_ids, 0) for b in batches])
    labels = torch.cat([pad(b.labels, IGNORE_INDEX) for b in batches])
    mask = torch.cat([pad(b.attention_mask, False) for b in batches])
    s0 = torch.cat([torch.nn.functional.pad(p.init_state, (0, 0, 0, L - p.init_state.shape[1])) for p in plans])
    return Batch(ids, labels, mask, []), torch.tensor([k for p in plans for k in p.depths]), s0


def assert_same_update(got, want):
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-6, worst


@pytest.fixture(scope="module")
def setup(sample_shards):
    cfg = run_config(aux=False)
    batches = microbatches(sample_shards, cfg)
    counts = [b.num_supervised for b in batches]
    assert len(set(counts)) > 1, counts  # unequal supervised-token counts
    return batches


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_global_token_mean(stage, setup, deepspeed_step):
    cfg = run_config(aux=False)
    batches = setup
    plans = plans_for(batches, cfg)
    # ranks draw different depths, so their local K_max differ (the engine syncs the core calls to the maximum)
    assert len({max(p.depths) for p in plans}) > 1
    model = initial_model(cfg)
    whole, depths, s0 = concatenate(batches, plans, cfg.model.d_model)
    logits = model(whole.input_ids, whole.attention_mask, depths, s0,
                   backward_window=cfg.objective.backward_window).logits
    ce, m = per_row_ce(logits, whole.labels)
    want = sgd_update(model, ce.sum() / m.sum())
    got = deepspeed_step(stage, aux=False)
    assert got["rec"]["supervised_tokens"] == int(m.sum())
    assert_same_update(got["state"], want)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_equation_A7_with_auxiliary_losses(stage, setup, deepspeed_step):
    """(1/Z_acc) sum_{r,b} (S_rb + m_rb A_rb), evaluated directly microbatch by microbatch in one process."""
    cfg = run_config(aux=True)
    obj = cfg.objective
    batches = setup
    plans = plans_for(batches, cfg)
    model = initial_model(cfg)
    Z = sum(b.num_supervised for b in batches)
    total = 0
    for b, p in zip(batches, plans):
        out = model(b.input_ids, b.attention_mask, p.depths, p.init_state, backward_window=obj.backward_window)
        ce, m_row = per_row_ce(out.logits, b.labels)
        S, m = ce.sum(), m_row.sum()
        depths = torch.tensor(p.depths)
        fp_rows = depths >= 2
        r = relative_displacement(out.state, out.prev_state, b.attention_mask, obj.eps_fp)
        L_fp = r[fp_rows].mean() if fp_rows.any() else S * 0
        with torch.no_grad():  # reference loss at K_a from a separate fixed-depth forward
            ref_ce, _ = per_row_ce(model(b.input_ids, b.attention_mask, obj.anchor_depth, p.init_state).logits,
                                   b.labels)
        elig = (depths > obj.anchor_depth) & (m_row > 0)
        hinge = torch.relu(ce[elig] / m_row[elig] - ref_ce[elig] / m_row[elig] - obj.anchor_margin)
        L_a = hinge.mean() if elig.any() else S * 0
        total = total + S + m * (obj.lambda_fp * L_fp + obj.lambda_anchor * L_a)
    want = sgd_update(model, total / Z)
    got = deepspeed_step(stage, aux=True)
    assert_same_update(got["state"], want)
