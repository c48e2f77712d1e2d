"""Transformer building blocks shared by the model families (pure nn.Modules).

Attention has one backend switch: ``sdpa`` (torch's scaled_dot_product_attention, every device; on CUDA its flash and
memory-efficient kernels only, see CUDA_SDPA_BACKENDS) or ``flash`` (flash-attn's varlen kernel, CUDA only). Both use
the same parameters, so a checkpoint moves between them freely; ``auto`` picks flash when flash-attn imports and the
tensors are on CUDA, and for packed sequences on CUDA without flash-attn torch's own varlen kernel. No path calls a
kernel with an empty batch (:func:`empty_attention`).

Blocks take activations in one of two layouts: padded rows ``[B, L, d]`` with a key mask ``[B, L]`` bool, or packed
real tokens ``[T, d]`` (the real tokens of n sequences end to end) with a :class:`Varlen` in place of the mask. Only
attention needs to know which (norms and MLPs act per token); in the packed layout no FLOP is spent on padding.
"""
from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.attention_ops import CUDA_SDPA_BACKENDS, expand_kv, sdpa, varlen_sdpa  # noqa: F401 (re-exported)
from pipeline.models.norm_op import rms_norm, rms_norm_reference

try:  # CUDA-only source build; installed on GPU hosts by scripts/install_gpu_kernels.sh
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or an ABI mismatch raising OSError/RuntimeError
    flash_attn_varlen_func = None

try:  # torch's own varlen flash attention (torch >= 2.9), CUDA only: the packed layout without the flash-attn package
    from torch.nn.attention.varlen import varlen_attn as torch_varlen_attn
except ImportError:
    torch_varlen_attn = None

ATTN_BACKENDS = ("auto", "sdpa", "flash")


def host_tensor(values, dtype, device) -> torch.Tensor:
    """Host numbers (a list, or a CPU tensor) as a tensor on ``device`` without stalling the host.

    ``torch.tensor(values, device=cuda)`` and ``.to(cuda)`` from pageable memory are blocking copies: each waits until
    the stream has run every kernel queued before it (cudaStreamSynchronize), so the host stops queueing work and the
    GPU idles while it catches up (17 such waits a step on the first Eco-RNA GPU trace, one per wavefront row count).
    A pinned source lets the copy be queued like a kernel; torch's caching host allocator keeps the pinned block
    until the copy has run."""
    t = values if torch.is_tensor(values) else torch.tensor(values, dtype=dtype)
    t = t.to(dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def flash_available() -> bool:
    return flash_attn_varlen_func is not None and torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def _torch_varlen_works(device: str, dtype: torch.dtype) -> bool:
    """One tiny call of torch's varlen kernel on ``device`` (GQA, causal and not): the capability check itself, since
    the kernel's architecture and dtype support is known only to the kernel."""
    try:
        q = torch.zeros(3, 2, 64, device=device, dtype=dtype)
        cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
        for causal in (False, True):
            torch_varlen(q, q[:, :1], q[:, :1], cu, 2, causal)
        return True
    except Exception:  # noqa: BLE001 - any failure means: use the per-sequence SDPA path
        return False


def torch_varlen_available(x: torch.Tensor) -> bool:
    """Whether torch's varlen attention runs for activations like ``x`` (CUDA, fp16/bf16, a working kernel)."""
    return (torch_varlen_attn is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and _torch_varlen_works(str(x.device), x.dtype))


def torch_varlen(q, k, v, cu_seqlens: torch.Tensor, max_len: int, causal: bool) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn over packed sequences: q [T, H, hd], k/v [T, Hkv, hd] -> [T, H, hd].
    Its keywords changed between torch versions (causal as ``is_causal`` or ``window_size=(-1, 0)``; grouped-query
    as ``enable_gqa`` or not at all), so they are read from its signature."""
    params = _varlen_params()
    kwargs = {}
    if causal:
        kwargs.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    return torch_varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **kwargs)


@functools.lru_cache(maxsize=1)
def _varlen_params() -> frozenset:
    return frozenset(inspect.signature(torch_varlen_attn).parameters)


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, computed in fp32 (norm_op.rms_norm_reference).

    ``fused`` (default): one operator each way (pipeline/models/norm_op.py: torch's fused kernels on CUDA, the same
    formula elsewhere), saving only x and a per-row fp32 rstd for backward; False: the plain autograd formula. In a
    compiled block the formula is traced either way, and inductor fuses it.
    :func:`set_fused_norms` switches every norm of a model (train.fused_norm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inside a compiled block the formula itself: inductor fuses it with the residual add around it into one
        # kernel each way (fp32 in registers), which the opaque operator would prevent (train.compile: blocks).
        if self.fused and not torch.compiler.is_compiling():
            return rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)


def set_fused_norms(model: nn.Module, fused: bool) -> nn.Module:
    """Every RMSNorm of ``model`` fused or plain (same parameters and names either way)."""
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fused = fused
    return model


def rope_cache(length: int, head_dim: int, theta: float, device, dtype=torch.float32):
    """cos/sin tables [length, head_dim] for rotary embeddings in :func:`rotate`'s layout: cos over both halves, sin
    negated over the first half (so the rotation is two multiplies and an add, not four, a subtract and an add)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), inv_freq)  # [L, hd/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, L, hd]; rotate interleaved halves (GPT-NeoX layout: first half with second half).

    cos/sin: [L, hd] shared by every row, or [B, L, hd] per row (packed rows: positions restart per document).
    """
    cos, sin = (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos[None, None], sin[None, None])
    return rotate(x, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation itself: x [..., hd] with rope_cache's cos/sin broadcastable to [..., hd]. With x = (x1, x2)
    halves and angles a: (x1 cos a - x2 sin a, x2 cos a + x1 sin a), the same operations in the same order as
    written out, so the same numbers."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * sin


def use_flash(backend: str, x: torch.Tensor) -> bool:
    """Whether ``backend`` runs flash-attn for activations ``x``; 'flash' without flash-attn/CUDA is an error."""
    if backend == "flash":
        if not flash_available() or not x.is_cuda:
            raise RuntimeError("attention backend 'flash' needs flash-attn and CUDA tensors "
                               "(install with scripts/install_gpu_kernels.sh, or use 'sdpa')")
        return True
    return backend == "auto" and flash_attn_varlen_func is not None and x.is_cuda and x.dtype in (
        torch.float16, torch.bfloat16)


def attention_kernel(backend: str, x: torch.Tensor, kernel: str | None = None) -> str:
    """The attention kernel that runs for ``backend`` and activations like ``x``, by name, for the log: padded rows
    (:func:`attend`: flash-attn's varlen kernel, or SDPA, on CUDA its flash and memory-efficient kernels only), or
    with ``kernel`` (:func:`varlen_kernel`'s choice) packed sequences."""
    if kernel is not None:
        return {"flash": "flash-attn-varlen", "torch": "torch-varlen", "sdpa": "sdpa-per-sequence"}[kernel]
    if use_flash(backend, x):
        return "flash-attn-varlen"
    return "sdpa-flash-efficient" if x.is_cuda else "sdpa"


def empty_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The output of attention over no token: zeros shaped like q, without calling a kernel (flash-attn and CUDA
    SDPA cannot take an empty batch; cuDNN's returns an undefined tensor). A zero-row call happens in training: the
    wavefront at a step where none of this rank's rows is active (K_max is the maximum over ranks), fixed_wavefront's
    leading steps, the anchor readout with no eligible row. Built from q, k and v so that autograd still reaches
    their projections, as it does through a kernel: ZeRO-3 gathers each module's parameters in its backward, and
    every rank must do so equally."""
    return q * 0 + (k.sum() + v.sum()) * 0


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor, *, backend: str = "auto",
           causal: bool = False, segments: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention with a padding mask, through SDPA or flash-attn. q: [B, H, L, hd]; k/v: [B, Hkv, L, hd];
    key_mask: [B, L] bool, True at real tokens (rows right-padded), or None for no padding -> [B, H, L, hd].

    ``causal``: position i attends to keys j <= i. With right padding a real query never sees a padded key (they all
    come after it), so the causal mask and the padding mask combine without any fully masked real row.
    ``segments``: [B, L] int64 document index of each position in a packed row (-1 at padding); a query then sees
    only keys of its own document.
    """
    if q.numel() == 0:  # no row (or no position): no kernel is called with an empty batch, on any path
        return empty_attention(q, k, v)
    if use_flash(backend, q):
        if key_mask is None:
            key_mask = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=q.device)
        return flash_varlen(q, k, v, key_mask, causal, segments)
    if segments is not None:
        L = q.shape[2]
        allowed = (segments[:, :, None] == segments[:, None, :]) | (segments[:, :, None] < 0)  # [B, Lq, Lk]
        if causal:  # padded queries see every earlier key, so no softmax row is empty
            allowed = allowed & torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        return sdpa(q, k, v, attn_mask=allowed[:, None])
    if causal:
        if key_mask is None or bool(key_mask.all()):  # no padding: SDPA's causal kernel, no [L, L] mask
            return sdpa(q, k, v, is_causal=True)
        L = q.shape[2]
        tri = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()  # [L, L]: query i sees keys j <= i
        # Padded query rows still see the real keys before them, so no softmax row is empty (no NaN).
        return sdpa(q, k, v, attn_mask=tri[None, None] & key_mask[:, None, None, :])
    return sdpa(q, k, v, attn_mask=None if key_mask is None else key_mask[:, None, None, :])


def flash_varlen(q, k, v, key_mask, causal: bool = False, segments: torch.Tensor | None = None):
    """Unpad to the real tokens and run flash-attn's varlen kernel, one sequence per row (rows right-padded) or, with
    ``segments``, one per document of a packed row (documents contiguous in their row)."""
    B, H, L, hd = q.shape
    if segments is None:
        segments = torch.where(key_mask, 0, -1)
    real = segments.reshape(-1) >= 0
    idx = real.nonzero().squeeze(-1)
    if idx.numel() == 0:  # rows that are all padding: zero output, as at padding below (lengths.max() has nothing)
        return empty_attention(q, k, v)  # [B, H, L, hd]
    row = torch.arange(B, device=q.device).repeat_interleave(L)
    seq_id = (row * (L + 1) + segments.reshape(-1))[idx]  # unique per (row, document), in token order
    lengths = torch.unique_consecutive(seq_id, return_counts=True)[1].to(torch.int32)
    cu = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    flat = lambda t: t.transpose(1, 2).reshape(B * L, t.shape[1], hd)[idx]  # noqa: E731  [T, heads, hd]
    max_len = int(lengths.max())
    out = flash_attn_varlen_func(flat(q), flat(k), flat(v), cu, cu, max_len, max_len, causal=causal)
    full = q.new_zeros(B * L, H, hd)
    full[idx] = out
    return full.view(B, L, H, hd).transpose(1, 2)


@dataclass(frozen=True)
class Varlen:
    """Packed sequences: sequence i owns tokens ``offsets[i]:offsets[i + 1]`` of a ``[T, ...]`` tensor.

    ``lengths`` is a host tuple (one entry per sequence, zero allowed). Everything a kernel needs is made when the
    Varlen is, on the host and outside any compiled block: ``cu_seqlens`` [n_nonempty + 1] int32 on ``device``
    (empty sequences skipped, which flash-attn's kernel does not take) and ``max_len``, so that a compiled block
    reads two attributes and runs no host-only operation (a pinned copy, a ``max`` over host lengths: both break
    or specialize torch.compile's graph). ``kernel``: the varlen path (:func:`varlen_kernel`: "flash", "torch" or
    "sdpa"), chosen by the model for the whole forward; None: chosen at each call from the backend and the tensors.
    ``prefix(n)`` is the first n sequences, the wavefront's active rows when sequences are sorted by depth.
    """

    lengths: tuple
    device: torch.device
    kernel: str | None = None
    cu_seqlens: torch.Tensor = field(init=False, repr=False, compare=False)
    max_len: int = field(init=False, compare=False)

    def __post_init__(self):
        nonempty = [int(n) for n in self.lengths if n]
        cu = F.pad(torch.tensor(nonempty, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
        object.__setattr__(self, "cu_seqlens", host_tensor(cu, torch.int32, self.device))
        object.__setattr__(self, "max_len", max(nonempty, default=0))

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def prefix(self, n: int) -> "Varlen":
        return Varlen(self.lengths[:n], self.device, self.kernel)


def varlen_kernel(backend: str, x: torch.Tensor) -> str:
    """The packed layout's attention for ``backend`` and activations like ``x``: "flash" (flash-attn's varlen kernel,
    see use_flash), "torch" (torch's own varlen kernel: backend auto on CUDA where it works) or "sdpa" (one SDPA call
    per sequence, inside the ``varlen_sdpa`` operator)."""
    if use_flash(backend, x):
        return "flash"
    if backend == "auto" and torch_varlen_available(x):
        return "torch"
    return "sdpa"


def varlen_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Varlen, *, backend: str = "auto",
                  causal: bool = False) -> torch.Tensor:
    """Attention within each packed sequence. q: [T, H, hd]; k/v: [T, Hkv, hd] -> [T, H, hd], through
    ``seqs.kernel`` (else :func:`varlen_kernel` of ``backend``): the same result on every path, the "sdpa" one the
    pure-PyTorch path of the packed layout (slower than padded SDPA for many short sequences)."""
    if q.shape[0] == 0:  # a zero-token call (the wavefront at a step with no active row)
        return empty_attention(q, k, v)
    kernel = seqs.kernel or varlen_kernel(backend, q)
    if kernel == "flash":  # varlen_kernel checked flash-attn and the device
        cu = seqs.cu_seqlens
        return flash_attn_varlen_func(q, k, v, cu, cu, seqs.max_len, seqs.max_len, causal=causal)
    if kernel == "torch":
        return torch_varlen(q, k, v, seqs.cu_seqlens, seqs.max_len, causal)
    return varlen_sdpa(q, k, v, seqs.cu_seqlens, causal)


class Attention(nn.Module):
    """Bidirectional grouped-query attention with QK RMSNorm and RoPE (the masked LMs' blocks).

    q: [B, H, L, hd], k/v: [B, Hkv, L, hd]; the padding mask keeps padded keys out of every softmax.
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, norm_eps: float, backend: str = "auto"):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads {n_heads} is not divisible by n_kv_heads {n_kv_heads}")
        if backend not in ATTN_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTN_BACKENDS}, got {backend!r}")
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.backend = backend
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.q_norm = RMSNorm(self.head_dim, norm_eps)
        self.k_norm = RMSNorm(self.head_dim, norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple, key_mask: "torch.Tensor | Varlen") -> torch.Tensor:
        """x: [B, L, d] with key_mask [B, L] bool, True at real tokens, and rope [L, hd] tables; or packed tokens
        x: [T, d] with key_mask a Varlen and rope [T, hd] tables (each token's own position)."""
        if isinstance(key_mask, Varlen):
            T = x.shape[0]
            q = self.q_norm(self.q_proj(x).view(T, self.n_heads, self.head_dim))  # [T, H, hd]
            k = self.k_norm(self.k_proj(x).view(T, self.n_kv_heads, self.head_dim))  # [T, Hkv, hd]
            v = self.v_proj(x).view(T, self.n_kv_heads, self.head_dim)
            cos, sin = (t[:, None] for t in rope)  # [T, 1, hd]: one position per token, shared by its heads
            # back to v's dtype: under autocast the fp32 tables make q, k fp32, and flash-attn takes bf16/fp16 only
            q, k = rotate(q, cos, sin).to(v.dtype), rotate(k, cos, sin).to(v.dtype)
            out = varlen_attend(q, k, v, key_mask, backend=self.backend)
            return self.o_proj(out.reshape(T, self.n_heads * self.head_dim))
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, L, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, L, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype)  # autocast: as above
        out = attend(q, k, v, key_mask, backend=self.backend)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, d_ff, bias=False)
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SandwichBlock(nn.Module):
    """Eco-RNA Eq. A.1: u^ = N2(u + Attn(N1 u)), u' = N4(u^ + MLP(N3 u^))."""

    def __init__(self, d_model, n_heads, n_kv_heads, d_ff, norm_eps, attn_backend):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(d_model, norm_eps), RMSNorm(d_model, norm_eps)
        self.norm3, self.norm4 = RMSNorm(d_model, norm_eps), RMSNorm(d_model, norm_eps)
        self.attn = Attention(d_model, n_heads, n_kv_heads, norm_eps, attn_backend)
        self.mlp = SwiGLU(d_model, d_ff)

    def forward(self, u, rope, key_mask):
        u = self.norm2(u + self.attn(self.norm1(u), rope, key_mask))
        return self.norm4(u + self.mlp(self.norm3(u)))


def init_linear_(module: nn.Module, std: float, residual_std: float):
    """Zero-mean Gaussian for every Linear/Embedding; output projections of residual branches get residual_std."""
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            is_out = name.endswith("o_proj") or name.endswith("down_proj")
            nn.init.normal_(m.weight, 0.0, residual_std if is_out else std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, std)


def residual_std(std: float, n_blocks: int) -> float:
    return std / math.sqrt(2 * n_blocks)
