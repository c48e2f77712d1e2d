"""MegaBlocks' grouped dMoE execution of ProtLingo's routed experts (``model.moe_backend: megablocks``), and the
conversions between the reference expert layout and MegaBlocks' fused one.

What runs in place of ``UpcycledMoE.compute_experts`` (routing, the straight-through weight and the losses stay in
the reference module; T tokens, d model width, h hidden units per routed expert, E experts):

    counts = bincount(expert, E)                                      [E]     tokens per expert (MegaBlocks: histogram)
    order  = argsort(expert, stable)                                  [T]     tokens grouped by expert (sort)
    xs     = x[order]                                                 [T, d]  (gather)
    hs     = gmm(xs, W1, counts) + b1[expert[order]]                  [T, h]  W1 = stack_e fc1_e.weight  [E, h, d]
    ys     = gmm(gelu_erf(hs), W2, counts)                            [T, d]  W2 = stack_e fc2_e.weight  [E, d, h]
    out[order] = ys                                                   [T, d]  (scatter, weights 1)

``gmm(a, W, counts)`` multiplies the ``counts[e]`` consecutive rows of expert e by ``W[e]^T`` (nn.Linear's layout, the
``trans_b`` form). With ``kernel='grouped_gemm'`` (what ``apply_megablocks`` uses) it is MegaBlocks' grouped GEMM, the
kernel ``megablocks.layers.mlp.GroupedMLP`` calls for ``mlp_impl='grouped'`` (grouped_gemm's, bf16 on CUDA only);
``'torch'`` is ``torch.nn.functional.grouped_mm``; ``'loop'`` is one ``torch.mm`` per expert segment, the CPU path the
tests run. Everything but the GEMM is the same code on every kernel, so the CPU tests check the sorting, unsorting
and bias logic that the GPU runs, and the GPU test only swaps the kernel in.

Why this and not MegaBlocks' ``dMoE`` module (docs/architecture.md, "MegaBlocks under DeepSpeed" and "GPU kernels"):
- The per-expert parameters stay the source of truth. ``torch.stack`` in the forward is differentiable (its backward
  hands each expert its slice of the grouped weight gradient), so the state dict, DeepSpeed's
  ``deepspeed_experts.<e>`` checkpoint files and the reference path keep one layout; DeepSpeed crashes on fused keys
  such as ``experts.mlp.w1``. The price is one copy of the routed weights per forward (2*E*h*d elements: 6.6 M, 13 MB in
  bf16 for ESM2-150M's MoE layer, against 4*T*d*h FLOPs of routed GEMMs).
- MegaBlocks' module brings its own router, loss lists in module globals, an expert-parallel group read at
  construction and a 1/ep gradient scale (``megablocks.layers.mlp``: right for FSDP, wrong under DeepSpeed, which
  already divides expert gradients by the whole data-parallel size). Calling the kernel on our own parameters brings
  none of them: no gradient scale is ever applied, and ``apply_megablocks`` also sets ``gradient_scale = None`` on any
  MegaBlocks MLP module it finds in the model.
- MegaBlocks' experts have no input bias: b1 is added after the first grouped GEMM, one row of b1 per sorted token.
- The permutation uses torch ops (argsort, index_select, index_copy) rather than MegaBlocks' Triton gather/scatter:
  a permutation is exact either way, and this keeps the CPU test on the code the GPU runs.
- grouped_gemm allocates its weight gradient with ``torch.empty``, and the slice of an expert that got no token may
  stay unwritten (tgale96/grouped_gemm issue 36; MegaBlocks' own dMoE calls it so); ``_GroupedGemm`` hands the
  kernel a zeroed buffer instead, so such an expert's gradient is exactly 0, as on the reference path.

``import megablocks`` fails without CUDA, so nothing here imports it at module level: importing this file works on
CPU, and asking for MegaBlocks there raises ``MegaBlocksUnavailable`` naming the reason.
"""
from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.protlingo import MOE_BACKENDS, UpcycledMoE

KERNELS = ("grouped_gemm", "torch", "loop")
# torch's grouped GEMM (2D tokens x 3D weights, int32 end offsets); public as F.grouped_mm in recent releases.
_TORCH_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_GG_BACKEND = None  # grouped_gemm.backend, once MegaBlocks has imported


class MegaBlocksUnavailable(RuntimeError):
    """MegaBlocks was asked for where it cannot run (no CUDA, not installed, its CUDA ops not built)."""


def megablocks_unavailable() -> str | None:
    """Why MegaBlocks' grouped dMoE cannot run in this process, or None when it can."""
    if not torch.cuda.is_available():
        return ("needs a CUDA device (torch sees none; import megablocks fails without its CUDA ops, and there is no "
                "CPU path)")
    try:
        import megablocks  # noqa: F401  (loads its compiled megablocks_ops)
        from megablocks import grouped_gemm_util
    except Exception as e:  # ImportError, or an extension built for another torch failing to load
        return (f"is not importable ({type(e).__name__}: {e}); build it with bash scripts/install_gpu_kernels.sh on "
                "a CUDA host")
    if not grouped_gemm_util.grouped_gemm_is_available():
        return ("imports, but grouped_gemm (its mlp_impl='grouped' kernel) does not; build it with "
                "bash scripts/install_gpu_kernels.sh")
    return None


def resolve_moe_backend(requested: str, dtype: torch.dtype | None = None, expert_parallel: bool = False) -> str:
    """``model.moe_backend`` -> 'torch' | 'grouped' | 'megablocks'. ``auto``: MegaBlocks when it can run here (CUDA,
    megablocks and grouped_gemm import) and the training dtype, when given, is bf16 (its grouped GEMM's only dtype);
    else torch's grouped GEMM ('grouped', ``grouped_experts`` with kernel 'torch') on CUDA in bf16 without expert
    parallelism; else the reference. ``megablocks`` where it cannot run raises MegaBlocksUnavailable (ValueError for
    a non-bf16 dtype); ``grouped`` without torch's grouped_mm a ValueError."""
    if requested not in MOE_BACKENDS:
        raise ValueError(f"model.moe_backend: must be one of {MOE_BACKENDS}, got {requested!r}")
    if requested == "torch":
        return "torch"
    if requested == "grouped":
        if _TORCH_GROUPED_MM is None:
            raise ValueError(f"model.moe_backend: grouped needs torch's grouped_mm, which torch {torch.__version__} "
                             "lacks; set model.moe_backend: torch")
        return "grouped"
    why = megablocks_unavailable()
    bf16 = dtype is None or dtype == torch.bfloat16
    if requested == "megablocks":
        if why:
            raise MegaBlocksUnavailable(f"model.moe_backend: megablocks {why}; or set model.moe_backend: torch")
        if not bf16:
            raise ValueError(f"model.moe_backend: megablocks runs MegaBlocks' grouped GEMM, which is bf16 only, and "
                             f"training runs in {dtype}; enable bf16 or set model.moe_backend: torch")
        return "megablocks"
    if why is None and bf16:
        return "megablocks"
    grouped = _TORCH_GROUPED_MM is not None and torch.cuda.is_available() and dtype == torch.bfloat16
    return "grouped" if grouped and not expert_parallel else "torch"


def _grouped_gemm_backend():
    """grouped_gemm.backend as MegaBlocks imports it (``megablocks.grouped_gemm_util.backend``)."""
    global _GG_BACKEND
    if _GG_BACKEND is None:
        why = megablocks_unavailable()
        if why:
            raise MegaBlocksUnavailable(f"MegaBlocks {why}; or set model.moe_backend: torch")
        from megablocks import grouped_gemm_util

        _GG_BACKEND = grouped_gemm_util.backend
    return _GG_BACKEND


# ------------------------------------------------------------------------------------------------------------------
# The segment GEMM and the grouped expert computation
# ------------------------------------------------------------------------------------------------------------------
class _GroupedGemm(torch.autograd.Function):
    """grouped_gemm's ``ops.GroupedGemm`` (MegaBlocks' ``gg.ops.gmm``), except that the weight gradient is written
    into a zeroed buffer: grouped_gemm's own is ``torch.empty``, and a group without rows may leave its slice unwritten.

    a [T, k] bf16 CUDA, rows grouped; b [E, n, k] if trans_b else [E, k, n]; batch_sizes [E] int64 on the CPU."""

    @staticmethod
    def forward(ctx, a, b, batch_sizes, trans_b):
        ctx.save_for_backward(a, b, batch_sizes)
        ctx.trans_b = trans_b
        return _grouped_gemm_backend().gmm(a, b, batch_sizes, trans_a=False, trans_b=trans_b)

    @staticmethod
    def backward(ctx, grad):
        backend = _grouped_gemm_backend()
        grad = grad.contiguous()
        a, b, batch_sizes = ctx.saved_tensors
        da = db = None
        if ctx.needs_input_grad[0]:  # [T, k]
            da = backend.gmm(grad, b, batch_sizes, trans_a=False, trans_b=not ctx.trans_b)
        if ctx.needs_input_grad[1]:  # [E, n, k] (trans_b) or [E, k, n]: per group lhs^T rhs
            lhs, rhs = (grad, a) if ctx.trans_b else (a, grad)
            db = backend.gmm(lhs, rhs, batch_sizes, trans_a=True, trans_b=False, c=torch.zeros_like(b))
        return da, db, None, None


def segment_gemm(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, kernel: str) -> torch.Tensor:
    """a [T, n_in] with the rows of expert e at [sum(counts[:e]), sum(counts[:e+1])), w [E, n_out, n_in] (stacked
    nn.Linear weights) -> [T, n_out], row t of expert e = a_t @ w[e]^T. counts [E] int64, on the CPU for
    "grouped_gemm" and "loop", on a's device for "torch"."""
    if kernel == "grouped_gemm":
        return _GroupedGemm.apply(a, w, counts, True)
    if kernel == "torch":
        offs = counts.cumsum(0).to(device=a.device, dtype=torch.int32)  # end row of each group
        return _TORCH_GROUPED_MM(a, w.transpose(1, 2), offs=offs)
    if kernel == "loop":
        return torch.cat([seg @ w_e.t() for seg, w_e in zip(a.split(counts.tolist()), w.unbind(0))])
    raise ValueError(f"kernel: must be one of {KERNELS}, got {kernel!r}")


def _check_kernel(kernel: str, x: torch.Tensor | None = None, weight: torch.Tensor | None = None):
    """A clear error before a kernel meets inputs it cannot take."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: must be one of {KERNELS}, got {kernel!r}")
    if kernel == "torch" and _TORCH_GROUPED_MM is None:
        raise RuntimeError(f"kernel 'torch': torch {torch.__version__} has no grouped_mm; use 'grouped_gemm' or "
                           "'loop'")
    if kernel == "grouped_gemm" and x is not None:
        if not x.is_cuda or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            raise ValueError(f"moe_backend megablocks: MegaBlocks' grouped GEMM takes bf16 CUDA tensors, got tokens "
                             f"{x.dtype} on {x.device} and experts {weight.dtype}; run the model in bf16 on CUDA or "
                             "set model.moe_backend: torch")


def grouped_experts(x: torch.Tensor, expert: torch.Tensor, experts: Sequence[nn.Module],
                    kernel: str = "grouped_gemm") -> torch.Tensor:
    """x [T, d], expert [T] long in [0, E) -> routed_{expert_t}(x_t) [T, d], the experts (ProtLingo ``FFN``s: fc1
    with bias, erf GELU, fc2 without bias) run as one grouped GEMM per layer over tokens sorted by expert. Same
    function as ``UpcycledMoE.compute_experts``; usable on any list of local experts (local ids)."""
    E = len(experts)
    if any(m.fc2.bias is not None for m in experts):
        raise ValueError("grouped_experts: routed experts have no output bias (it is the shared expert's)")
    w1 = torch.stack([m.fc1.weight for m in experts])  # [E, h, d]
    b1 = torch.stack([m.fc1.bias for m in experts])  # [E, h]
    w2 = torch.stack([m.fc2.weight for m in experts])  # [E, d, h]
    _check_kernel(kernel, x, w1)
    if x.shape[0] == 0:
        kernel = "loop"  # no rows: the loop's empty products still give every expert a zero gradient, as the reference
    if kernel == "torch":  # tokens per expert on the device (bincount's size would need the largest id on the host)
        counts = torch.zeros(E, dtype=torch.long, device=x.device).index_add_(0, expert, torch.ones_like(expert))
    else:  # MegaBlocks' grouped GEMM and the loop take the group sizes on the host (one sync, as MegaBlocks' own)
        counts = torch.bincount(expert, minlength=E).cpu()
        if counts.numel() != E:
            raise ValueError(f"grouped_experts: expert ids must lie in [0, {E}), got {int(expert.max())}")
    order = torch.argsort(expert, stable=True)  # [T]
    xs = x.index_select(0, order)  # [T, d], contiguous
    # b1 per sorted row [T, h], gathered from an fp32 copy: the backward's index_add then sums each expert's rows in
    # fp32 (as nn.Linear's bias gradient does) and rounds once, where a bf16 index_add would round at every row. No
    # host-side group sizes: torch's grouped GEMM takes its offsets on the device, so the layer reads nothing back.
    bias = b1.float().index_select(0, expert.index_select(0, order)).to(xs.dtype)
    hs = segment_gemm(xs, w1, counts, kernel) + bias  # [T, h]
    ys = segment_gemm(F.gelu(hs), w2, counts, kernel)  # [T, d]
    return torch.zeros_like(ys).index_copy(0, order, ys)  # back to token order: out[order[i]] = ys[i]


class GroupedUpcycledMoE(UpcycledMoE):
    """An UpcycledMoE whose routed experts run through ``grouped_experts``. Never built directly: ``apply_megablocks``
    swaps an existing module's class in place (as FSDP2's ``fully_shard`` does), so parameters, names, the state dict
    and ``isinstance(m, UpcycledMoE)`` stay as they were."""

    expert_kernel = "grouped_gemm"

    def compute_experts(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        return grouped_experts(x, expert, self.experts, self.expert_kernel)

    def extra_repr(self) -> str:
        return f"expert_kernel={self.expert_kernel!r}"


def _disable_gradient_scales(model: nn.Module) -> int:
    """``gradient_scale = None`` on MegaBlocks MLP modules (their 1/ep; docs/architecture.md, "Expert gradients")."""
    n = 0
    for m in model.modules():
        if type(m).__module__.startswith("megablocks.") and getattr(m, "gradient_scale", None) is not None:
            m.gradient_scale = None
            n += 1
    return n


def _register_for_zero3(moe: UpcycledMoE):
    """ZeRO-3 gathers a module's parameters when that module's forward runs. The grouped path reads the routed
    experts' parameters inside UpcycledMoE.forward without calling the experts, so they are registered as its external
    parameters (``deepspeed.zero.register_external_parameter``, DeepSpeed's documented way; bookkeeping on the module,
    inert below ZeRO-3). DeepSpeed 0.19.8 would also gather them on first access (its ZeROOrderedDict getter); the
    registration lets the module's own fetch and prefetch bring them instead of relying on that fallback."""
    if importlib.util.find_spec("deepspeed") is None:  # no DeepSpeed (a bare GPU host): no ZeRO-3 either
        return
    import deepspeed

    for p in moe.deepspeed_moe.parameters():
        deepspeed.zero.register_external_parameter(moe, p)


def apply_megablocks(model: nn.Module, kernel: str = "grouped_gemm") -> nn.Module:
    """Run every UpcycledMoE of ``model`` (the root included) through ``grouped_experts`` with ``kernel``; in place,
    returns ``model``. Parameters are untouched, so it may come before or after loading weights; call it before
    ``deepspeed.initialize`` (as ``pipeline.parallel.parallelize`` does). Applying it twice changes only the kernel.
    'grouped_gemm' raises MegaBlocksUnavailable where MegaBlocks cannot run."""
    _check_kernel(kernel)
    if kernel == "grouped_gemm":
        _grouped_gemm_backend()
    for name, m in model.named_modules():
        if not isinstance(m, UpcycledMoE):
            continue
        if type(m) not in (UpcycledMoE, GroupedUpcycledMoE) or "compute_experts" in vars(m):
            raise TypeError(f"apply_megablocks: {name or 'the model'} ({type(m).__name__}) already has another "
                            "compute_experts (expert parallelism?); MegaBlocks replaces only the reference one")
        m.__class__ = GroupedUpcycledMoE
        m.expert_kernel = kernel
        _register_for_zero3(m)
    _disable_gradient_scales(model)
    return model


# ------------------------------------------------------------------------------------------------------------------
# Weight layouts: reference experts <-> MegaBlocks' fused tensors (pure functions, no MegaBlocks needed)
# ------------------------------------------------------------------------------------------------------------------
def fuse_experts(fc1_weight: Sequence[torch.Tensor], fc1_bias: Sequence[torch.Tensor],
                 fc2_weight: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert fc1.weight [h, d], fc1.bias [h], fc2.weight [d, h] (E of each) -> MegaBlocks' fused layout
    (``megablocks.layers.mlp.SparseMLP``/``GroupedMLP``, llm-foundry's torch dMoE):

        w1 [E*h, d]  rows e*h .. (e+1)*h = fc1_e.weight     (GroupedMLP: w1.view(E, h, d), gmm(x, w1, trans_b=True))
        w2 [E*h, d]  rows e*h .. (e+1)*h = fc2_e.weight^T   (GroupedMLP: w2.view(E, h, d), gmm(act, w2))
        b1 [E, h]    fc1_e.bias; MegaBlocks' experts have no input bias, so this tensor has no counterpart there

    New tensors (copies); differentiable."""
    if not (len(fc1_weight) == len(fc1_bias) == len(fc2_weight)) or not fc1_weight:
        raise ValueError("fuse_experts: one fc1.weight, fc1.bias and fc2.weight per expert, at least one expert")
    return {"w1": torch.cat(list(fc1_weight)), "w2": torch.cat([w.t() for w in fc2_weight]),
            "b1": torch.stack(list(fc1_bias))}


def unfuse_experts(w1: torch.Tensor, w2: torch.Tensor, b1: torch.Tensor):
    """Inverse of ``fuse_experts``: (fc1.weight [h, d] list, fc1.bias [h] list, fc2.weight [d, h] list), each tensor
    with storage of its own (a state dict of views would save the fused storage E times)."""
    E, h = b1.shape
    d = w1.shape[1]
    if w1.shape != (E * h, d) or w2.shape != (E * h, d):
        raise ValueError(f"unfuse_experts: b1 {tuple(b1.shape)} means w1 and w2 of shape {(E * h, d)}, got "
                         f"{tuple(w1.shape)} and {tuple(w2.shape)}")
    return ([w.clone() for w in w1.view(E, h, d).unbind(0)], [b.clone() for b in b1.unbind(0)],
            [w.t().contiguous() for w in w2.view(E, h, d).unbind(0)])


_EXPERT_PARTS = ("fc1.weight", "fc1.bias", "fc2.weight")
_EXPERT_KEY = re.compile(r"^(?P<prefix>.*)deepspeed_moe\.experts\.deepspeed_experts\.(?P<e>\d+)\."
                         r"(?P<part>fc1\.weight|fc1\.bias|fc2\.weight)$")
_FUSED_KEY = re.compile(r"^(?P<prefix>.*)experts\.mlp\.(?P<part>w1|w2|b1)$")


def _regroup(state: Mapping[str, torch.Tensor], pattern: re.Pattern, fuse):
    """Rebuild ``state`` with each layer's matching keys replaced, at the place of its first one, by the items of
    ``fuse(prefix, [(match, tensor), ...])``; other keys keep their order."""
    groups, items = {}, []
    for k, v in state.items():
        m = pattern.match(k)
        if m is None:
            items.append((k, v))
            continue
        if m["prefix"] not in groups:
            groups[m["prefix"]] = []
            items.append((None, m["prefix"]))  # placeholder: the layer's converted keys go here
        groups[m["prefix"]].append((m, v))
    out = {}
    for k, v in items:
        if k is None:
            out.update(fuse(v, groups[v]))
        else:
            out[k] = v
    return out


def state_dict_to_megablocks(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ProtLingo state dict (all experts, global ids: a merged checkpoint under EP) -> the same with every MoE
    layer's ``<p>deepspeed_moe.experts.deepspeed_experts.<e>.{fc1.weight, fc1.bias, fc2.weight}`` replaced by
    ``<p>experts.mlp.{w1, w2, b1}`` (``fuse_experts``). Exact; ``state_dict_from_megablocks`` inverts it."""

    def fuse(prefix, matches):
        parts = {}
        for m, v in matches:
            parts.setdefault(int(m["e"]), {})[m["part"]] = v
        ids = sorted(parts)
        incomplete = [e for e in ids if len(parts[e]) != len(_EXPERT_PARTS)]
        if ids != list(range(len(ids))) or incomplete:
            raise ValueError(f"state_dict_to_megablocks: {prefix!r} needs experts 0..E-1 each with "
                             f"{_EXPERT_PARTS}; got experts {ids}, incomplete {incomplete}")
        fused = fuse_experts(*([parts[e][p] for e in ids] for p in _EXPERT_PARTS))
        return {f"{prefix}experts.mlp.{n}": fused[n] for n in ("w1", "w2", "b1")}

    return _regroup(state, _EXPERT_KEY, fuse)


def state_dict_from_megablocks(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``state_dict_to_megablocks``: ``<p>experts.mlp.{w1, w2, b1}`` -> per-expert keys, expert by expert
    in the reference order (fc1.weight, fc1.bias, fc2.weight)."""

    def unfuse(prefix, matches):
        parts = {m["part"]: v for m, v in matches}
        if set(parts) != {"w1", "w2", "b1"}:
            raise ValueError(f"state_dict_from_megablocks: {prefix!r} needs experts.mlp.w1, w2 and b1, got "
                             f"{sorted(parts)}")
        out = {}
        for e, tensors in enumerate(zip(*unfuse_experts(parts["w1"], parts["w2"], parts["b1"]))):
            for part, t in zip(_EXPERT_PARTS, tensors):
                out[f"{prefix}deepspeed_moe.experts.deepspeed_experts.{e}.{part}"] = t
        return out

    return _regroup(state, _FUSED_KEY, unfuse)
