"""Every trainable parameter of every family learns: after one SGD step on a real microbatch (so that zero-initialized
parts, the memory tables and their convolution, have left zero), the family's own loss on the next microbatches gives
each parameter a finite, non-zero gradient. The few that by design get none are listed with the reason. Caught by
this test: a memory lookup that detaches its tables, a state detached between core applications, a head or an
embedding cut off from the loss.

The configs and shards are the golden ones (tests/golden): each family's tiny config on committed real data."""
import fnmatch

import pytest
import torch

from golden.cases import CASES, REPO
from pipeline.config import load_config
from pipeline.data.loader import ShardStream
from pipeline.families import get_family

# family -> parameters (fnmatch patterns) that get no gradient by design, with the reason
NO_GRADIENT = {
    "protlingo": {"memory.*.W_q.weight": "the memory's addresses read q = W_q h_bar only through the thresholds "
                                         "[q > 0] (Eq. 3-4): a step function, no gradient reaches W_q"},
}
FAMILY_CASE = {"eco_rna": "eco_rna_zero2", "protlingo": "protlingo_zero2", "recursive_gpt": "recursive_gpt_zero2",
               "standard_gpt": "standard_zero2"}


# A third, dense block after ProtLingo's two MoE blocks: a routed expert of the last block learns only from the
# supervised tokens sent to it (its output reaches no other position), and in a tiny model one expert of it may
# get only <cls> and <eos>, whose output no loss reads.
EXTRA = {"protlingo": ["model.n_layers=3"]}


def setup(family: str):
    """(run config, model, family, five real microbatches) of the family's golden case."""
    config, _, overrides = CASES[FAMILY_CASE[family]]
    cfg = load_config(REPO / config, [o if not o.startswith("data.train_shards=") else
                                      f"data.train_shards={REPO / o.split('=', 1)[1]}" for o in overrides]
                      + EXTRA.get(family, []))
    fam = get_family(cfg.family)
    torch.manual_seed(0)
    model = fam.build_model(cfg.model)
    stream = ShardStream(cfg.data.train_shards, rank=0, world_size=1, num_workers=0, micro_batch_size=4, seed=3,
                         transform=fam.make_transform(cfg), pad_id=fam.pad_id)
    it = iter(stream)
    return cfg, model, fam, [next(it) for _ in range(5)]


def loss_of(fam, model, cfg, batch, index):
    """The family's loss per supervised token, as the engine normalizes it (a sum would make the first step's router
    update large enough to send every token to one expert)."""
    out = fam.loss(model, batch, cfg, fam.plan(batch, cfg, step=index, stream=0, index=index))
    return out.sum_loss / out.num_tokens


@pytest.mark.parametrize("family", sorted(FAMILY_CASE))
def test_every_trainable_parameter_gets_a_gradient(family):
    cfg, model, fam, (first, *rest) = setup(family)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_of(fam, model, cfg, first, 0).backward()
    opt.step()
    opt.zero_grad()
    # Four microbatches accumulated: an expert may get few tokens in one microbatch of a tiny model.
    for i, batch in enumerate(rest, 1):
        loss_of(fam, model, cfg, batch, i).backward()
    exempt = NO_GRADIENT.get(family, {})
    missing, nonfinite, zero = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        by_design = any(fnmatch.fnmatch(name, pat) for pat in exempt)
        if p.grad is None or not p.grad.abs().sum():
            if not by_design:
                (missing if p.grad is None else zero).append(name)
            continue
        assert not by_design, f"{name} now gets a gradient: drop it from NO_GRADIENT ({family})"
        if not torch.isfinite(p.grad).all():
            nonfinite.append(name)
    assert (missing, zero, nonfinite) == ([], [], []), family
    for pat in exempt:  # every listed exemption names a parameter that exists
        assert any(fnmatch.fnmatch(n, pat) for n, _ in model.named_parameters()), pat
