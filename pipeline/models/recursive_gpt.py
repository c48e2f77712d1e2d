"""RecursiveGPT and its standard-Transformer baseline (paper 003, Sec. 2.3 and 4; DESIGN.md section 5).

RecursiveGPT, a recursive causal decoder (one shared block applied R times):

    h_0    = x W_emb W_proj                         factorized input map V -> E -> H      [B, L, H]
    h_r    = F_theta(h_{r-1}; phi_r),  r = 1..R     shared causal block, per-step norms phi_r
    logits = N_f(h_R) W_down W_out                  untied factorized head H -> E -> V    [B, L, V]

with the pre-norm block F(h; phi) = h' + MLP(N_mlp(h')), h' = h + Attn(N_attn(h)), attention 4H^2 (no GQA, no
biases) with QK normalization, and an MLP of two matrices (H -> mlp_ratio * H -> H, GELU). E == H (or
``embed_dim: null``) drops W_proj and W_down: the maps are then a plain V x H embedding and V x H head.

Per-step parameters phi_r (the paper's "lightweight depth conditioning"): RMSNorm gains + a learned bias on the
attention and MLP sublayer inputs (2H + 2H), and QK-norm gains on q and on k. ``share_norms: true`` keeps one phi for
every step (the paper's ablation). Evaluating at a depth R' != R: for R' < R steps 1..R' use phi_1..phi_R'; for
R' > R the steps beyond R reuse phi_R (the last trained step's norms), the only trained choice available there.

Norm/bias choice (the paper omits it; picked to land closest to its reported counts, see tools/params.py):
QK normalization is an RMSNorm over the full H-wide query (and key) vector before the split into heads, with an
H-wide gain each (OLMo-2 style), and no bias; plus one final RMSNorm (gain only) before the head. Per step that
is 6H parameters. Counts (paper: 27.6M / 124.0M / 404.1M; 41.1M / 28.7M / 1.22B):

    (H, E, R) = (640, 192, 16)      27,636,352  (+0.036M)
    (1408, 768, 24)                124,067,200  (+0.067M)
    (2560, 2560, 24)               404,072,960  (-0.027M)
    standard H=384                  41,119,104  (+0.019M)
    standard H=384, E=192           28,683,648  (-0.016M)
    standard H=3072              1,220,766,720  (+0.001B)

Alternatives tried: per-head QK norms (2 x head_dim per step): 27.618M / 124.003M / 403.953M (the large model
-0.147M off); one QK norm shared by q and k (5H per step): 27.626M / 124.033M / 404.012M (-0.088M). The full-width
q and k norms have the smallest worst-case and summed error.

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
        if self.mlp_ratio <= 0 or abs(self.mlp_ratio * self.d_model - round(self.mlp_ratio * self.d_model)) > 1e-6:
            raise ValueError(f"model.mlp_ratio: mlp_ratio * d_model must be a positive integer, got "
                             f"{self.mlp_ratio} * {self.d_model}")
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
        """Shared weights of one block: q, k, v, o (4H^2) and the two MLP matrices (2 H d_ff)."""
        return 4 * self.d_model ** 2 + 2 * self.d_model * self.d_ff

    def step_norm_params(self) -> int:
        """phi_r: attention and MLP RMSNorm gains + biases (4H), q and k norm gains (2H)."""
        return 6 * self.d_model

    def _count(self, n_blocks: int, n_norm_sets: int) -> int:
        return 2 * self.vocab_map_params() + n_blocks * self.block_params() + n_norm_sets * self.step_norm_params() \
            + self.d_model  # final norm

    def _flops(self, n_steps: int, length: int) -> int:
        """Forward FLOPs of one sequence (a multiply-add counts two; attention scores counted over the full L x L,
        as is usual, although the causal mask halves the useful part)."""
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

    def __init__(self, d_model: int, eps: float):
        super().__init__()
        self.attn_norm = BiasedRMSNorm(d_model, eps)
        self.mlp_norm = BiasedRMSNorm(d_model, eps)
        self.q_norm = RMSNorm(d_model, eps)  # over the full H-wide query, before the head split
        self.k_norm = RMSNorm(d_model, eps)


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention (n_kv_heads = n_heads), RoPE; the QK norms come from the step's StepNorms."""

    def __init__(self, cfg: _GPTConfig):
        super().__init__()
        H = cfg.d_model
        self.n_heads, self.head_dim, self.backend = cfg.n_heads, cfg.head_dim, cfg.attn_backend
        self.q_proj = nn.Linear(H, H, bias=False)
        self.k_proj = nn.Linear(H, H, bias=False)
        self.v_proj = nn.Linear(H, H, bias=False)
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, x: torch.Tensor, norms: StepNorms, rope: tuple, key_mask: torch.Tensor,
                segments: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B, L, H]; key_mask: [B, L] bool (True at real tokens, right-padded); segments: [B, L] document ids of
        packed rows (-1 at padding) or None -> [B, L, H]."""
        B, L, H = x.shape
        heads = lambda t: t.view(B, L, self.n_heads, self.head_dim).transpose(1, 2)  # noqa: E731  [B, nh, L, hd]
        q = heads(norms.q_norm(self.q_proj(x)))
        k = heads(norms.k_norm(self.k_proj(x)))
        v = heads(self.v_proj(x))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out = attend(q, k, v, key_mask, backend=self.backend, causal=True, segments=segments)  # [B, nh, L, hd]
        return self.o_proj(out.transpose(1, 2).reshape(B, L, H))


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

    def _inputs(self, tokens, attention_mask, position_ids=None):
        """Embeddings [B, L, H], RoPE tables ([L, hd/2], or [B, L, hd/2] from per-document ``position_ids``) and
        the padding mask [B, L]."""
        key_mask = (torch.ones_like(tokens, dtype=torch.bool) if attention_mask is None
                    else attention_mask.bool())
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
        self.norms = nn.ModuleList(StepNorms(cfg.d_model, cfg.norm_eps)
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
        depth = self.cfg.recurrence if depth is None else int(depth)
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        h, rope, key_mask = self._inputs(tokens, attention_mask, position_ids)
        for r in range(depth):
            h = self.block(h, self.step_norms(r), rope, key_mask, document_ids)
        return self.head(self.final_norm(h))


class StandardGPT(_Decoder):
    """The paper's standard baseline: n_layers distinct causal blocks, each with its own norms."""

    def __init__(self, cfg: StandardGPTConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = FactorizedEmbedding(cfg)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.n_layers))
        self.norms = nn.ModuleList(StepNorms(cfg.d_model, cfg.norm_eps) for _ in range(cfg.n_layers))
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = FactorizedHead(cfg)
        self._init_weights(cfg.n_layers)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                depth: int | None = None, document_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Same interface as RecursiveGPT; ``depth`` must be None or n_layers (a standard stack has one depth)."""
        if depth is not None and int(depth) != self.cfg.n_layers:
            raise ValueError(f"a standard decoder runs its {self.cfg.n_layers} layers, got depth {depth}")
        h, rope, key_mask = self._inputs(tokens, attention_mask, position_ids)
        for block, norms in zip(self.blocks, self.norms):
            h = block(h, norms, rope, key_mask, document_ids)
        return self.head(self.final_norm(h))
