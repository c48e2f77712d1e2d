"""ProtLingo: ESM2 with a centered latent N-gram memory and upcycled shared + routed MoE FFNs (paper 002).

Backbone (ESM2, as Hugging Face ``EsmForMaskedLM`` computes it; ``hf_to_protlingo`` maps its weights here):

    x_0    = E[tokens], token dropout (mask rows zeroed, rescaled by (1 - 0.12) / (1 - observed mask ratio)), x0 at pad
    block  = h' = h + O(Attn(LN_a h)) with RoPE;  h'' = h' + FFN(LN_f h'),  FFN(u) = W2 gelu_erf(W1 u + b1) + b2
    logits = W_E (LN(gelu_erf(D LN_out(h_B)))) + bias                       tied head                  [B, L, V]

Centered latent N-gram memory (Eq. 2-12), inserted before each block listed in ``memory_layers``:

    h_bar = RMSNorm(h), q = W_q h_bar [B, L, d] -> R = d / b routes of b bits
    c_r   = 1 + sum_j 2^(j-1) [q_rj > 0] in 1..2^b; 0 outside the sequence AND at <cls>, <eos> and padding (the
            residue sequence is what the memory addresses; special tokens carry no residue)
    a_r   = addr(c_{i-s,r} .. c_{i+s,r}), N = 2s + 1: the exact mixed-radix index sum_n c_n (2^b + 1)^n when
            (2^b + 1)^N <= memory_table_size, else the hash below into memory_table_size rows (collisions counted)
    m     = concat_r T_r[a_r] (R * d_m), z = W_m m (d_z), k = RMSNorm(W_k z), v = RMSNorm(W_v z)
    g     = sigmoid(<h_bar, k> / sqrt(d)), u = g v, delta = u + SiLU(DWConv(u)) (causal, taps i-2, i-1, i)
    h     = h + alpha delta (at real tokens; alpha per insertion layer, init 1.0)

T_r and the convolution start at zero, so delta = 0 and an upcycled model starts as the dense ESM2 exactly.
Hash (exact index does not fit): addr = ((key mod (2^31 - 1)) * 1_000_003 + 7_919 r) mod rows, computed in int64
without overflow (key < 2^62 is enforced by the config).

Upcycled MoE (Eq. 13-16) at each block in ``moe_layers``: the dense FFN's hidden units split into S (the first
``moe_shared_hidden``) and R (the rest). The shared expert takes S with the output bias b2; every routed expert
starts as a copy of R without output bias, so shared(x) + routed_e(x) equals the dense FFN for every e (gelu acts
per unit). Router W_r on LN_f(U) (the FFN's own input LayerNorm), fp32 logits, top-1; the selected expert's output is
multiplied by w = exp(log p_e - stopgrad(log p_e)) (= 1 in the forward pass, d log p_e in the backward pass). Losses
per layer over real tokens, then the mean over MoE layers: L_aux = E sum_e f_e P_e (f_e: fraction of tokens routed
to e, P_e: mean router probability; Switch Transformer) and L_z = mean(logsumexp(logits)^2) (ST-MoE).

Parameter layout: routed experts live at ``<layer>.ffn.deepspeed_moe.experts.deepspeed_experts.<e>`` and the shared
one at ``<layer>.ffn.shared`` (no 'expert' in its name): the layout DeepSpeed's MoE checkpointing needs
(docs/architecture.md, "MoE checkpoints"): the reference path, expert parallelism and MegaBlocks share one state dict.
``UpcycledMoE.compute_experts`` is the one method those paths replace.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.layers import ATTN_BACKENDS, RMSNorm, apply_rope, attend, rope_cache

MOE_BACKENDS = ("auto", "torch", "grouped", "megablocks")
HASH_PRIME, HASH_MUL, HASH_ROUTE = 2_147_483_647, 1_000_003, 7_919


@dataclass
class ProtLingoConfig:
    # ESM2 backbone (defaults: ESM2-150M, facebook/esm2_t30_150M_UR50D)
    vocab_size: int = 33
    d_model: int = 640
    n_layers: int = 30
    n_heads: int = 20
    d_ff: int = 2560
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    token_dropout: bool = True
    mask_token_id: int = 32
    pad_token_id: int = 1
    cls_token_id: int = 0
    eos_token_id: int = 2
    init_std: float = 0.02
    # Execution choices (same parameters, same outputs) a resumed run may change (pipeline/checkpoint/resume.py)
    RESUME_FREE = ("attn_backend", "moe_backend")
    attn_backend: str = "auto"
    # Upcycled MoE
    moe_layers: list[int] = field(default_factory=list)  # zero-based block indices with a MoE FFN
    num_experts: int = 4  # routed experts E (top-1), plus one shared expert
    moe_shared_hidden: int | None = None  # |S| hidden units of the shared expert; default d_ff // 2
    # auto: megablocks on CUDA when installed, else grouped (torch's grouped GEMM) on CUDA in bf16, else torch (the
    # reference: one GEMM pair per expert); pipeline/parallel/megablocks.py
    moe_backend: str = "auto"
    router_init_std: float = 0.02  # small random router: with zero init every token would go to expert 0
    # Centered latent N-gram memory
    memory_layers: list[int] = field(default_factory=list)  # zero-based blocks the memory is inserted before
    memory_bits: int = 2  # b; routes R = d_model / b
    memory_radius: int = 2  # s; window N = 2s + 1
    memory_dim: int = 8  # d_m per route
    memory_latent: int = 256  # d_z
    memory_table_size: int = 4096  # rows per route table (the exact index is used when it fits)

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "num_experts", "memory_bits",
                     "memory_dim", "memory_latent", "memory_table_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}: must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"model.n_heads: d_model {self.d_model} / n_heads {self.n_heads} must be an even "
                             "integer head dim (RoPE)")
        for name in ("moe_layers", "memory_layers"):
            idx = getattr(self, name)
            if len(set(idx)) != len(idx) or any(not 0 <= i < self.n_layers for i in idx):
                raise ValueError(f"model.{name}: distinct block indices in [0, {self.n_layers}), got {idx}")
        if not 1 <= self.shared_hidden < self.d_ff:
            raise ValueError(f"model.moe_shared_hidden: must be in [1, d_ff={self.d_ff}), got {self.shared_hidden}")
        if self.memory_layers and self.d_model % self.memory_bits:
            raise ValueError(f"model.memory_bits: d_model {self.d_model} is not divisible by {self.memory_bits}")
        if self.memory_radius < 0:
            raise ValueError(f"model.memory_radius: must be >= 0, got {self.memory_radius}")
        for name in ("mask_token_id", "pad_token_id", "cls_token_id", "eos_token_id"):
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise ValueError(f"model.{name}: must be a token id in [0, vocab_size={self.vocab_size}), "
                                 f"got {getattr(self, name)}")
        for name in ("layer_norm_eps", "rope_theta", "init_std"):  # written "not > 0" so that nan fails too
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name}: must be > 0, got {getattr(self, name)}")
        if not self.router_init_std >= 0:
            raise ValueError(f"model.router_init_std: must be >= 0, got {self.router_init_std}")
        if self.memory_layers and self.window_keys >= 2 ** 62:
            raise ValueError(f"model.memory_radius: (2^b + 1)^N = {self.window_keys} does not fit the int64 window "
                             "key; use a smaller window or fewer bits")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"model.attn_backend: must be one of {ATTN_BACKENDS}, got {self.attn_backend!r}")
        if self.moe_backend not in MOE_BACKENDS:
            raise ValueError(f"model.moe_backend: must be one of {MOE_BACKENDS}, got {self.moe_backend!r}")

    # ---- derived sizes ----------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def shared_hidden(self) -> int:
        return self.moe_shared_hidden if self.moe_shared_hidden is not None else self.d_ff // 2

    @property
    def routes(self) -> int:
        return self.d_model // self.memory_bits

    @property
    def window(self) -> int:
        return 2 * self.memory_radius + 1

    @property
    def window_keys(self) -> int:
        """Distinct windows of N symbols in 0..2^b: the size of the exact index."""
        return (2 ** self.memory_bits + 1) ** self.window

    @property
    def exact_addresses(self) -> bool:
        return self.window_keys <= self.memory_table_size

    @property
    def table_rows(self) -> int:
        return self.window_keys if self.exact_addresses else self.memory_table_size

    # ---- accounting known before the model is built -----------------------------------------------------------
    def _ffn(self, hidden: int, out_bias: bool) -> int:
        return 2 * self.d_model * hidden + hidden + (self.d_model if out_bias else 0)

    def memory_params(self) -> tuple[int, int]:
        """(parameters of one memory insertion, of which table entries)."""
        d, R = self.d_model, self.routes
        table = R * self.table_rows * self.memory_dim
        proj = d * d + R * self.memory_dim * self.memory_latent + 2 * self.memory_latent * d  # W_q, W_m, W_k, W_v
        return table + proj + 3 * d + (3 * d + d) + 1, table  # RMSNorm h/k/v, DWConv w+b, alpha

    def moe_params(self) -> tuple[int, int]:
        """(parameters of one MoE FFN, of which in routed experts)."""
        routed = self.num_experts * self._ffn(self.d_ff - self.shared_hidden, out_bias=False)
        return self._ffn(self.shared_hidden, out_bias=True) + routed + self.num_experts * self.d_model, routed

    def num_params(self) -> int:
        d, L = self.d_model, self.n_layers
        attn = 4 * (d * d + d) + 2 * d  # q, k, v, o with biases; LN_a
        block = attn + 2 * d  # + LN_f
        n_dense = L - len(self.moe_layers)
        total = self.vocab_size * d + L * block + n_dense * self._ffn(self.d_ff, True) + 2 * d  # + final LN
        total += d * d + d + 2 * d + self.vocab_size  # head: dense, LN, bias (decoder tied to the embedding)
        total += len(self.moe_layers) * self.moe_params()[0]
        return total + len(self.memory_layers) * self.memory_params()[0]

    def num_buffer_values(self) -> int:
        """Values of the saved buffers, which are state, not parameters: each memory's ``addressed`` flags (one per
        table row of every route, the "rows ever addressed" diagnostic)."""
        return len(self.memory_layers) * self.routes * self.table_rows

    def num_active_params(self) -> int:
        """Parameters one token uses: one of E routed experts per MoE layer, R table rows per memory layer."""
        routed_inactive = self.moe_params()[1] * (self.num_experts - 1) // self.num_experts
        table = self.memory_params()[1]
        table_active = self.routes * self.memory_dim
        return (self.num_params() - len(self.moe_layers) * routed_inactive
                - len(self.memory_layers) * (table - table_active))

    def _flops_per_position(self, length: int) -> tuple[int, int, int]:
        """FLOPs of one forward per token position of a [rows, L] batch, in three parts by where they run and
        whether the backward repeats them (a multiply-add counts two):

        (every position, differentiated: attention projections and scores, dense FFNs, the shared experts, the
         memory's W_m, W_k, W_v and its depthwise convolution (3 taps), the head;
         every position, forward only: the memory's address projection W_q, read only through the sign of q, so
         autograd never reaches it;
         real tokens only, differentiated: the router and the one routed expert of each MoE layer, which run on the
         real tokens alone (UpcycledMoE.forward))."""
        L, d = length, self.d_model
        n_moe, n_mem = len(self.moe_layers), len(self.memory_layers)
        attn = 8 * d * d + 4 * L * d  # q, k, v, o; QK^T and PV over the L keys (padded ones included)
        ffn = (self.n_layers - n_moe) * 4 * d * self.d_ff + n_moe * 4 * d * self.shared_hidden
        mem = 2 * (self.routes * self.memory_dim * self.memory_latent + 2 * self.memory_latent * d) + 6 * d
        head = 2 * d * d + 2 * d * self.vocab_size
        routed = n_moe * (4 * d * (self.d_ff - self.shared_hidden) + 2 * d * self.num_experts)
        return self.n_layers * attn + ffn + n_mem * mem + head, n_mem * 2 * d * d, routed

    def forward_flops(self, length: int, depth: int | None = None) -> int:
        """FLOPs of one forward of one sequence of L tokens, no padding (matrix multiplies and the memory's
        depthwise convolution; a multiply-add counts two); ``depth`` is unused."""
        return length * sum(self._flops_per_position(length))

    def train_flops(self, rows: int, length: int, real_tokens: int) -> int:
        """FLOPs one training microbatch [rows, L] with ``real_tokens`` real tokens executes, forward and backward
        (the backward twice the forward's multiplies): the padded positions run everything but the routed experts
        and the router; W_q runs forward only (_flops_per_position). bench/flops_check.py counts the executed
        FLOPs against this (docs/performance.md)."""
        every, forward_only, routed = self._flops_per_position(length)
        return 3 * (rows * length * every + real_tokens * routed) + rows * length * forward_only


# ------------------------------------------------------------------------------------------------------------------
# Backbone pieces
# ------------------------------------------------------------------------------------------------------------------
class FFN(nn.Module):
    """u -> fc2(gelu_erf(fc1 u)): ESM's dense FFN, the shared expert (with output bias) or a routed expert (none)."""

    def __init__(self, d_model: int, hidden: int, out_bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model, bias=out_bias)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))  # exact erf GELU, as ESM


class EsmAttention(nn.Module):
    """ESM self-attention: q, k, v, o with biases, RoPE (in fp32) on q and k, bidirectional, padding masked."""

    def __init__(self, cfg: ProtLingoConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.head_dim, self.backend = cfg.n_heads, cfg.head_dim, cfg.attn_backend
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x, rope, key_mask):
        B, L, _ = x.shape
        split = lambda t: t.view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # noqa: E731  [B, H, L, hd]
        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        cos, sin = rope
        # ESM scales q before RoPE; a rotation commutes with scaling, so SDPA's own 1/sqrt(hd) is the same map.
        q, k = apply_rope(q.float(), cos, sin).to(v.dtype), apply_rope(k.float(), cos, sin).to(v.dtype)
        out = attend(q, k, v, key_mask, backend=self.backend)
        return self.o(out.transpose(1, 2).reshape(B, L, -1))


@dataclass
class RoutingInfo:
    """One MoE layer's routing of one forward, over its real tokens (T of them)."""

    aux: torch.Tensor  # scalar L_aux = E sum_e f_e P_e
    z: torch.Tensor  # scalar L_z = mean logsumexp^2
    counts: torch.Tensor  # [E] tokens routed to each expert (detached)
    expert: torch.Tensor | None = None  # [T] the expert each real token ran through, in real_index order (detached)


class _ExpertList(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(experts)


class _RoutedExperts(nn.Module):
    """Holds the routed experts under ``experts.deepspeed_experts.<e>`` (DeepSpeed's MoE state-dict path)."""

    def __init__(self, experts):
        super().__init__()
        self.experts = _ExpertList(experts)


class UpcycledMoE(nn.Module):
    """Shared expert + E routed experts, top-1 (Eq. 13-16). Reference execution: every expert on its own tokens."""

    def __init__(self, cfg: ProtLingoConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.router = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.shared = FFN(cfg.d_model, cfg.shared_hidden, out_bias=True)
        self.deepspeed_moe = _RoutedExperts(
            [FFN(cfg.d_model, cfg.d_ff - cfg.shared_hidden, out_bias=False) for _ in range(cfg.num_experts)])

    @property
    def experts(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    def route(self, x: torch.Tensor, forced: torch.Tensor | None = None):
        """x [T, d] -> (expert [T] long, weight [T] (1.0, with the gradient of log p_e), RoutingInfo).

        ``forced`` [T] long (a routing override, Fig. 4b): where >= 0 that expert replaces the top-1 (weight still 1
        forward), -1 keeps it. None: the training path, the same operations as without overrides."""
        logits = F.linear(x.float(), self.router.weight.float())  # [T, E] in fp32
        logp = torch.log_softmax(logits, -1)
        expert = logits.argmax(-1)
        if forced is not None:
            expert = torch.where(forced >= 0, forced, expert)
        logp_e = logp.gather(1, expert[:, None]).squeeze(1)
        weight = torch.exp(logp_e - logp_e.detach())  # straight-through: exactly 1 forward
        T = x.shape[0]
        # tokens per expert, added on the device: bincount's output size would need the largest id on the host
        counts = logits.new_zeros(self.num_experts).index_add_(0, expert, logits.new_ones(T))
        if T:
            aux = self.num_experts * (counts / T * logp.exp().mean(0)).sum()
            z = torch.logsumexp(logits, -1).pow(2).mean()
        else:
            aux = z = logits.sum() * 0  # keeps the router in the graph on a rank without tokens
        return expert, weight, RoutingInfo(aux, z, counts.detach(), expert.detach())

    def compute_experts(self, x: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """x [T, d], expert [T] -> routed_{expert_t}(x_t) [T, d]. The method expert parallelism replaces."""
        out = x.new_zeros(x.shape)
        for e, mlp in enumerate(self.experts):
            idx = (expert == e).nonzero().squeeze(1)
            out = out.index_add(0, idx, mlp(x.index_select(0, idx)))  # every expert runs, on zero rows too
        return out

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor, real_index: torch.Tensor | None = None,
                forced: torch.Tensor | None = None):
        """x [B, L, d] (normalized FFN input), token_mask [B, L] bool -> (y [B, L, d], RoutingInfo).

        Only real tokens are routed; padding gets the shared expert alone (its output is never read). ``real_index``
        [T]: the flat positions of the real tokens (the objective copies them from the host batch); without it they
        are read from the mask, one device read a layer (a boolean index's size is data-dependent). ``forced``
        [B, L] long: a routing override (:meth:`route`; -1 keeps the router's choice), None in training."""
        B, L, d = x.shape
        idx = real_index if real_index is not None else token_mask.reshape(-1).nonzero().squeeze(1)  # [T]
        flat = x.reshape(B * L, d).index_select(0, idx)  # [T, d]
        expert, weight, info = self.route(flat, None if forced is None else forced.reshape(B * L).index_select(0, idx))
        routed = self.compute_experts(flat, expert) * weight[:, None].to(flat.dtype)
        y = self.shared(x).reshape(B * L, d).index_add(0, idx, routed)  # the shared expert everywhere, + routed
        return y.view(B, L, d), info


@dataclass
class MemoryInfo:
    """Counts of one forward, as device scalars (read with the step's other statistics, not one by one)."""

    gate_sum: torch.Tensor  # sum of g over real tokens (detached)
    tokens: torch.Tensor  # real tokens
    distinct_keys: torch.Tensor  # distinct (route, window) pairs looked up
    distinct_addresses: torch.Tensor  # distinct (route, row) pairs: keys - addresses = collisions
    rows_addressed: torch.Tensor  # table rows (all routes) addressed by any training forward so far on this rank


class LatentNgramMemory(nn.Module):
    """Centered latent N-gram memory (Eq. 2-12), see the module docstring."""

    def __init__(self, cfg: ProtLingoConfig):
        super().__init__()
        d = cfg.d_model
        self.cfg = cfg
        self.norm = RMSNorm(d, cfg.layer_norm_eps)
        self.W_q = nn.Linear(d, d, bias=False)
        self.tables = nn.Parameter(torch.zeros(cfg.routes, cfg.table_rows, cfg.memory_dim))  # T_r, zero-init
        self.W_m = nn.Linear(cfg.routes * cfg.memory_dim, cfg.memory_latent, bias=False)
        self.W_k = nn.Linear(cfg.memory_latent, d, bias=False)
        self.W_v = nn.Linear(cfg.memory_latent, d, bias=False)
        self.k_norm, self.v_norm = RMSNorm(d, cfg.layer_norm_eps), RMSNorm(d, cfg.layer_norm_eps)
        self.conv = nn.Conv1d(d, d, kernel_size=3, groups=d)  # depthwise; zero-init; causal by left padding
        self.alpha = nn.Parameter(torch.ones(1))  # [1], not a 0-dim scalar: DeepSpeed's broadcast views params as bytes
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)
        radix = 2 ** cfg.memory_bits + 1
        self.register_buffer("radix_powers", radix ** torch.arange(cfg.window, dtype=torch.int64), persistent=False)
        self.register_buffer("bit_values", 2 ** torch.arange(cfg.memory_bits, dtype=torch.int64), persistent=False)
        # Rows any training forward of this rank has read: the "fraction of table rows ever addressed" diagnostic.
        # Saved with the model (rank 0's copy under ZeRO), so after a resume every rank continues from rank 0's.
        self.register_buffer("addressed", torch.zeros(cfg.routes * cfg.table_rows, dtype=torch.bool))

    def addresses(self, h_bar: torch.Tensor, residue: torch.Tensor):
        """h_bar [B, L, d], residue [B, L] bool -> (rows [B, L, R] long, window keys [B, L, R] long)."""
        cfg = self.cfg
        B, L, _ = h_bar.shape
        q = self.W_q(h_bar).view(B, L, cfg.routes, cfg.memory_bits)
        symbol = 1 + ((q > 0).long() * self.bit_values).sum(-1)  # [B, L, R] in 1..2^b  (Eq. 4)
        symbol = symbol * residue[..., None].long()  # 0 at special tokens and padding
        s = cfg.memory_radius
        padded = F.pad(symbol, (0, 0, s, s))  # 0 outside the sequence: [B, L + 2s, R]
        window = padded.unfold(1, cfg.window, 1)  # [B, L, R, N], positions i-s .. i+s
        key = (window * self.radix_powers).sum(-1)  # exact mixed-radix index, < (2^b+1)^N < 2^62
        if cfg.exact_addresses:
            return key, key
        route = torch.arange(cfg.routes, device=key.device)
        rows = ((key % HASH_PRIME) * HASH_MUL + HASH_ROUTE * route) % cfg.table_rows  # < 2^52: no overflow
        return rows, key

    def forward(self, h: torch.Tensor, residue: torch.Tensor, real: torch.Tensor):
        """h [B, L, d]; residue [B, L] bool (non-special real tokens); real [B, L] bool -> (h + alpha delta, info)."""
        cfg = self.cfg
        B, L, d = h.shape
        h_bar = self.norm(h)
        rows, key = self.addresses(h_bar, residue)
        route_offset = torch.arange(cfg.routes, device=h.device) * cfg.table_rows
        flat = rows + route_offset  # [B, L, R] into the stacked tables
        m = F.embedding(flat, self.tables.view(-1, cfg.memory_dim)).reshape(B, L, -1)  # [B, L, R * d_m]
        z = self.W_m(m.to(h.dtype))
        k, v = self.k_norm(self.W_k(z)), self.v_norm(self.W_v(z))
        g = torch.sigmoid((h_bar.float() * k.float()).sum(-1, keepdim=True) / math.sqrt(d)).to(h.dtype)  # [B,L,1]
        u = g * v
        conv = self.conv(F.pad(u.transpose(1, 2), (2, 0))).transpose(1, 2)  # taps i-2, i-1, i
        delta = (u + F.silu(conv)) * real[..., None].to(h.dtype)
        with torch.no_grad():  # counted without reading the device: no unique or boolean indexing (output sizes)
            real_rl = real[..., None].expand_as(flat)  # [B, L, R]
            hit = torch.zeros(cfg.routes * cfg.table_rows, dtype=torch.int8, device=h.device).scatter_reduce_(
                0, flat.reshape(-1), real_rl.reshape(-1).to(torch.int8), "amax").bool()  # (route, row) looked up
            if self.training:
                self.addressed |= hit
            n_addr = hit.sum()
            n_keys = n_addr
            if not cfg.exact_addresses:  # distinct (route, window key) pairs; more keys than rows = collisions
                keys = torch.where(real_rl, key, -1).reshape(-1, cfg.routes).sort(0).values  # [B*L, R], -1 first
                n_keys = ((keys[1:] != keys[:-1]) & (keys[1:] >= 0)).sum() + (keys[:1] >= 0).sum()
            info = MemoryInfo(gate_sum=(g.float().squeeze(-1) * real).sum(), tokens=real.sum(), distinct_keys=n_keys,
                              distinct_addresses=n_addr, rows_addressed=self.addressed.sum())
        return h + self.alpha * delta, info


class EsmBlock(nn.Module):
    def __init__(self, cfg: ProtLingoConfig, moe: bool):
        super().__init__()
        d = cfg.d_model
        self.attn_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attn = EsmAttention(cfg)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.ffn = UpcycledMoE(cfg) if moe else FFN(d, cfg.d_ff)

    def forward(self, h, rope, key_mask, real_index=None, forced=None):
        h = h + self.attn(self.attn_norm(h), rope, key_mask)
        u = self.ffn_norm(h)
        if isinstance(self.ffn, UpcycledMoE):
            y, info = self.ffn(u, key_mask, real_index, forced)
            return h + y, info
        return h + self.ffn(u), None


class LMHead(nn.Module):
    """ESM's head: LN(gelu(dense h)) E^T + bias, the decoder tied to the input embedding (passed in)."""

    def __init__(self, cfg: ProtLingoConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def forward(self, h, embedding: torch.Tensor):
        return F.linear(self.norm(F.gelu(self.dense(h))), embedding) + self.bias


class Embedding(nn.Module):
    """Token embedding with ESM's token dropout; its weight is also the head's decoder (both uses in forward)."""

    def __init__(self, cfg: ProtLingoConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))

    def forward(self, tokens, attention_mask):
        x = F.embedding(tokens, self.weight)
        if self.cfg.token_dropout:  # masked rows are zero; rescale by the training mask ratio over the observed one
            is_mask = tokens == self.cfg.mask_token_id
            x = x.masked_fill(is_mask[..., None], 0.0)
            observed = is_mask.sum(-1).float() / attention_mask.sum(-1).float()  # per row, over real tokens
            x = (x * (1 - 0.15 * 0.8) / (1 - observed)[:, None, None]).to(x.dtype)
        return x * attention_mask[..., None].to(x.dtype)


@dataclass
class ProtLingoOutput:
    logits: torch.Tensor  # [B, L, V]
    moe_aux: torch.Tensor | None  # mean over MoE layers of L_aux (Eq. 16), None without MoE
    moe_z: torch.Tensor | None  # mean over MoE layers of L_z
    routing: dict  # block index -> RoutingInfo
    memory: dict  # block index -> MemoryInfo


def token_experts(info: RoutingInfo, attention_mask: torch.Tensor) -> torch.Tensor:
    """The expert each position of a [B, L] batch ran through at one MoE block: [B, L] long, -1 at padding. The
    layer's real tokens are the mask's True positions in row-major order (the real_index every caller passes)."""
    out = torch.full(attention_mask.shape, -1, dtype=torch.long, device=info.expert.device)
    return out.view(-1).index_copy(0, attention_mask.reshape(-1).nonzero().squeeze(1), info.expert).view(
        attention_mask.shape)


def check_route_override(override: dict, cfg: ProtLingoConfig, shape) -> None:
    """ValueError naming the first block or value of a routing override that cannot apply (ProtLingo.forward)."""
    for block, forced in override.items():
        if block not in cfg.moe_layers:
            raise ValueError(f"route_override: block {block} is not an MoE block (model.moe_layers {cfg.moe_layers})")
        if tuple(forced.shape) != tuple(shape) or forced.is_floating_point():
            raise ValueError(f"route_override[{block}]: an integer tensor of the tokens' shape {list(shape)} is "
                             f"needed, got {forced.dtype} {list(forced.shape)}")
        if forced.numel() and (int(forced.min()) < -1 or int(forced.max()) >= cfg.num_experts):
            raise ValueError(f"route_override[{block}]: expert ids must be in -1..{cfg.num_experts - 1} "
                             "(-1 keeps the router's choice)")


class ProtLingo(nn.Module):
    def __init__(self, cfg: ProtLingoConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg)
        self.memory = nn.ModuleDict({str(i): LatentNgramMemory(cfg) for i in sorted(cfg.memory_layers)})
        self.layers = nn.ModuleList(EsmBlock(cfg, i in cfg.moe_layers) for i in range(cfg.n_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        self.head = LMHead(cfg)
        self.reset_parameters()

    def reset_parameters(self):
        """Random ESM-style init (BERT: N(0, init_std), zero biases, unit norms); memory tables and DWConv stay zero.
        A continued-pretraining run overwrites the backbone with ESM2's weights (tools/upcycle_esm2.py)."""
        std = self.cfg.init_std
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, 0.0, std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        for layer in self.layers:
            if isinstance(layer.ffn, UpcycledMoE):
                nn.init.normal_(layer.ffn.router.weight, 0.0, self.cfg.router_init_std)
        nn.init.normal_(self.embed.weight, 0.0, std)

    @property
    def routing_layers(self) -> int:
        return sum(isinstance(layer.ffn, UpcycledMoE) for layer in self.layers)

    def no_weight_decay(self) -> set[str]:
        """Memory tables are looked up sparsely: decay would shrink every row at every step, addressed or not."""
        return {f"memory.{i}.tables" for i in self.memory}

    def lr_groups(self) -> dict[str, set[str]]:
        """Named parameter groups whose learning rate ``optim.lr_scale`` may multiply (paper: the memory table can
        use its own multiplier, to adapt faster than the pretrained backbone)."""
        return {"memory_tables": {f"memory.{i}.tables" for i in self.memory}}

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                real_index: torch.Tensor | None = None,
                route_override: dict[int, torch.Tensor] | None = None) -> ProtLingoOutput:
        """tokens, attention_mask: [B, L] (mask True at real tokens, rows right-padded) -> ProtLingoOutput.
        ``real_index`` [T] long on the device: the flat positions of the real tokens, which the MoE layers route
        (given, nothing in the forward reads the device; else read once from the mask).

        ``route_override`` {MoE block: forced [B, L] long}: positions >= 0 run through that expert instead of the
        top-1, -1 keep it (Fig. 4b's intervention); None is the unmodified forward, bit for bit."""
        cfg = self.cfg
        if route_override is not None:
            check_route_override(route_override, cfg, tokens.shape)
        real = attention_mask.bool()
        residue = real & (tokens != cfg.cls_token_id) & (tokens != cfg.eos_token_id)
        h = self.embed(tokens, real)
        rope = rope_cache(tokens.shape[1], cfg.head_dim, cfg.rope_theta, h.device, torch.float32)
        routing, memory = {}, {}
        if real_index is None and self.routing_layers:
            real_index = real.reshape(-1).nonzero().squeeze(1)
        for i, layer in enumerate(self.layers):
            if str(i) in self.memory:
                h, memory[i] = self.memory[str(i)](h, residue, real)
            h, info = layer(h, rope, real, real_index, None if route_override is None else route_override.get(i))
            if info is not None:
                routing[i] = info
        logits = self.head(self.final_norm(h), self.embed.weight)
        aux = torch.stack([r.aux for r in routing.values()]).mean() if routing else None
        z = torch.stack([r.z for r in routing.values()]).mean() if routing else None
        return ProtLingoOutput(logits, aux, z, routing, memory)


# ------------------------------------------------------------------------------------------------------------------
# Weight conversion (pure functions on state dicts)
# ------------------------------------------------------------------------------------------------------------------
def config_from_hf(hf: dict, **overrides) -> ProtLingoConfig:
    """ProtLingoConfig of a Hugging Face ESM ``config.json`` (dict), with ProtLingo fields in ``overrides``."""
    if hf.get("position_embedding_type", "absolute") != "rotary" or hf.get("emb_layer_norm_before"):
        raise ValueError("config.json: only ESM2 (rotary positions, no embedding LayerNorm) is supported")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"config.json: hidden_act {hf.get('hidden_act')!r}, ESM2 uses gelu")
    return ProtLingoConfig(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                           n_heads=hf["num_attention_heads"], d_ff=hf["intermediate_size"],
                           layer_norm_eps=hf.get("layer_norm_eps", 1e-5), rope_theta=hf.get("rope_theta", 10000.0),
                           token_dropout=hf.get("token_dropout", True), mask_token_id=hf.get("mask_token_id", 32),
                           pad_token_id=hf.get("pad_token_id", 1), **overrides)


def _hf_names(n_layers: int) -> dict[str, str]:
    """Dense ProtLingo name -> Hugging Face EsmForMaskedLM name."""
    names = {"embed.weight": "esm.embeddings.word_embeddings.weight",
             "head.dense.weight": "lm_head.dense.weight", "head.dense.bias": "lm_head.dense.bias",
             "head.norm.weight": "lm_head.layer_norm.weight", "head.norm.bias": "lm_head.layer_norm.bias",
             "head.bias": "lm_head.bias",
             "final_norm.weight": "esm.encoder.emb_layer_norm_after.weight",
             "final_norm.bias": "esm.encoder.emb_layer_norm_after.bias"}
    for i in range(n_layers):
        hf, ours = f"esm.encoder.layer.{i}.", f"layers.{i}."
        pairs = {"attn_norm": "attention.LayerNorm", "attn.q": "attention.self.query",
                 "attn.k": "attention.self.key", "attn.v": "attention.self.value", "attn.o": "attention.output.dense",
                 "ffn_norm": "LayerNorm", "ffn.fc1": "intermediate.dense", "ffn.fc2": "output.dense"}
        for a, b in pairs.items():
            for p in ("weight", "bias"):
                names[f"{ours}{a}.{p}"] = f"{hf}{b}.{p}"
    return names


# HF keys with no ProtLingo counterpart: recomputed buffers, the tied decoder, and the contact head (a supervised
# add-on; ProtLingo's head is the MLM head).
_HF_UNUSED = ("rotary_embeddings.inv_freq", "position_ids", "lm_head.decoder.weight", "contact_head.")


def hf_to_protlingo(hf_state: dict, n_layers: int) -> dict[str, torch.Tensor]:
    """A dense ESM2 state dict (HF names) -> ProtLingo names; unknown keys are an error naming the first."""
    names = _hf_names(n_layers)
    hf_to_ours = {v: k for k, v in names.items()}
    out, unknown = {}, []
    for k, v in hf_state.items():
        # transformers 5 writes LayerNorm parameters under BERT's legacy names gamma/beta
        k = k.removesuffix(".gamma") + ".weight" if k.endswith(".gamma") else (
            k.removesuffix(".beta") + ".bias" if k.endswith(".beta") else k)
        if k in hf_to_ours:
            out[hf_to_ours[k]] = v
        elif not any(u in k for u in _HF_UNUSED):
            unknown.append(k)
    missing = sorted(set(names) - set(out))
    if unknown or missing:
        raise ValueError(f"not an ESM2 state dict of {n_layers} layers: unknown {unknown[:3]}, missing {missing[:3]}")
    return out


def upcycle_ffn(dense: dict, prefix: str, cfg: ProtLingoConfig, perturb: float = 0.0,
                generator: torch.Generator | None = None) -> dict:
    """The dense FFN ``prefix``fc1/fc2 -> shared expert (units S = [0, |S|), with b2) + E copies of R = [|S|, d_ff).

    ``perturb`` > 0 adds N(0, (perturb * std(W))^2) noise to the weights of routed experts 1..E-1 (expert 0 stays
    the exact copy); 0 keeps shared + routed_e == dense for every e."""
    w1, b1 = dense[prefix + "fc1.weight"], dense[prefix + "fc1.bias"]  # [d_ff, d], [d_ff]
    w2, b2 = dense[prefix + "fc2.weight"], dense[prefix + "fc2.bias"]  # [d, d_ff], [d]
    S = cfg.shared_hidden
    out = {prefix + "shared.fc1.weight": w1[:S].clone(), prefix + "shared.fc1.bias": b1[:S].clone(),
           prefix + "shared.fc2.weight": w2[:, :S].clone(), prefix + "shared.fc2.bias": b2.clone()}
    for e in range(cfg.num_experts):
        parts = {"fc1.weight": w1[S:], "fc1.bias": b1[S:], "fc2.weight": w2[:, S:]}
        for name, t in parts.items():
            t = t.clone()
            if perturb and e > 0 and name.endswith("weight"):
                t += torch.randn(t.shape, generator=generator, dtype=t.dtype) * (perturb * float(t.std()))
            out[f"{prefix}deepspeed_moe.experts.deepspeed_experts.{e}.{name}"] = t
    return out


# The ProtLingoConfig fields an ESM2 checkpoint fixes (config_from_hf); the rest (MoE, memory, kernels) are choices.
NOT_BACKBONE = ("moe_layers", "num_experts", "moe_shared_hidden", "moe_backend", "router_init_std", "memory_layers",
                "memory_bits", "memory_radius", "memory_dim", "memory_latent", "memory_table_size", "attn_backend",
                "init_std")


def backbone_mismatch(cfg: ProtLingoConfig, hf_config: dict) -> str | None:
    """The first backbone field where ``cfg`` differs from an ESM2 ``config.json``: "model.NAME is A but the
    checkpoint gives B"; None when they agree."""
    base = config_from_hf(hf_config)
    for name in sorted(f.name for f in dataclasses.fields(ProtLingoConfig) if f.name not in NOT_BACKBONE):
        if getattr(cfg, name) != getattr(base, name):
            return f"model.{name} is {getattr(cfg, name)!r} but the checkpoint gives {getattr(base, name)!r}"
    return None


def state_from_esm2(hf_config: dict, hf_state: dict, cfg: ProtLingoConfig, fresh: dict) -> dict:
    """A state dict for ``cfg`` from a dense ESM2 checkpoint (config.json dict, Hugging Face names): the backbone
    copied, MoE layers upcycled exactly (every routed expert = shared + routed == the dense FFN), routers and memory
    from ``fresh``. ValueError naming the first field when the checkpoint is not ``cfg``'s backbone."""
    why = backbone_mismatch(cfg, hf_config)
    if why:
        raise ValueError(why)
    return upcycle_state_dict(hf_to_protlingo(hf_state, cfg.n_layers), cfg, fresh)


def upcycle_state_dict(dense: dict, cfg: ProtLingoConfig, fresh: dict, perturb: float = 0.0,
                       generator: torch.Generator | None = None) -> dict:
    """Dense ESM2 weights (ProtLingo names) -> a state dict for ``cfg``: MoE layers upcycled, every parameter the
    dense model lacks (routers, memory) taken from ``fresh`` (a newly initialized model's state dict)."""
    out = {}
    moe_prefixes = [f"layers.{i}.ffn." for i in cfg.moe_layers]
    for k, v in dense.items():
        if not any(k.startswith(p) for p in moe_prefixes):
            out[k] = v
    for p in moe_prefixes:
        out.update(upcycle_ffn(dense, p, cfg, perturb, generator))
    for k, v in fresh.items():
        out.setdefault(k, v)
    extra = sorted(set(out) - set(fresh))
    if extra:
        raise ValueError(f"upcycled keys the model does not have: {extra[:3]}")
    return out
