"""The fused RMSNorm operator (pipeline/models/norm_op.py) against the plain autograd formula it replaces."""
import random

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


# ---- against the formula itself, in float64 ---------------------------------------------------------------------
# rms_norm_reference shares the operator's fp32 steps (and, on the CPU, its code path); these tests hold the operator
# to the definition instead: y = x / sqrt(mean(x^2) + eps) * w computed by hand in float64, its gradients by float64
# autograd. Tolerances as docs/gpu_check.md gives them: fp32 arithmetic far under 1e-3 relative in norm, bf16 (one
# rounding of each output) under 1e-2.
EPS = 1e-6
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def float64_formula(x: torch.Tensor, w: torch.Tensor, up: torch.Tensor, eps: float):
    """(y, dL/dx, dL/dw) of L = sum(y * up), all in float64, from the formula alone (no code of norm_op)."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    y64 = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps) * w64
    dx, dw = torch.autograd.grad((y64 * up.detach().double()).sum(), (x64, w64))
    return y64.detach(), dx, dw


def check_against_float64(device: str, dtype: torch.dtype, shape: tuple, seed: int) -> None:
    """norm_op.rms_norm forward and backward on ``device`` against float64_formula, on random rows whose scales
    span 1e-4 to 1e2 (at the small end mean(x^2) is below eps, so eps counts)."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = 10 ** (torch.rand(*shape[:-1], 1, generator=g, device=device) * 6 - 4)
    x = ((torch.randn(shape, generator=g, device=device) + 0.3) * scale).to(dtype).requires_grad_()
    w = (torch.rand(shape[-1], generator=g, device=device) * 1.5 + 0.25).to(dtype).requires_grad_()
    up = torch.randn(shape, generator=g, device=device).to(dtype)
    y = norm_op.rms_norm(x, w, EPS)
    dx, dw = torch.autograd.grad((y.float() * up.float()).sum(), (x, w))
    want = float64_formula(x, w, up, EPS)
    for what, got, ref in zip(("y", "dx", "dw"), (y, dx, dw), want):
        assert got.dtype == dtype and got.shape == ref.shape, (what, got.dtype, got.shape)
        assert torch.isfinite(got).all(), f"{what}: not finite (seed {seed})"
        err = ((got.double() - ref).norm() / ref.norm()).item()
        assert err < TOL[dtype], f"{what}: relative error {err:.2e} >= {TOL[dtype]:.0e} ({dtype}, {shape}, seed {seed})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_the_float64_formula_on_cpu(dtype):
    """The CPU path (the formula in fp32 inside the operator) against float64."""
    check_against_float64("cpu", dtype, (3, 37, 96), seed=5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(8, 512, 768), (4096, 12, 64)], ids=["hidden", "qk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_on_cuda_against_the_float64_formula(dtype, shape):
    """torch's fused RMSNorm kernels (aten::_fused_rms_norm and its backward), as training runs them on CUDA, against
    float64 on fresh random inputs: Eco-RNA's hidden norm (d 768) and its QK-norm (head dim 64)."""
    x = torch.empty(1, 8, device="cuda", dtype=dtype)
    assert norm_op._use_fused(x, torch.empty(8, device="cuda", dtype=dtype)), \
        "this torch has no aten::_fused_rms_norm on CUDA: training runs the plain formula in the operator"
    check_against_float64("cuda", dtype, shape, seed=random.SystemRandom().randrange(2**31))
