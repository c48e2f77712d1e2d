"""ProtLingo's routing override (paper 002, Fig. 4b's intervention: force a chosen expert at chosen MoE blocks for
chosen residues): it changes exactly the chosen residues' experts at the chosen block, leaves every earlier block and
every other residue of that block to the router, and without an override the forward is the unmodified one."""
import pytest
import torch

from pipeline.models.protlingo import ProtLingo, ProtLingoConfig, token_experts


def tiny(seed=0):
    cfg = ProtLingoConfig(d_model=32, n_layers=3, n_heads=4, d_ff=64, moe_layers=[0, 2], num_experts=4,
                          moe_shared_hidden=32, memory_layers=[1], memory_bits=2, memory_radius=1, memory_dim=4,
                          memory_latent=16, memory_table_size=125, router_init_std=1.0, attn_backend="sdpa")
    torch.manual_seed(seed)
    model = ProtLingo(cfg).eval()
    with torch.no_grad():  # non-zero memory tables, so that the memory changes what the later blocks see
        for mem in model.memory.values():
            mem.tables.normal_(0, 0.5)
    return model


def batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.full((2, 30), 1, dtype=torch.long)
    tokens[0, :30] = torch.cat([torch.tensor([0]), torch.randint(4, 24, (28,), generator=g), torch.tensor([2])])
    tokens[1, :21] = torch.cat([torch.tensor([0]), torch.randint(4, 24, (19,), generator=g), torch.tensor([2])])
    return tokens, tokens != 1


def experts(out, mask):
    return {i: token_experts(r, mask) for i, r in out.routing.items()}


def test_no_override_is_the_plain_forward_and_a_no_op_override_changes_nothing():
    model, (tokens, mask) = tiny(), batch()
    with torch.no_grad():
        plain = model(tokens, mask)
        base = experts(plain, mask)
        # the recorded experts are the router's top-1 on the FFN input (checked by hand on block 0)
        seen = {}
        hook = model.layers[0].ffn.register_forward_hook(lambda m, a, o: seen.update(x=a[0]))
        model(tokens, mask)
        hook.remove()
        logits = seen["x"].float() @ model.layers[0].ffn.router.weight.float().T  # [B, L, E]
        assert torch.equal(base[0][mask], logits.argmax(-1)[mask]) and (base[0][~mask] == -1).all()
        keep = {i: torch.full_like(tokens, -1) for i in (0, 2)}  # every position keeps the router's choice
        same = {i: torch.where(mask, base[i], -1) for i in (0, 2)}  # every position forced to its own top-1
        for override in (keep, same, {}):
            out = model(tokens, mask, route_override=override)
            assert torch.equal(out.logits, plain.logits)  # bit for bit
            assert all(torch.equal(a, b) for a, b in zip(experts(out, mask).values(), base.values()))


@pytest.mark.parametrize("block", [0, 2])
def test_override_changes_exactly_the_chosen_residues_experts(block):
    model, (tokens, mask) = tiny(), batch()
    with torch.no_grad():
        plain = model(tokens, mask)
        base = experts(plain, mask)
        chosen = torch.zeros_like(mask)
        chosen[0, [3, 7, 8, 20]] = True
        chosen[1, [1, 12]] = True
        forced = torch.where(chosen, (base[block] + 1) % 4, -1)  # an alternative expert for each chosen residue
        out = model(tokens, mask, route_override={block: forced})
        got = experts(out, mask)
    assert torch.equal(got[block][chosen], forced[chosen])  # the chosen residues run their forced expert
    assert torch.equal(got[block][~chosen], base[block][~chosen])  # every other position: the router's choice
    for i in got:
        if i < block:  # earlier blocks see the same input
            assert torch.equal(got[i], base[i])
    assert out.routing[block].counts.tolist() == torch.bincount(got[block][mask], minlength=4).tolist()
    assert not torch.equal(out.logits, plain.logits)  # the intervention changes the output


def test_override_errors_name_the_block():
    model, (tokens, mask) = tiny(), batch()
    with pytest.raises(ValueError, match=r"route_override: block 1 is not an MoE block \(model.moe_layers \[0, 2\]\)"):
        model(tokens, mask, route_override={1: torch.full_like(tokens, -1)})
    with pytest.raises(ValueError, match=r"route_override\[2\]: expert ids must be in -1..3"):
        model(tokens, mask, route_override={2: torch.full_like(tokens, 4)})
    with pytest.raises(ValueError, match=r"route_override\[0\]: an integer tensor of the tokens' shape \[2, 30\]"):
        model(tokens, mask, route_override={0: torch.zeros(2, 29, dtype=torch.long)})
