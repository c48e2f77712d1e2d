"""RecursiveGPT and a standard-Transformer baseline (paper 003, Sec. 2.3, 4; docs/recursive_gpt.md, "Parameter counts").

RecursiveGPT, a recursive causal decoder (one shared block applied R times):

    h_0    = x W_emb W_proj                         factorized input map V -> E -> H      [B, L, H]
    h_r    = F_theta(h_{r-1}; phi_r),  r = 1..R     shared causal block, per-step norms phi_r
    logits = N_f(h_R) W_down W_out                  untied factorized head H -> E -> V    [B, L, V]

with the pre-norm block F(h; phi) = h' + MLP(N_mlp(h')), h' = h + Attn(N_attn(h)), an MLP of two matrices
(H -> mlp_ratio * H -> H, GELU) and attention 4H^2 (no GQA, no biases) with per-head QK normalization and a head-wise
output gate (Qiu et al., "Gated attention for LLMs", which the paper's Appendix B cites):

    a        = N_attn(h)                                               [B, L, H]
    q_j, k_j = N_q((a W_q)_j), N_k((a W_k)_j);  v_j = (a W_v)_j        head j = 1..n_heads; RMSNorm over head_dim
    o_j      = softmax(RoPE(q_j) RoPE(k_j)^T / sqrt(hd) + causal) v_j  [B, L, hd]
    Attn(a)  = concat_j(sigmoid(a W_g)_j * o_j) W_o                    W_g: H x n_heads, one gate per head and token

E == H (or ``embed_dim: null``) drops W_proj and W_down: the maps are then a plain V x H embedding and V x H head.

Per-step parameters phi_r (the paper's "lightweight depth conditioning"): RMSNorm gains + a learned bias on the
attention and MLP sublayer inputs (2H + 2H), and head_dim-wide QK-norm gains on q and on k (shared by the heads).
``share_norms: true`` keeps one phi for every step (the paper's ablation). The gate W_g is a block weight: one for the
shared block, used by every step (each standard layer has its own). Evaluating at a depth R' != R: for R' < R steps
1..R' use phi_1..phi_R'; for R' > R the steps beyond R reuse phi_R (the last trained step's norms), the only trained
choice available there.

Why these norms and the gate (the paper's Appendix B, which has the details, is missing from its text): the count

    N = 2 (V E + E H [factorized]) + 4H^2 + H n_heads + 2 H d_ff + n_sets (4H + 2 head_dim) + H (final norm)

with V = 32768, 64-wide heads, d_ff = 16H (RecursiveGPT) or 2.5H (12-layer standard models) and n_sets = R (1 with
share_norms; for a standard model n_layers, which then also multiplies the block terms) reproduces every figure in
the paper's Tables 1-3 within its rounding (tests/pipeline/models/test_recursive_gpt.py):

    RecursiveGPT + FE (H, E, R) = (640, 192, 16)     27,624,320   paper 27.6M
    RecursiveGPT + FE (1408, 768, 24)               124,033,664   paper 124.0M
    RecursiveGPT-Large (2560, 2560, 24)             404,055,552   paper 404.1M
    Table 3, shared norm parameters (640, 192, 16)   27,584,000   paper 27.6M
    Table 3, no FE, H = 640, R = 16                  56,738,688   paper 56.7M
    Table 3, no FE, H = 384, R = 16                  30,503,552   paper 30.5M
    standard 12 layers, H = 384                      41,139,072   paper 41.1M
    standard 12 layers, H = 384, E = 192             28,703,616   paper 28.7M
    standard 12 layers, H = 3072                  1,222,464,000   paper 1.22B

Dropping the gate puts RecursiveGPT-Large at 403.953M (paper 404.1M); full-width (H) QK gains instead of per-head
ones put the 124M model at 124.098M with the gate (124.067M without); a gate per step instead of per block gives
27.72M. The baselines fit within rounding with or without the gate (41.111M / 28.676M / 1.2207B without); they carry
it because the paper builds RecursiveGPT on "the same architectural and training details as the standard models
described in Appendix B", the appendix that cites gated attention.

The standard baseline (StandardGPT) is the same decoder with ``n_layers`` distinct blocks, each with its own norms.
Every parameter is used inside a submodule's ``forward`` (ZeRO-3 gathers per module).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.layers import ATTN_BACKENDS, RMSNorm, apply_rope, attend, init_linear_, residual_std, rope_cache


@dataclass
class _GPTConfig:
    """Fields and accounting shared by the recursive and the standard decoder."""

    vocab_size: int = 32768
    d_model: int = 640  # H
    embed_dim: int | None = 192  # E; null or == d_model: unfactorized (no projection)
    n_heads: int = 10
    mlp_ratio: float = 16.0  # MLP width = mlp_ratio * H
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # Execution choices (same parameters, same outputs) a resumed run may change (pipeline/checkpoint/resume.py)
    RESUME_FREE = ("attn_backend",)
    attn_backend: str = "auto"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}: must be >= 1, got {getattr(self, name)}")
        if self.embed_dim is not None and not 1 <= self.embed_dim <= self.d_model:
            raise ValueError(f"model.embed_dim: must be in [1, d_model={self.d_model}] or null, got {self.embed_dim}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"model.n_heads: head dim {self.d_model // self.n_heads} must be even for RoPE")
        if not (0 < self.mlp_ratio < float("inf")) or \
                abs(self.mlp_ratio * self.d_model - round(self.mlp_ratio * self.d_model)) > 1e-6:
            raise ValueError(f"model.mlp_ratio: mlp_ratio * d_model must be a positive integer, got "
                             f"{self.mlp_ratio} * {self.d_model}")
        for name in ("norm_eps", "rope_theta", "init_std"):  # written "not > 0" so that nan fails too
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name}: must be > 0, got {getattr(self, name)}")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"model.attn_backend: must be one of {ATTN_BACKENDS}, got {self.attn_backend!r}")

    # ---- accounting known before the model is built -----------------------------------------------------------
    @property
    def factorized(self) -> bool:
        return self.embed_dim is not None and self.embed_dim != self.d_model

    @property
    def e(self) -> int:
        """Width of the vocabulary maps: E, or H when unfactorized."""
        return self.embed_dim if self.factorized else self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_ff(self) -> int:
        return int(round(self.mlp_ratio * self.d_model))

    def vocab_map_params(self) -> int:
        """One of the two untied maps: V x E (+ E x H projection when factorized)."""
        return self.vocab_size * self.e + (self.e * self.d_model if self.factorized else 0)

    def block_params(self) -> int:
        """Shared weights of one block: q, k, v, o (4H^2), the head-wise output gate (H x n_heads) and the two MLP
        matrices (2 H d_ff)."""
        return 4 * self.d_model ** 2 + self.d_model * self.n_heads + 2 * self.d_model * self.d_ff

    def step_norm_params(self) -> int:
        """phi_r: attention and MLP RMSNorm gains + biases (4H), per-head q and k norm gains (2 head_dim)."""
        return 4 * self.d_model + 2 * self.head_dim

    def _count(self, n_blocks: int, n_norm_sets: int) -> int:
        return 2 * self.vocab_map_params() + n_blocks * self.block_params() + n_norm_sets * self.step_norm_params() \
            + self.d_model  # final norm

    def _flops(self, n_steps: int, length: int) -> int:
        """Forward FLOPs of one sequence (a multiply-add counts two; every block matrix, the gate's included, once
        per token; attention scores counted over the full L x L, as is usual, although the causal mask halves the
        useful part; norms and other elementwise work not counted)."""
        L, H, e = length, self.d_model, self.e
        maps = 2 * L * self.vocab_size * e + (4 * L * e * H if self.factorized else 0)  # head logits, both projs
        block = 2 * L * self.block_params() + 4 * L * L * H
        return maps + n_steps * block


@dataclass
class RecursiveGPTConfig(_GPTConfig):
    recurrence: int = 16  # R, the trained number of steps of the shared block
    share_norms: bool = False  # one set of per-step norms for every step (ablation)

    def __post_init__(self):
        super().__post_init__()
        if self.recurrence < 1:
            raise ValueError(f"model.recurrence: must be >= 1, got {self.recurrence}")

    def num_params(self) -> int:
        return self._count(1, 1 if self.share_norms else self.recurrence)

    def forward_flops(self, length: int, depth: int | None = None) -> int:
        return self._flops(self.recurrence if depth is None else depth, length)


@dataclass
class StandardGPTConfig(_GPTConfig):
    d_model: int = 384
    embed_dim: int | None = None
    n_heads: int = 6
    mlp_ratio: float = 2.5
    n_layers: int = 12

    def __post_init__(self):
        super().__post_init__()
        if self.n_layers < 1:
            raise ValueError(f"model.n_layers: must be >= 1, got {self.n_layers}")

    def num_params(self) -> int:
        return self._count(self.n_layers, self.n_layers)

    def forward_flops(self, length: int, depth: int | None = None) -> int:
        return self._flops(self.n_layers, length)


# ------------------------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------------------------
class BiasedRMSNorm(RMSNorm):
    """RMSNorm(x) * g + b: the learned bias acts as a per-step depth embedding (paper Sec. 4)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.bias.to(x.dtype)


class StepNorms(nn.Module):
    """phi_r: the normalization parameters of one recurrent step (or of one standard layer)."""

    def __init__(self, d_model: int, head_dim: int, eps: float):
        super().__init__()
        self.attn_norm = BiasedRMSNorm(d_model, eps)
        self.mlp_norm = BiasedRMSNorm(d_model, eps)
        self.q_norm = RMSNorm(head_dim, eps)  # per head: over each head's query [.., hd], gain shared by the heads
        self.k_norm = RMSNorm(head_dim, eps)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention (n_kv_heads = n_heads), RoPE, head-wise output gate (Qiu et al.); the QK norms
    come from the step's StepNorms, the gate belongs to the block (shared by every step that runs it)."""

    def __init__(self, cfg: _GPTConfig):
        super().__init__()
        H = cfg.d_model
        self.n_heads, self.head_dim, self.backend = cfg.n_heads, cfg.head_dim, cfg.attn_backend
        self.q_proj = nn.Linear(H, H, bias=False)
        self.k_proj = nn.Linear(H, H, bias=False)
        self.v_proj = nn.Linear(H, H, bias=False)
        self.gate = nn.Linear(H, cfg.n_heads, bias=False)  # W_g: one gate logit per head
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor, norms: StepNorms, rope: tuple, key_mask: torch.Tensor,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, L, H] (the normalized sublayer input); key_mask: [B, L] bool (True at real tokens, right-padded) or None;
        segments: [B, L] document ids of packed rows (-1 at padding) or None -> [B, L, H]."""
        B, L, H = x.shape
        split = lambda t: t.view(B, L, self.n_heads, self.head_dim)  # noqa: E731  [B, L, nh, hd]
        q = norms.q_norm(split(self.q_proj(x))).transpose(1, 2)  # [B, nh, L, hd], RMS over each head's hd
        k = norms.k_norm(split(self.k_proj(x))).transpose(1, 2)
        v = split(self.v_proj(x)).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attend(q, k, v, key_mask, backend=self.backend, causal=True, segments=segments)  # [B, nh, L, hd]
        gate = torch.sigmoid(self.gate(x))  # [B, L, nh]: each head's output at each position scaled by (0, 1)
        out = out.transpose(1, 2) * gate.unsqueeze(-1)  # [B, L, nh, hd]
        return self.o_proj(out.reshape(B, L, H))


class MLP(nn.Module):
    """Two matrices: H -> d_ff -> H with GELU in between."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.up_proj = nn.Linear(d_model, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.up_proj(x)))


class DecoderBlock(nn.Module):
    """Pre-norm causal block; its norms are passed in so that one block can run under R different phi_r."""

    def __init__(self, cfg: _GPTConfig):
        super().__init__()
        self.attn = CausalSelfAttention(cfg)
        self.mlp = MLP(cfg.d_model, cfg.d_ff)

    def forward(self, h, norms: StepNorms, rope, key_mask, segments=None):
        h = h + self.attn(norms.attn_norm(h), norms, rope, key_mask, segments)
        return h + self.mlp(norms.mlp_norm(h))


class FactorizedEmbedding(nn.Module):
    """tokens [B, L] -> x W_emb (W_proj) [B, L, H]."""

    def __init__(self, cfg: _GPTConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.e)
        self.proj = nn.Linear(cfg.e, cfg.d_model, bias=False) if cfg.factorized else None

    def forward(self, tokens):
        x = self.embed(tokens)
        return self.proj(x) if self.proj is not None else x


class FactorizedHead(nn.Module):
    """h [B, L, H] -> (h W_down) W_out [B, L, V]; untied from the input map."""

    def __init__(self, cfg: _GPTConfig):
        super().__init__()
        self.down = nn.Linear(cfg.d_model, cfg.e, bias=False) if cfg.factorized else None
        self.out = nn.Linear(cfg.e, cfg.vocab_size, bias=False)

    def forward(self, h):
        return self.out(self.down(h) if self.down is not None else h)


class _Decoder(nn.Module):
    def _init_weights(self, n_blocks: int):
        cfg = self.cfg
        # Residual outputs (o_proj, down_proj) scaled by the effective depth: R applications or n_layers blocks.
        init_linear_(self, cfg.init_std, residual_std(cfg.init_std, n_blocks))
        # Gates start at W_g = 0: sigmoid(0) = 0.5 for every head and token, i.e. the ungated block with its attention
        # branch halved, instead of random gates that would mute some heads at random from step 0. The gradient of
        # W_g (x^T times dL/dlogit) is non-zero from the first step, so the gates still learn.
        for m in self.modules():
            if isinstance(m, CausalSelfAttention):
                nn.init.zeros_(m.gate.weight)

    def _inputs(self, tokens, attention_mask, position_ids=None):
        """Embeddings [B, L, H], RoPE tables ([L, hd], or [B, L, hd] from per-document ``position_ids``) and
        the padding mask [B, L]."""
        key_mask = None if attention_mask is None else attention_mask.bool()  # None: no padding (layers.attend)
        h = self.embed(tokens)  # [B, L, H]
        cos, sin = rope_cache(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, h.device, h.dtype)
        if position_ids is not None:
            cos, sin = cos[position_ids], sin[position_ids]
        return h, (cos, sin), key_mask


class RecursiveGPT(_Decoder):
    def __init__(self, cfg: RecursiveGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = FactorizedEmbedding(cfg)
        self.block = DecoderBlock(cfg)
        self.norms = nn.ModuleList(StepNorms(cfg.d_model, cfg.head_dim, cfg.norm_eps)
                                   for _ in range(1 if cfg.share_norms else cfg.recurrence))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = FactorizedHead(cfg)
        self._init_weights(cfg.recurrence)

    def step_norms(self, r: int) -> StepNorms:
        """phi for 0-based step r; steps past the trained R (or every step, with share_norms) use the last set."""
        return self.norms[min(r, len(self.norms) - 1)]

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                depth: int | None = None, document_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, attention_mask: [B, L] (mask True at real tokens, right-padded); depth R' >= 1 (default R);
        document_ids, position_ids: [B, L] for packed rows (attention stays within a document, positions restart).
        Returns next-token logits [B, L, V]: position t predicts token t + 1 from tokens <= t."""
        return self.head(self.features(tokens, attention_mask, depth, document_ids, position_ids))

    def features(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 depth: int | None = None, document_ids: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final-normed hidden states [B, L, H] the head reads (forward's arguments): an HF base model's
        last_hidden_state (pipeline/families/modeling_gpt.py)."""
        depth = self.cfg.recurrence if depth is None else int(depth)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        h, rope, key_mask = self._inputs(tokens, attention_mask, position_ids)
        for r in range(depth):
            h = self.block(h, self.step_norms(r), rope, key_mask, document_ids)
        return self.final_norm(h)


class StandardGPT(_Decoder):
    """The paper's standard baseline: n_layers distinct causal blocks, each with its own norms."""

    def __init__(self, cfg: StandardGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = FactorizedEmbedding(cfg)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layers))
        self.norms = nn.ModuleList(StepNorms(cfg.d_model, cfg.head_dim, cfg.norm_eps) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = FactorizedHead(cfg)
        self._init_weights(cfg.n_layers)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                depth: int | None = None, document_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Same interface as RecursiveGPT; ``depth`` must be None or n_layers (a standard stack has one depth)."""
        return self.head(self.features(tokens, attention_mask, depth, document_ids, position_ids))

    def features(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 depth: int | None = None, document_ids: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final-normed hidden states [B, L, H] the head reads (RecursiveGPT.features)."""
        if depth is not None and int(depth) != self.cfg.n_layers:
            raise ValueError(f"a standard decoder runs its {self.cfg.n_layers} layers, got depth {depth}")
        h, rope, key_mask = self._inputs(tokens, attention_mask, position_ids)
        for block, norms in zip(self.blocks, self.norms):
            h = block(h, norms, rope, key_mask, document_ids)
        return self.final_norm(h)
