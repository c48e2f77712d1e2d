"""MegaBlocks' grouped dMoE path (pipeline/parallel/megablocks.py) against the reference ``UpcycledMoE``.

CPU: the weight layouts round-trip exactly and the fused layout computes the experts; the grouped path with torch
segment GEMMs ('loop', and torch's grouped_mm where this torch has it) equals the reference in outputs and every
gradient (fp32, 1e-6), straight-through router weight, padding and an expert without tokens included; the state dict
is untouched; backend resolution and errors on CPU; one ZeRO-3 SGD step of the grouped path equals the reference
(slow). GPU (marked, skipped without CUDA or MegaBlocks): the same comparison in bf16 with MegaBlocks' grouped GEMM,
an expert without tokens under a poisoned allocator, and MegaBlocks' own dMoE MLP fed the fused layout.

Run as a script, this file is the ZeRO-3 worker (``--zero3``).
"""
import argparse
import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from pipeline.models.protlingo import ProtLingo, ProtLingoConfig, UpcycledMoE  # noqa: E402
from pipeline.parallel import megablocks as mb  # noqa: E402

TORCH_GMM = pytest.mark.skipif(mb._TORCH_GROUPED_MM is None, reason="this torch has no grouped_mm")
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
EXACT = dict(rtol=1e-6, atol=1e-6)


def tiny_cfg(**kw) -> ProtLingoConfig:
    base = dict(d_model=16, n_layers=2, n_heads=2, d_ff=48, moe_layers=[0, 1], num_experts=4, attn_backend="sdpa")
    return ProtLingoConfig(**{**base, **kw})  # shared expert 24 hidden units, routed experts 24 each


def moe_pair(kernel: str, cfg=None, seed=0):
    """A reference UpcycledMoE (nn.Linear's default init: non-zero biases, a router that spreads tokens) and a deep
    copy of it on the grouped path."""
    torch.manual_seed(seed)
    ref = UpcycledMoE(cfg or tiny_cfg())
    return ref, mb.apply_megablocks(copy.deepcopy(ref), kernel)


def forward_backward(moe, x, mask, g):
    """y at real tokens, RoutingInfo, and the gradients of (y . g + L_aux + L_z) w.r.t. x and every parameter."""
    x = x.clone().requires_grad_()
    y, info = moe(x, mask)
    loss = (y.float() * g.float()).sum() + info.aux + info.z
    grads = torch.autograd.grad(loss, [x, *moe.parameters()])
    return y[mask], info, dict(zip(["x"] + [n for n, _ in moe.named_parameters()], grads))


# ---- weight layouts -------------------------------------------------------------------------------------------------
def test_fuse_unfuse_round_trip_is_exact():
    E, h, d = 3, 5, 4
    g = torch.Generator().manual_seed(0)
    fc1_w = [torch.randn(h, d, generator=g) for _ in range(E)]
    fc1_b = [torch.randn(h, generator=g) for _ in range(E)]
    fc2_w = [torch.randn(d, h, generator=g) for _ in range(E)]
    fused = mb.fuse_experts(fc1_w, fc1_b, fc2_w)
    assert fused["w1"].shape == (E * h, d) and fused["w2"].shape == (E * h, d) and fused["b1"].shape == (E, h)
    assert torch.equal(fused["w1"][h:2 * h], fc1_w[1]) and torch.equal(fused["w2"][2 * h:], fc2_w[2].t())
    back = mb.unfuse_experts(fused["w1"], fused["w2"], fused["b1"])
    for got, want in zip(back, (fc1_w, fc1_b, fc2_w)):
        assert len(got) == E and all(torch.equal(a, b) for a, b in zip(got, want))
    storages = {t.untyped_storage().data_ptr() for ts in back for t in ts}
    assert len(storages) == 3 * E  # no tensor is a view of the fused storage
    with pytest.raises(ValueError, match="w1 and w2"):
        mb.unfuse_experts(fused["w1"][:-1], fused["w2"], fused["b1"])


def test_fused_layout_computes_the_experts_as_megablocks_reads_it():
    """MegaBlocks' grouped MLP (and llm-foundry's torch dMoE) on the fused tensors: expert e's rows of
    w1.view(E, h, d) multiply x transposed, its rows of w2.view(E, h, d) plainly; with b1 added, that is the expert."""
    ref, _ = moe_pair("loop")
    experts = ref.experts
    E, h, d = len(experts), experts[0].fc1.out_features, experts[0].fc1.in_features
    fused = mb.fuse_experts([m.fc1.weight for m in experts], [m.fc1.bias for m in experts],
                            [m.fc2.weight for m in experts])
    x = torch.randn(7, d)
    for e in range(E):
        act = F.gelu(x @ fused["w1"].view(E, h, d)[e].t() + fused["b1"][e])
        torch.testing.assert_close(act @ fused["w2"].view(E, h, d)[e], experts[e](x), **EXACT)


def test_state_dict_round_trip_through_megablocks_layout_is_exact():
    torch.manual_seed(0)
    model = ProtLingo(tiny_cfg())
    sd = model.state_dict()
    fused = mb.state_dict_to_megablocks(sd)
    assert not any("deepspeed_experts" in k for k in fused)
    assert [k for k in fused if "experts.mlp." in k] == [
        f"layers.{i}.ffn.experts.mlp.{n}" for i in (0, 1) for n in ("w1", "w2", "b1")]
    assert fused["layers.1.ffn.experts.mlp.w1"].shape == (4 * 24, 16)
    back = mb.state_dict_from_megablocks(fused)
    assert list(back) == list(sd)  # same keys in the same order
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    ProtLingo(tiny_cfg()).load_state_dict(back, strict=True)


def test_state_dict_conversion_refuses_incomplete_layers():
    torch.manual_seed(0)
    sd = ProtLingo(tiny_cfg()).state_dict()
    broken = {k: v for k, v in sd.items() if k != "layers.0.ffn.deepspeed_moe.experts.deepspeed_experts.2.fc1.bias"}
    with pytest.raises(ValueError, match="incomplete \\[2\\]"):
        mb.state_dict_to_megablocks(broken)
    gap = {k: v for k, v in sd.items() if ".deepspeed_experts.1." not in k}
    with pytest.raises(ValueError, match="experts \\[0, 2, 3\\]"):
        mb.state_dict_to_megablocks(gap)
    fused = mb.state_dict_to_megablocks(sd)
    del fused["layers.1.ffn.experts.mlp.b1"]
    with pytest.raises(ValueError, match="w1, w2 and b1"):
        mb.state_dict_from_megablocks(fused)


# ---- the grouped path on CPU ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["loop", pytest.param("torch", marks=TORCH_GMM)])
def test_grouped_path_equals_reference_in_outputs_and_gradients(kernel):
    """Whole UpcycledMoE forward (routing, straight-through weight, shared expert, losses) on 2 x 30 tokens with
    padding: outputs, the input gradient and every parameter's gradient (router included) agree to 1e-6 in fp32."""
    ref, grouped = moe_pair(kernel)
    x = torch.randn(2, 30, 16)
    mask = torch.arange(30)[None] < torch.tensor([[30], [19]])
    g = torch.randn(2, 30, 16)
    y_r, info_r, grads_r = forward_backward(ref, x, mask, g)
    y_g, info_g, grads_g = forward_backward(grouped, x, mask, g)
    assert torch.all(info_r.counts > 0), info_r.counts  # every expert has tokens: every segment is exercised
    assert torch.equal(info_g.counts, info_r.counts)
    torch.testing.assert_close(y_g, y_r, **EXACT)
    torch.testing.assert_close(info_g.aux, info_r.aux, **EXACT)
    assert grads_g.keys() == grads_r.keys()
    for name in grads_r:
        assert grads_r[name].abs().max() > 0, name  # the comparison below is not between zeros
        torch.testing.assert_close(grads_g[name], grads_r[name], **EXACT, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kernel", ["loop", pytest.param("torch", marks=TORCH_GMM)])
def test_expert_without_tokens_and_unsorted_ids(kernel):
    """compute_experts with ids that skip expert 1 and arrive interleaved: same rows as the reference, and expert
    1's gradient is exactly zero (present, not None, as the reference's)."""
    ref, grouped = moe_pair(kernel)
    x = torch.randn(11, 16)
    expert = torch.tensor([3, 0, 2, 0, 3, 3, 2, 0, 0, 2, 3])
    outs, grads = [], []
    for m in (ref, grouped):
        out = m.compute_experts(x, expert)
        outs.append(out)
        grads.append(torch.autograd.grad((out * torch.arange(16.0)).sum(), list(m.experts.parameters())))
    torch.testing.assert_close(outs[1], outs[0], **EXACT)
    for (name, _), a, b in zip(ref.experts.named_parameters(), grads[1], grads[0]):
        torch.testing.assert_close(a, b, **EXACT)
        if name.startswith("1."):
            assert torch.all(a == 0), name


def test_no_tokens_gives_zero_gradients_like_the_reference():
    """A rank or microbatch without real tokens: [0, d] out, every expert parameter gets a zero gradient."""
    ref, grouped = moe_pair("loop")
    for m in (ref, grouped):
        out = m.compute_experts(torch.zeros(0, 16), torch.zeros(0, dtype=torch.long))
        assert out.shape == (0, 16)
        grads = torch.autograd.grad(out.sum(), list(m.experts.parameters()))
        assert all(gr is not None and torch.all(gr == 0) for gr in grads)


def test_expert_ids_out_of_range_are_an_error():
    _, grouped = moe_pair("loop")
    with pytest.raises(ValueError, match="must lie in \\[0, 4\\), got 4"):
        grouped.compute_experts(torch.randn(3, 16), torch.tensor([0, 4, 1]))


# ---- apply_megablocks -----------------------------------------------------------------------------------------------
def test_apply_megablocks_keeps_parameters_state_dict_and_type():
    """Converting between the paths is the identity: same parameter objects, names and state dict; a reference model's
    state dict loads into the grouped one and gives the same logits."""
    torch.manual_seed(0)
    model = ProtLingo(tiny_cfg())
    params = dict(model.named_parameters())
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert mb.apply_megablocks(model, "loop") is model
    assert dict(model.named_parameters()) == params  # the very same tensors
    assert model.state_dict().keys() == sd.keys() and all(torch.equal(model.state_dict()[k], sd[k]) for k in sd)
    moes = [m for m in model.modules() if isinstance(m, UpcycledMoE)]
    assert len(moes) == 2 and all(type(m) is mb.GroupedUpcycledMoE and m.expert_kernel == "loop" for m in moes)
    assert "expert_kernel='loop'" in repr(model)
    # the ZeRO-3 bookkeeping (with DeepSpeed installed): every routed-expert parameter is an external parameter of its
    # MoE module
    if importlib.util.find_spec("deepspeed") is not None:
        for m in moes:
            assert {id(p) for p in m.deepspeed_moe.parameters()} <= set(getattr(m, "_external_params", {}))

    torch.manual_seed(1)
    reference = ProtLingo(tiny_cfg())
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(4, 24, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.bool)
    torch.testing.assert_close(model(tokens, mask).logits, reference(tokens, mask).logits, **EXACT)
    copied = copy.deepcopy(model)  # the engine and the tests deep-copy models
    assert type(copied.layers[0].ffn) is mb.GroupedUpcycledMoE
    mb.apply_megablocks(model, "loop")  # twice: still the same module
    assert type(model.layers[0].ffn) is mb.GroupedUpcycledMoE


def test_apply_megablocks_refuses_another_compute_experts():
    ref, _ = moe_pair("loop")
    ref.compute_experts = lambda x, expert: x  # what another execution path would have installed
    with pytest.raises(TypeError, match="already has another compute_experts"):
        mb.apply_megablocks(ref, "loop")

    class Subclassed(UpcycledMoE):
        pass

    with pytest.raises(TypeError, match="Subclassed"):
        mb.apply_megablocks(nn.Sequential(Subclassed(tiny_cfg())), "loop")
    with pytest.raises(ValueError, match="kernel"):
        mb.apply_megablocks(nn.Sequential(), "sparse")


def test_apply_megablocks_turns_off_megablocks_gradient_scale():
    """A MegaBlocks MLP inside the model keeps its 1/ep gradient scale unless told otherwise: apply_megablocks sets
    it to None (DeepSpeed already divides expert gradients by the whole data-parallel size)."""

    class GroupedMLP(nn.Module):  # stands in for megablocks.layers.mlp.GroupedMLP under expert parallelism
        def __init__(self):
            super().__init__()
            self.gradient_scale = 0.5

    GroupedMLP.__module__ = "megablocks.layers.mlp"
    model = nn.Sequential(UpcycledMoE(tiny_cfg()), GroupedMLP())
    mb.apply_megablocks(model, "loop")
    assert model[1].gradient_scale is None


# ---- backend resolution without CUDA --------------------------------------------------------------------------------
@CPU_ONLY
def test_resolve_moe_backend_on_cpu():
    assert mb.megablocks_unavailable().startswith("needs a CUDA device")
    assert mb.resolve_moe_backend("auto") == "torch"
    assert mb.resolve_moe_backend("torch") == "torch"
    with pytest.raises(mb.MegaBlocksUnavailable, match="model.moe_backend: megablocks needs a CUDA device"):
        mb.resolve_moe_backend("megablocks")
    with pytest.raises(ValueError, match="must be one of"):
        mb.resolve_moe_backend("sparse")


def test_resolve_moe_backend_where_megablocks_runs(monkeypatch):
    """The dtype rule, with MegaBlocks made to look available: auto keeps the reference outside bf16, megablocks
    refuses it."""
    monkeypatch.setattr(mb, "megablocks_unavailable", lambda: None)
    assert mb.resolve_moe_backend("auto") == "megablocks"
    assert mb.resolve_moe_backend("auto", torch.bfloat16) == "megablocks"
    assert mb.resolve_moe_backend("auto", torch.float32) == "torch"
    assert mb.resolve_moe_backend("megablocks", torch.bfloat16) == "megablocks"
    with pytest.raises(ValueError, match="bf16 only"):
        mb.resolve_moe_backend("megablocks", torch.float32)
    assert mb.resolve_moe_backend("torch") == "torch"


def test_auto_picks_torchs_grouped_gemm_on_cuda_without_megablocks(monkeypatch):
    """No MegaBlocks, a CUDA device (made to look present) and bf16: auto runs torch's grouped GEMM, not the per-expert
    loop; in fp32, under expert parallelism or without grouped_mm it keeps the reference."""
    monkeypatch.setattr(mb, "megablocks_unavailable", lambda: "is not installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mb, "_TORCH_GROUPED_MM", lambda *a, **k: None)
    assert mb.resolve_moe_backend("auto", torch.bfloat16) == "grouped"
    assert mb.resolve_moe_backend("auto", torch.float32) == "torch"
    assert mb.resolve_moe_backend("auto", torch.bfloat16, expert_parallel=True) == "torch"
    assert mb.resolve_moe_backend("grouped", torch.float32) == "grouped"
    monkeypatch.setattr(mb, "_TORCH_GROUPED_MM", None)
    assert mb.resolve_moe_backend("auto", torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="grouped needs torch's grouped_mm"):
        mb.resolve_moe_backend("grouped")


@CPU_ONLY
def test_megablocks_on_cpu_is_a_clear_error():
    model = ProtLingo(tiny_cfg())
    with pytest.raises(mb.MegaBlocksUnavailable, match="needs a CUDA device.*model.moe_backend: torch"):
        mb.apply_megablocks(model)
    assert type(model.layers[0].ffn) is UpcycledMoE  # nothing was changed
    with pytest.raises(ValueError, match="bf16 CUDA tensors, got tokens torch.float32 on cpu"):
        mb.grouped_experts(torch.randn(3, 16), torch.tensor([0, 1, 2]), model.layers[0].ffn.experts)


# ---- under DeepSpeed ZeRO-3 (the experts are read outside their own forward) ----------------------------------------
def zero3_worker(out: str, backend: str):
    """One SGD step (lr 1) of a tiny ProtLingo under ZeRO-3 in one gloo process; saves the gathered parameters."""
    import deepspeed
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=0, world_size=1)
    model, batch = zero3_model_and_batch()
    if backend != "torch":
        mb.apply_megablocks(model, backend)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=ds)
    engine.backward(zero3_loss(engine, *batch))
    engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        torch.save({n: p.detach().clone() for n, p in engine.module.named_parameters()}, out)


def zero3_model_and_batch():
    torch.manual_seed(0)
    model = ProtLingo(tiny_cfg(router_init_std=1.0))  # a spread-out router: every expert gets tokens
    tokens = torch.randint(4, 24, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.arange(20)[None] < torch.tensor([[20], [13]])
    return model, (tokens, mask)


def zero3_loss(model, tokens, mask):
    out = model(tokens, mask)
    return F.cross_entropy(out.logits[mask], tokens[mask]) + 0.1 * out.moe_aux + 0.01 * out.moe_z


@pytest.mark.slow
def test_grouped_path_under_zero3_equals_reference(tmp_path):
    """ZeRO-3 (persistence threshold 0: every parameter partitioned) gathers a module's own parameters when its
    forward runs; the grouped path reads the experts' from UpcycledMoE.forward without calling them. One step of both
    paths under ZeRO-3 equals one plain SGD step of the reference (p - grad): gathered, and no gradient scaled."""
    model, batch = zero3_model_and_batch()
    loss = zero3_loss(model, *batch)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    want = {n: (p - g).detach() for (n, p), g in zip(model.named_parameters(), grads)}
    assert all(g.abs().max() > 0 for (n, _), g in zip(model.named_parameters(), grads) if "deepspeed_experts" in n)
    from conftest import free_port, launch_env

    for backend in ("torch", "loop"):
        out = tmp_path / f"{backend}.pt"
        env = {**launch_env(), "MASTER_PORT": str(free_port()), "MASTER_ADDR": "127.0.0.1", "RANK": "0",
               "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        proc = subprocess.run([sys.executable, __file__, "--zero3", str(out), "--backend", backend], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        got = torch.load(out, weights_only=True)
        assert got.keys() == want.keys()
        worst = max((got[k] - want[k]).abs().max().item() for k in want)
        assert worst <= 1e-6, (backend, worst)


# ---- GPU: MegaBlocks' kernels ---------------------------------------------------------------------------------------
def gpu_kernel_or_skip(kernel: str):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if kernel == "grouped_gemm" and mb.megablocks_unavailable():
        pytest.skip(f"MegaBlocks {mb.megablocks_unavailable()}")
    if kernel == "torch" and mb._TORCH_GROUPED_MM is None:
        pytest.skip("this torch has no grouped_mm")


def relative_error(a, b) -> float:
    """bf16 gradients are compared by their relative error in norm (elementwise bounds do not suit bf16 rounding)."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["grouped_gemm", "torch"])
def test_megablocks_matches_reference_in_bf16_on_gpu(kernel):
    """E = 4, d = 256, 512 hidden units per routed expert, 4 x 1024 positions of which 3624 real, bf16, the whole
    UpcycledMoE with its straight-through router weight: outputs within 1e-2 (llm-foundry's dMoE tolerance), every
    gradient within 1e-2 relative error in norm."""
    gpu_kernel_or_skip(kernel)
    cfg = ProtLingoConfig(d_model=256, n_heads=4, n_layers=1, d_ff=1024, moe_layers=[0], num_experts=4)
    torch.manual_seed(0)
    ref = UpcycledMoE(cfg).cuda().bfloat16()
    grouped = mb.apply_megablocks(copy.deepcopy(ref), kernel)
    x = torch.randn(4, 1024, 256, device="cuda", dtype=torch.bfloat16)
    mask = torch.arange(1024, device="cuda")[None] < torch.tensor([[1024], [900], [700], [1000]], device="cuda")
    g = torch.randn_like(x)
    y_r, info_r, grads_r = forward_backward(ref, x, mask, g)
    y_g, info_g, grads_g = forward_backward(grouped, x, mask, g)
    assert torch.all(info_r.counts > 0) and torch.equal(info_g.counts, info_r.counts)
    torch.testing.assert_close(y_g.float(), y_r.float(), rtol=1e-2, atol=1e-2)
    errors = {n: relative_error(grads_g[n], grads_r[n]) for n in grads_r}
    assert max(errors.values()) < 1e-2, errors


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["grouped_gemm", "torch"])
def test_expert_without_tokens_has_zero_gradient_on_gpu(kernel):
    """grouped_gemm's own weight-gradient buffer is torch.empty and the kernel skips empty groups. With the caching
    allocator first filled with NaN blocks of that size, expert 3 (no token) must still get exactly 0."""
    gpu_kernel_or_skip(kernel)
    ref, grouped = (m.cuda().bfloat16() for m in moe_pair(kernel, tiny_cfg(d_model=256, d_ff=1024, n_heads=4)))
    for _ in range(4):  # poison: blocks the size of a stacked weight gradient, freed full of NaN
        torch.full((4, 512, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
    expert = torch.randint(0, 3, (2048,), device="cuda")
    grads = []
    for m in (ref, grouped):
        out = m.compute_experts(x, expert)
        grads.append(torch.autograd.grad(out.float().square().sum(), list(m.experts.parameters())))
    for (name, _), a, b in zip(ref.experts.named_parameters(), grads[1], grads[0]):
        assert torch.isfinite(a).all(), name
        if name.startswith("3."):
            assert torch.all(a == 0), name
        else:
            assert relative_error(a, b) < 1e-2, (name, relative_error(a, b))


@pytest.mark.gpu
def test_fused_layout_in_megablocks_own_dmoe_mlp_on_gpu():
    """MegaBlocks' own ParallelDroplessMLP (mlp_impl='grouped', bf16, no expert parallelism: gradient_scale None)
    loaded with ``fuse_experts`` of our experts (b1 = 0: MegaBlocks has no input bias) gives our experts' outputs,
    and ``fuse_experts`` of our gradients equals its w1/w2 gradients."""
    gpu_kernel_or_skip("grouped_gemm")
    from functools import partial

    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import ParallelDroplessMLP

    d, h, E, T = 256, 512, 4, 2048
    ref, _ = moe_pair("loop", tiny_cfg(d_model=d, d_ff=2 * h, n_heads=4))
    ref = ref.cuda().bfloat16()
    with torch.no_grad():
        for m in ref.experts:
            m.fc1.bias.zero_()
    args = Arguments(hidden_size=d, ffn_hidden_size=h, moe_num_experts=E, moe_top_k=1, mlp_type="mlp",
                     mlp_impl="grouped", bf16=True, fp16=False, bias=False, return_bias=False,
                     activation_fn=partial(F.gelu, approximate="none"), moe_loss_weight=0.0,
                     device=torch.device("cuda"))
    dmlp = ParallelDroplessMLP(args)
    assert dmlp.mlp.gradient_scale is None
    fused = mb.fuse_experts([m.fc1.weight for m in ref.experts], [m.fc1.bias for m in ref.experts],
                            [m.fc2.weight for m in ref.experts])
    with torch.no_grad():
        dmlp.mlp.w1.copy_(fused["w1"])
        dmlp.mlp.w2.copy_(fused["w2"])
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    expert = torch.randint(0, E, (T,), device="cuda")
    out_mb, _ = dmlp.forward_once(x, torch.ones(T, 1, device="cuda", dtype=torch.bfloat16), expert[:, None])
    out_ref = ref.compute_experts(x, expert)
    torch.testing.assert_close(out_mb.float(), out_ref.float(), rtol=1e-2, atol=1e-2)
    g = torch.randn_like(out_ref)
    gw1, gw2 = torch.autograd.grad((out_mb * g).sum(), [dmlp.mlp.w1, dmlp.mlp.w2])
    grads = dict(zip([n for n, _ in ref.experts.named_parameters()],
                     torch.autograd.grad((out_ref * g).sum(), list(ref.experts.parameters()))))
    want = mb.fuse_experts(*([grads[f"{e}.{p}"] for e in range(E)] for p in ("fc1.weight", "fc1.bias", "fc2.weight")))
    assert relative_error(gw1, want["w1"]) < 1e-2 and relative_error(gw2, want["w2"]) < 1e-2


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="ZeRO-3 worker of test_grouped_path_under_zero3_equals_reference")
    p.add_argument("--zero3", required=True, metavar="OUT")
    p.add_argument("--backend", choices=["torch", "loop"], required=True)
    a = p.parse_args()
    zero3_worker(a.zero3, a.backend)
