"""train.compile: blocks against eager, on both layouts: the same logits and gradients, no graph break, and a bounded
number of compiled graphs while the wavefront changes its row count and the batches their lengths
(pipeline/parallel/kernels.py). The packed layout runs with a token quantum (objective.token_buckets) and its
attention through the varlen_sdpa operator, so nothing host-only sits inside a compiled block (bench/compiled.py
counts the same over 100 real loader steps)."""
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from pipeline.families import get_family
from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state
from pipeline.parallel.kernels import RECOMPILE_LIMIT, apply_kernels, compiled_graphs


@pytest.mark.parametrize("unpad,quantum", [(False, None), (True, 16)])
def test_compiled_blocks_train_as_eager_with_bounded_recompiles(unpad, quantum):
    torch.manual_seed(0)
    cfg = EcoRNAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_prelude=1, n_core=2, n_coda=1, unpad=unpad,
                       attn_backend="sdpa")
    eager, compiled = EcoRNA(cfg), EcoRNA(cfg)
    compiled.load_state_dict(eager.state_dict())
    run = SimpleNamespace(train=SimpleNamespace(fused_norm=True, compile="blocks", cuda_graphs=False))
    apply_kernels(compiled, run, get_family("eco_rna").compiled)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    graphs, breaks = compiled_graphs(), sum(counters["graph_break"].values())
    g = torch.Generator().manual_seed(1)
    for B, L, depths in ((3, 9, [3, 1, 4]), (5, 14, [2, 2, 5, 1, 3]), (2, 6, [6, 2]), (6, 11, [1, 2, 3, 4, 5, 6])):
        mask = torch.arange(L)[None] < torch.randint(1, L + 1, (B, 1), generator=g)
        mask[0] = True
        tokens = torch.randint(6, 12, (B, L), generator=g)
        s0 = initial_state(cfg, mask, generator=g)
        outs = []
        for m in (compiled, eager):
            out = m(tokens, mask, torch.tensor(depths), s0, backward_window=2, anchor_depth=1, token_quantum=quantum)
            loss = (out.logits * torch.linspace(-1, 1, 23)).sum() + out.state.pow(2).mean()
            outs.append((out.logits, torch.autograd.grad(loss, list(m.parameters()))))
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
        for (name, _), a, b in zip(eager.named_parameters(), outs[0][1], outs[1][1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])
    built = compiled_graphs() - graphs
    # four batch shapes, row counts 1..6 at the core, grad and no-grad: dynamic shapes keep it to a few graphs
    assert 1 <= built < RECOMPILE_LIMIT, built
