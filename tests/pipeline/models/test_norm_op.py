"""The fused RMSNorm operator (pipeline/models/norm_op.py) against the plain autograd formula it replaces."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.models import norm_op
from pipeline.models.layers import RMSNorm, set_fused_norms
from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig, initial_state


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_and_backward_equal_the_reference(dtype):
    """Forward bit-identical (same fp32 formula, same order); gradients of x and of the weight equal autograd's of
    the reference up to rounding, the weight's summed over rows as when one norm is applied at every core call."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=g) * 3 + 1).to(dtype).requires_grad_()
    w = (torch.rand(16, generator=g) + 0.5).to(dtype).requires_grad_()
    up = torch.randn(3, 5, 16, generator=g).to(dtype)
    y = norm_op.rms_norm(x, w, 1e-6)
    y_ref = norm_op.rms_norm_reference(x, w, 1e-6)
    assert y.dtype == dtype and torch.equal(y, y_ref)
    got = torch.autograd.grad((y.float() * up.float()).sum(), (x, w))
    want = torch.autograd.grad((y_ref.float() * up.float()).sum(), (x, w))
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


def test_one_operator_each_way():
    """What the fusion is for: one dispatched operator forward and one backward (the plain formula: 8 and more)."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    with Ops() as fused:
        norm_op.rms_norm(x, w, 1e-6).sum().backward()
    with Ops() as plain:
        norm_op.rms_norm_reference(x, w, 1e-6).sum().backward()
    assert fused.names.count("bioseq.rms_norm") == 1 and fused.names.count("bioseq.rms_norm_backward") == 1
    assert len(fused.names) < len(plain.names) - 10, (fused.names, plain.names)


def test_a_model_with_fused_norms_trains_as_the_plain_one():
    """Eco-RNA with every RMSNorm fused (the default) against set_fused_norms(model, False), same weights: the same
    logits and the same gradient of every parameter (the core's norms are applied once per iteration)."""
    torch.manual_seed(0)
    cfg = EcoRNAConfig(d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_prelude=1, n_core=2, n_coda=1)
    fused, plain = EcoRNA(cfg), EcoRNA(cfg)
    plain.load_state_dict(fused.state_dict())
    set_fused_norms(plain, False)
    assert all(m.fused for m in fused.modules() if isinstance(m, RMSNorm))
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(9)[None] < torch.tensor([[9], [6], [2]])
    tokens = torch.randint(6, 12, (3, 9), generator=g)
    s0 = initial_state(cfg, mask, generator=g)
    grads = []
    for m in (fused, plain):
        out = m(tokens, mask, torch.tensor([3, 1, 4]), s0, backward_window=2)
        loss = (out.logits * torch.linspace(-1, 1, 23)).sum() + out.state.pow(2).mean()
        grads.append((out.logits, torch.autograd.grad(loss, list(m.parameters()))))
    assert torch.equal(grads[0][0], grads[1][0])
    for (name, _), a, b in zip(fused.named_parameters(), grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_registering_twice_reuses_the_operator():
    """An export's shipped copy of norm_op imported into a process that already has the operator."""
    assert norm_op._register()[0] is torch.ops.bioseq.rms_norm
