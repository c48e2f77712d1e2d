"""Eco-RNA: recurrent-depth RNA masked language model (paper 000, Sec. 2.2 and A.1).

    e      = N_p(P(E x~))                                         prelude, once        [B, L, d]
    s_0    ~ N(0, sigma_init^2), zero at padding                                        [B, L, d]
    s_k    = N_r(R(alpha * s_{k-1} + delta * B e)),  k = 1..K      shared core, K times
    logits = N_o(C(W_o s_K)) E^T                                   coda + tied head     [B, L, V]

with delta = softplus(b), alpha = a_min + (a_max - a_min) * exp(-delta * exp(min(a, a_cap))) per channel.

Every computation runs inside a submodule's ``forward`` (the tied head included), so ZeRO-3's per-module parameter
gathering sees every use of every parameter.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from pipeline.models.layers import (ATTN_BACKENDS, RMSNorm, SandwichBlock, Varlen, flash_available, host_tensor,
                                    init_linear_, residual_std, rope_cache, torch_varlen_available, varlen_kernel)


@dataclass
class EcoRNAConfig:
    vocab_size: int = 23
    d_model: int = 768
    n_heads: int = 12
    n_kv_heads: int = 6
    d_ff: int = 3072
    n_prelude: int = 3
    n_core: int = 3
    n_coda: int = 3
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # The paper's Table A1 values were lost in extraction; these are our documented choices (docs/eco_rna.md).
    # initial-state std. 1.0 (the scale N_r gives states) stalled learning on a copy task built from real RNA; 0.3 learns
    sigma_init: float = 0.3
    alpha_min: float = 0.1
    alpha_max: float = 0.9
    a_cap: float = 4.0
    # Initial injection scale delta = softplus(b) and retention alpha of every channel (Eq. 3). null alpha_init: a = 0,
    # alpha = 0.394 at delta 1. (alpha 0.85, delta 0.3 starts with the state dominating the update; on the CPU demo
    # training grows B until the injection dominates again: docs/benchmarks.md, issue 14.)
    delta_init: float = 1.0
    alpha_init: float | None = None
    init_std: float = 0.02
    # Execution choices (same parameters, same outputs) a resumed run may change (pipeline/checkpoint/resume.py)
    RESUME_FREE = ("attn_backend", "unpad")
    attn_backend: str = "auto"
    # true: blocks run on the packed real tokens [T, d] (varlen attention: flash-attn's kernel when attn_backend
    # selects it, torch's varlen kernel on CUDA with attn_backend "auto", else one SDPA call per sequence); false:
    # padded rows [B, L, d]; "auto": packed exactly when a varlen kernel runs (attn_backend "flash", or "auto" on CUDA
    # with flash-attn or torch's varlen kernel working). Same parameters and, at real tokens, the same outputs.
    unpad: bool | str = "auto"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "d_ff", "n_core"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("n_prelude", "n_coda"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.{name}: must be >= 0, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads: d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(f"model.n_heads: head dim {self.d_model // self.n_heads} must be even for RoPE")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads: n_heads {self.n_heads} is not divisible by {self.n_kv_heads}")
        if not 0 < self.alpha_min < self.alpha_max < 1:
            raise ValueError(f"model.alpha_min: need 0 < alpha_min < alpha_max < 1, "
                             f"got {self.alpha_min}, {self.alpha_max}")
        if not self.delta_init > 0:
            raise ValueError(f"model.delta_init: must be > 0, got {self.delta_init}")
        if self.alpha_init is not None and not self.alpha_min < self.alpha_init < self.alpha_max:
            raise ValueError(f"model.alpha_init: must lie strictly between alpha_min {self.alpha_min} and alpha_max "
                             f"{self.alpha_max}, got {self.alpha_init}")
        if self.alpha_init is not None and self.inject_a_init() >= self.a_cap:
            raise ValueError(f"model.alpha_init: {self.alpha_init} needs a = {self.inject_a_init():.3g} above a_cap "
                             f"{self.a_cap}")
        if not self.sigma_init >= 0:
            raise ValueError(f"model.sigma_init: must be >= 0, got {self.sigma_init}")
        for name in ("norm_eps", "rope_theta", "init_std"):  # written "not > 0" so that nan fails too
            if not getattr(self, name) > 0:
                raise ValueError(f"model.{name}: must be > 0, got {getattr(self, name)}")
        if not abs(self.a_cap) < float("inf"):
            raise ValueError(f"model.a_cap: must be a finite number, got {self.a_cap}")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"model.attn_backend: must be one of {ATTN_BACKENDS}, got {self.attn_backend!r}")
        if not (isinstance(self.unpad, bool) or self.unpad == "auto"):
            raise ValueError(f"model.unpad: must be true, false or 'auto', got {self.unpad!r}")

    def inject_a_init(self) -> float:
        """a with alpha(a, delta_init) = alpha_init (Eq. 3 solved for a); 0 when alpha_init is null."""
        if self.alpha_init is None:
            return 0.0
        frac = (self.alpha_init - self.alpha_min) / (self.alpha_max - self.alpha_min)
        return math.log(-math.log(frac) / self.delta_init)

    # ---- accounting known before the model is built -----------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_kv(self) -> int:
        """Total key (= value) width."""
        return self.n_kv_heads * self.head_dim

    def block_params(self) -> int:
        d = self.d_model
        attn = 2 * d * d + 2 * d * self.d_kv + 2 * self.head_dim  # q, o, k, v, QK-norm gains
        return attn + 3 * d * self.d_ff + 4 * d  # SwiGLU, four sandwich norms

    def num_params(self) -> int:
        d = self.d_model
        blocks = (self.n_prelude + self.n_core + self.n_coda) * self.block_params()
        # tied embedding, B and W_o, a and b, N_p N_r N_o
        return self.vocab_size * d + blocks + 2 * d * d + 2 * d + 3 * d

    def block_flops(self, length: int) -> int:
        """Eq. A.8: 4 L d (d + d_kv) + 4 L^2 d + 6 L d d_f (a multiply-add counts two)."""
        L, d = length, self.d_model
        return 4 * L * d * (d + self.d_kv) + 4 * L * L * d + 6 * L * d * self.d_ff

    def forward_flops(self, depth: int, length: int) -> int:
        """Eq. A.9: D(K) F_blk + 2 (K + 1) L d^2 + 2 L d |V|, with D(K) = L_p + K L_r + L_c."""
        L, d = length, self.d_model
        blocks = self.n_prelude + depth * self.n_core + self.n_coda
        return blocks * self.block_flops(L) + 2 * (depth + 1) * L * d * d + 2 * L * d * self.vocab_size

    def train_flops(self, depths: list, length: int, backward_window: int, n_anchor_readouts: int = 0) -> int:
        """FLOPs one training microbatch actually executes: per row the prelude, K_i core iterations (B e recomputed
        in each) and the readout forward; the no-grad anchor readouts; and twice the forward FLOPs of the
        differentiated part (prelude, last min(K_i, W) iterations, readout) for the backward."""
        L, d = length, self.d_model
        blk = self.block_flops(L)
        prelude, core_iter = self.n_prelude * blk, self.n_core * blk + 2 * L * d * d
        readout = 2 * L * d * d + self.n_coda * blk + 2 * L * d * self.vocab_size
        forward = sum(prelude + k * core_iter + readout for k in depths) + n_anchor_readouts * readout
        differentiated = sum(prelude + min(k, backward_window) * core_iter + readout for k in depths)
        return forward + 2 * differentiated


def initial_state(cfg: EcoRNAConfig, attention_mask: torch.Tensor, generator: torch.Generator | None = None,
                  table: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                  on_device: bool = False) -> torch.Tensor:
    """s_0 [B, L, d] on attention_mask's device, zero at padding: fresh N(0, sigma_init^2) draws from ``generator``
    (training), or the first L rows of a seed-fixed position-indexed table [L_max, d] (evaluation sweeps, so every
    depth starts from the same state). fp32, or ``dtype``.

    Fresh draws are made on the CPU and copied, so that a seed gives the same state on every device; with
    ``on_device`` and a mask on an accelerator they are made there instead, in ``dtype``, from a device generator
    seeded by one draw of ``generator``: the state still follows from the generator alone (a microbatch's origin,
    so a run replays and continues identically on another world size), but per device type. That saves a [B, L, d]
    fp32 draw on one CPU thread and its copy at every microbatch (about a quarter of a step on one H200)."""
    B, L = attention_mask.shape
    dev = attention_mask.device
    if table is None and on_device and dev.type != "cpu":
        g = torch.Generator(device=dev).manual_seed(int(torch.randint(2 ** 63 - 1, (), generator=generator)))
        s0 = torch.randn(B, L, cfg.d_model, generator=g, device=dev, dtype=dtype or torch.float32)
        return s0.mul_(cfg.sigma_init).mul_(attention_mask[..., None].to(s0.dtype))
    if table is not None:
        s0 = table[:L].float().expand(B, L, -1)
    else:
        s0 = torch.randn(B, L, cfg.d_model, generator=generator) * cfg.sigma_init
    s0 = s0.to(dev) * attention_mask[..., None].float()
    return s0 if dtype is None else s0.to(dtype)


def host_to(values: list, device) -> torch.Tensor:
    """Host ints as a long tensor on ``device``, copied without waiting (layers.host_tensor)."""
    return host_tensor(values, torch.long, device)


def state_table(cfg_model, length: int, seed: int) -> torch.Tensor:
    """The evaluation initial-state table [length, d], N(0, sigma_init^2), fixed by ``seed``: position-indexed, so a
    sequence's initial state does not depend on the batch (or rank) it is evaluated in. Cached (validation asks for
    it at every batch); callers only read it."""
    return _state_table(cfg_model.d_model, cfg_model.sigma_init, length, seed)


@functools.lru_cache(maxsize=4)
def _state_table(d: int, sigma: float, length: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(length, d, generator=g) * sigma


def relative_displacement(state, prev, valid, eps: float) -> torch.Tensor:
    """r_i = ||s^K - s^(K-1)||^2_V / max(||s^(K-1)||^2_V, eps) over attention-valid positions V (Eq. 9) -> [B].

    state, prev: [B, L, d]; valid: [B, L]. The training penalty (pipeline/objectives/eco_rna.py) and the adaptive
    stopping rule (:meth:`EcoRNA.adaptive`) both use this one definition."""
    v = valid[..., None].float()
    num = ((state.float() - prev.float()) ** 2 * v).sum((1, 2))
    den = (prev.float() ** 2 * v).sum((1, 2)).clamp(min=eps)
    return num / den


@dataclass
class AdaptiveOutput:
    logits: torch.Tensor  # [B, L, V] readout of each row's state at its own depth
    hidden: torch.Tensor  # [B, L, d] the readout's representation N_o(C(W_o s)) before the tied head
    depths: torch.Tensor  # [B] long: core applications each row received
    displacement: torch.Tensor  # [B] fp32: r of each row's last iteration (Eq. 9)
    row_iterations: int  # executed core row-applications, = sum_i depths_i


@dataclass
class EcoRNAOutput:
    logits: torch.Tensor | None  # [B, L, V] readout of each row's terminal state s^(K_i); None with head=False
    state: torch.Tensor  # [B, L, d] s^(K_i)
    prev_state: torch.Tensor  # [B, L, d] s^(K_i - 1) for rows with K_i >= 2
    anchor_logits: torch.Tensor | None  # [n_a, L, V] no-grad readout of s^(K_a) for rows ``anchor_rows``
    anchor_rows: torch.Tensor | None  # [n_a] rows with K_i > K_a
    row_iterations: int  # executed core row-applications, = sum_i K_i
    core_calls: int  # wavefront steps, = k_max
    # head=False (task heads, pipeline/models/heads.py): the coda features h = N_o(C(W_o s)) the tied head would read,
    # [B, L, d], and with an anchor depth the no-grad features of s^(K_a) of the anchor rows, [n_a, L, d]
    features: torch.Tensor | None = None
    anchor_features: torch.Tensor | None = None


class TiedEmbedding(nn.Module):
    """Input embedding and output head share one matrix E [V, d]; both uses go through forward (ZeRO-3)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, d_model))

    def forward(self, x: torch.Tensor, as_head: bool = False) -> torch.Tensor:
        return F.linear(x, self.weight) if as_head else F.embedding(x, self.weight)


class InputInjection(nn.Module):
    """alpha * s + delta * B e (Eq. 3-4), channelwise; B starts as the identity."""

    def __init__(self, cfg: EcoRNAConfig):
        super().__init__()
        d = cfg.d_model
        self.B = nn.Linear(d, d, bias=False)
        self.a = nn.Parameter(torch.full((d,), cfg.inject_a_init()))
        # softplus(b) = delta_init (1: full-scale injection); b = log(e^delta - 1) = delta + log(1 - e^-delta)
        self.b = nn.Parameter(torch.full((d,), cfg.delta_init + math.log(-math.expm1(-cfg.delta_init))))
        self.alpha_min, self.alpha_max, self.a_cap = cfg.alpha_min, cfg.alpha_max, cfg.a_cap

    def coefficients(self):
        delta = F.softplus(self.b)
        alpha = self.alpha_min + (self.alpha_max - self.alpha_min) * torch.exp(
            -delta * torch.exp(torch.clamp(self.a, max=self.a_cap)))
        return alpha, delta

    def forward(self, state: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        alpha, delta = self.coefficients()
        return alpha * state + delta * self.B(e)


class Stack(nn.Module):
    def __init__(self, cfg: EcoRNAConfig, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(
            SandwichBlock(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.norm_eps, cfg.attn_backend)
            for _ in range(n))

    def forward(self, x, rope, key_mask):
        for blk in self.blocks:
            x = blk(x, rope, key_mask)
        return x


class Core(nn.Module):
    """One application of the shared update: s' = N_r(R(alpha s + delta B e))."""

    def __init__(self, cfg: EcoRNAConfig):
        super().__init__()
        self.inject = InputInjection(cfg)
        self.stack = Stack(cfg, cfg.n_core)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)  # N_r

    def forward(self, state, e, rope, key_mask):
        return self.norm(self.stack(self.inject(state, e), rope, key_mask))


class Readout(nn.Module):
    """h = N_o(C(W_o s)); W_o starts as the identity."""

    def __init__(self, cfg: EcoRNAConfig):
        super().__init__()
        self.W_o = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.coda = Stack(cfg, cfg.n_coda)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)  # N_o

    def forward(self, state, rope, key_mask):
        return self.norm(self.coda(self.W_o(state), rope, key_mask))


class EcoRNA(nn.Module):
    def __init__(self, cfg: EcoRNAConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = TiedEmbedding(cfg.vocab_size, cfg.d_model)
        self.prelude = Stack(cfg, cfg.n_prelude)
        self.prelude_norm = RMSNorm(cfg.d_model, cfg.norm_eps)  # N_p
        self.core = Core(cfg)
        self.readout = Readout(cfg)
        self.reset_parameters()

    def reset_parameters(self):
        cfg = self.cfg
        n_blocks = cfg.n_prelude + cfg.n_core + cfg.n_coda
        nn.init.normal_(self.embed.weight, 0.0, cfg.init_std)
        init_linear_(self, cfg.init_std, residual_std(cfg.init_std, n_blocks))
        with torch.no_grad():  # boundary maps start as the identity (A.1)
            self.core.inject.B.weight.copy_(torch.eye(cfg.d_model))
            self.readout.W_o.weight.copy_(torch.eye(cfg.d_model))

    def no_weight_decay(self) -> set[str]:
        """Matrices that start at the identity (A.1): weight decay would pull the injection B and the readout W_o
        toward zero, away from their initialization, rather than toward it. The optimizer leaves them undecayed,
        like gains, biases and the injection vectors a, b."""
        return {"core.inject.B.weight", "readout.W_o.weight"}

    def rope(self, length: int, device, dtype):
        return rope_cache(length, self.cfg.head_dim, self.cfg.rope_theta, device, dtype)

    def _prelude(self, tokens: torch.Tensor, attention_mask: torch.Tensor):
        """(e [B, L, d]: the normalized prelude output the core re-injects, rope cache, key_mask [B, L] bool)."""
        key_mask = attention_mask.bool()
        x = self.embed(tokens)
        rope = self.rope(tokens.shape[1], x.device, x.dtype)
        return self.prelude_norm(self.prelude(x, rope, key_mask)), rope, key_mask

    def logits_at_depths(self, tokens: torch.Tensor, attention_mask: torch.Tensor, depths,
                         init_state: torch.Tensor) -> dict[int, torch.Tensor]:
        """{K: logits [B, L, V]} with every row at depth K, for each K in ``depths``, from one trajectory.

        The state after k core applications does not depend on how many follow, so reading one trajectory out after
        each requested K equals ``forward(tokens, attention_mask, K, init_state).logits`` for every K, at max(depths)
        core calls and one prelude instead of sum(depths) core calls and len(depths) preludes. For depth sweeps
        (evaluation); it neither needs nor disables autograd.
        """
        return {k: self.embed(h, as_head=True)
                for k, h in self.features_at_depths(tokens, attention_mask, depths, init_state).items()}

    def features_at_depths(self, tokens: torch.Tensor, attention_mask: torch.Tensor, depths,
                           init_state: torch.Tensor) -> dict[int, torch.Tensor]:
        """{K: coda features h = N_o(C(W_o s^(K))) [B, L, d]} for each K in ``depths``, from one trajectory: what
        :meth:`logits_at_depths` reads out before the tied head (the input of the task heads' depth sweeps)."""
        wanted = sorted({int(k) for k in depths})
        if not wanted or wanted[0] < 1:
            raise ValueError(f"depths must be >= 1, got {list(depths)}")
        e, rope, key_mask = self._prelude(tokens, attention_mask)
        s = init_state.to(e.dtype)
        out = {}
        for t in range(1, wanted[-1] + 1):
            s = self.core(s, e, rope, key_mask)
            if t in wanted:
                out[t] = self.readout(s, rope, key_mask)
        return out

    def adaptive(self, tokens: torch.Tensor, attention_mask: torch.Tensor, init_state: torch.Tensor, tol: float,
                 max_depth: int, eps: float = 1e-6) -> AdaptiveOutput:
        """Iterate every row until its relative displacement (Eq. 9, :func:`relative_displacement`) falls below
        ``tol``, or ``max_depth`` core applications; each row is read out at its own depth.

        tokens, attention_mask: [B, L]; init_state: [B, L, d]. Left-aligned: every row starts at iteration 1, and a
        row whose r_k = ||s_k - s_{k-1}||^2 / ||s_{k-1}||^2 (over its real tokens) is < ``tol`` after iteration k
        stops there with depth k. The active rows are kept as one compacted tensor (finished rows are dropped from
        it as they finish), so the core runs on exactly sum_i depths_i rows, never on a finished one. tol = 0 never
        stops early: every row gets max_depth iterations, as ``logits_at_depths(..., [max_depth], ...)``. Padded
        layout only (``unpad`` is ignored: the outputs at real tokens are the same). For inference; it neither
        needs nor disables autograd.
        """
        if int(max_depth) < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if not tol >= 0:
            raise ValueError(f"tol must be >= 0, got {tol}")
        B = tokens.shape[0]
        e, rope, key_mask = self._prelude(tokens, attention_mask)
        s = init_state.to(e.dtype)
        final = torch.zeros_like(s)  # [B, L, d] each row's state at its stopping depth
        depths = torch.zeros(B, dtype=torch.long, device=tokens.device)
        last_r = torch.zeros(B, dtype=torch.float32, device=tokens.device)
        rows = torch.arange(B, device=tokens.device)  # [n] original index of each active row
        act_e, act_mask, row_iterations = e, key_mask, 0
        for k in range(1, int(max_depth) + 1):
            new = self.core(s, act_e, rope, act_mask)  # [n, L, d]: only the still-active rows
            row_iterations += len(rows)
            r = relative_displacement(new, s, act_mask, eps)  # [n]
            done = r < tol if k < max_depth else torch.ones_like(r, dtype=torch.bool)
            fin = rows[done]
            final[fin], depths[fin], last_r[fin] = new[done], k, r[done]
            keep = ~done
            if not bool(keep.any()):
                break
            rows, s, act_e, act_mask = rows[keep], new[keep], act_e[keep], act_mask[keep]
        hidden = self.readout(final, rope, key_mask)
        return AdaptiveOutput(logits=self.embed(hidden, as_head=True), hidden=hidden, depths=depths,
                              displacement=last_r, row_iterations=row_iterations)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor, depths, init_state: torch.Tensor, *,
                k_max: int | None = None, backward_window: int | None = None,
                anchor_depth: int | None = None, host_mask: torch.Tensor | None = None,
                token_quantum: int | None = None, head: bool = True) -> "EcoRNAOutput":
        """Right-aligned depth wavefront (paper A.2).

        tokens, attention_mask: [B, L] (mask True at real tokens); depths: int or [B] long, K_i >= 1;
        init_state: [B, L, d]. ``k_max`` >= max K_i is the number of core calls (the engine passes the maximum over
        all ranks so that every rank calls the core equally often); ``backward_window`` W keeps autograd only for
        the last W wavefront steps; ``anchor_depth`` K_a also returns a no-grad readout of s^(K_a) for rows with
        K_i > K_a. ``host_mask``: attention_mask's copy on the host (the loader's), from which the packed layout
        computes its token indices; without it the packed layout copies attention_mask back (one device read).
        Given depths and host_mask on the host, forward reads nothing back from the device. ``token_quantum``: on the
        packed layout, every block call runs on a multiple of this many tokens (the objective's token_buckets), so
        that a run meets a bounded set of shapes; outputs unchanged. ``head=False``: the output holds the coda features
        (``features``, and ``anchor_features`` for the anchor rows) instead of the tied head's logits (task heads).

        Row i is active at step t iff t > k_max - K_i, so every row ends at step k_max after exactly K_i core
        applications. Rows are sorted by depth (descending) so the active rows are always a prefix: the core runs on
        exactly sum_i K_i row-iterations, never on a padded row. With ``unpad`` (see EcoRNAConfig) the blocks run on
        the packed real tokens of the sorted rows, where the active rows' tokens are a prefix too; outputs are
        scattered back to [B, L, ...] (zero at padding).
        """
        B, L = tokens.shape
        dev = tokens.device
        # The schedule is host arithmetic on the depths: given as host ints (the training objective's plan) nothing
        # here reads the device, and the indices it makes are copied without waiting; given as a tensor, one read.
        if isinstance(depths, int):
            ks = [depths] * B
        elif torch.is_tensor(depths):
            ks = depths.expand(B).tolist()
        else:
            ks = [int(k) for k in depths]
        k_max = max(ks, default=1) if k_max is None else int(k_max)
        if B and (min(ks) < 1 or max(ks) > k_max):
            raise ValueError(f"depths must lie in [1, k_max={k_max}], got {ks}")
        window = k_max if backward_window is None else min(int(backward_window), k_max)
        order_host = sorted(range(B), key=lambda i: -ks[i])  # by depth, descending; stable (ties keep row order)
        schedule = ([ks[i] for i in order_host], k_max, window, anchor_depth)
        order = host_to(order_host, dev)
        # original row indices of the rows with K_i > K_a, ascending (None without an anchor depth)
        anchor_rows = None if anchor_depth is None else host_to([i for i in range(B) if ks[i] > anchor_depth], dev)
        if self.unpadded(tokens):
            host_mask = attention_mask.cpu() if host_mask is None else host_mask
            return self._forward_packed(tokens, host_mask.bool()[order_host], anchor_rows, init_state, order,
                                        schedule, token_quantum, head)
        e, rope, key_mask = self._prelude(tokens, attention_mask)
        mask_s = key_mask[order]
        extent = list(range(B + 1))  # a unit is a row
        s, prev, anchor, row_iterations = self._wavefront(init_state.to(e.dtype)[order], e[order], schedule, extent,
                                                          lambda n: (rope, mask_s[:n]))
        inverse = torch.argsort(order)
        read = (lambda h: self.embed(h, as_head=True)) if head else (lambda h: h)  # noqa: E731
        logits = read(self.readout(s, rope, mask_s))[inverse]
        anchor_logits = None
        if anchor is not None:
            sorted_rows = inverse[anchor_rows]  # all below n_a: the anchor rows are a prefix of the sorted rows
            with torch.no_grad():  # readout called on every rank, even with no eligible row (ZeRO-3 symmetry)
                anchor_logits = read(self.readout(anchor[sorted_rows], rope, mask_s[sorted_rows]))
        return _output(head, logits, anchor_logits, state=s[inverse], prev_state=prev[inverse],
                       anchor_rows=anchor_rows, row_iterations=row_iterations, core_calls=k_max)

    def unpadded(self, tokens: torch.Tensor) -> bool:
        """Whether forward runs on packed real tokens for inputs on ``tokens``' device (EcoRNAConfig.unpad)."""
        mode, backend = self.cfg.unpad, self.cfg.attn_backend
        if mode != "auto":
            return mode
        if backend == "flash":
            return True
        probe = self.embed.weight  # the compute dtype: varlen kernels take fp16/bf16 only
        return backend == "auto" and tokens.is_cuda and (flash_available() or torch_varlen_available(probe))

    def _forward_packed(self, tokens, mask_s, anchor_rows, init_state, order, schedule,
                        quantum: int | None = None, head: bool = True) -> "EcoRNAOutput":
        """forward on the packed layout: the real tokens of the depth-sorted rows end to end, [T, d]. ``mask_s``:
        [B, L] bool on the host, the sorted rows' attention mask (the token indices are host arithmetic, copied to
        the device and never read back).

        With a ``quantum`` q every block call runs on a multiple of q tokens: the microbatch is padded to T_b =
        bucket(T) tokens (padding tokens: zero state, position 0, in sequences of their own), and a core call on the
        first n rows runs on the first min(bucket(extent[n]), T_b) tokens. The tokens past the active rows' are the
        next rows' (at their s_0) and padding, attended within their own (truncated) sequences, and their outputs
        are dropped: the active rows compute what they compute unbucketed."""
        B, L = tokens.shape
        dev = tokens.device
        lengths = mask_s.sum(1).tolist()
        extent = [0, *itertools.accumulate(lengths)]  # tokens of the first n sorted rows
        T = extent[B]
        T_b = token_bucket(T, quantum) if quantum else T
        # padding tokens in sequences no longer than the longest real one (the kernels' max_len stays the rows')
        chunk = max(lengths, default=1) or 1
        padded = (*lengths, *([chunk] * ((T_b - T) // chunk)), *([(T_b - T) % chunk] if (T_b - T) % chunk else []))
        flat = mask_s.reshape(-1).nonzero().squeeze(-1)  # [T] real positions of the sorted rows, row-major
        row, pos = host_to(flat // L, dev), host_to(flat % L, dev)  # pinned copies: the host never waits
        where = order[row] * L + pos  # [T] each token's index in the caller's [B * L]
        pad = lambda t: F.pad(t, (0, 0) * (t.dim() - 1) + (0, T_b - T)) if T_b > T else t  # noqa: E731  [T_b, ...]
        x = pad(self.embed(tokens.reshape(-1)[where]))  # [T_b, d]
        kernel = varlen_kernel(self.cfg.attn_backend, x)  # once, outside any compiled block
        cos, sin = self.rope(L, x.device, x.dtype)
        pos_b = pad(pos)  # padding tokens at position 0
        rope = (cos[pos_b], sin[pos_b])  # [T_b, hd]: each token at its own position
        contexts = {}

        def context(n: int):  # rope and sequences of the core's input for the first n sorted rows
            u = span(n)
            if u not in contexts:
                contexts[u] = ((rope[0][:u], rope[1][:u]), Varlen(_cut(padded, u), dev, kernel))
            return contexts[u]

        def span(n: int) -> int:  # tokens a call on the first n rows runs on
            return min(token_bucket(extent[n], quantum), T_b) if quantum else extent[n]

        e = self.prelude_norm(self.prelude(x, *context(B)))
        d = e.shape[-1]
        s0 = pad(init_state.to(e.dtype).reshape(B * L, d)[where])  # [T_b, d], zero at padding tokens
        s, prev, anchor, row_iterations = self._wavefront(s0, e, schedule, extent, context, span)

        def unpack(t: torch.Tensor, index=where, rows=B):  # [T', ...] -> [rows, L, ...], zero at padding
            t = t[:index.shape[0]]
            return t.new_zeros(rows * L, *t.shape[1:]).index_copy(0, index, t).view(rows, L, *t.shape[1:])

        read = (lambda h: self.embed(h, as_head=True)) if head else (lambda h: h)  # noqa: E731
        logits = unpack(read(self.readout(s, *context(B))))  # s: [T_b, d]
        anchor_logits = None
        if anchor is not None:
            n_a = len(anchor_rows)  # the anchor rows are the first n_a sorted rows
            T_a = extent[n_a]
            slot = torch.empty(B, dtype=torch.long, device=dev)  # sorted row -> its output row
            slot[torch.argsort(order)[anchor_rows]] = torch.arange(n_a, device=dev)
            with torch.no_grad():  # readout called on every rank, even with no eligible row (ZeRO-3 symmetry)
                a_logits = read(self.readout(anchor, *context(n_a)))  # [span(n_a), V or d]
            anchor_logits = unpack(a_logits, slot[row[:T_a]] * L + pos[:T_a], n_a)
        return _output(head, logits, anchor_logits, state=unpack(s), prev_state=unpack(prev),
                       anchor_rows=anchor_rows, row_iterations=row_iterations, core_calls=schedule[1])

    def _wavefront(self, s0, e, schedule, extent, context, span=None):
        """The right-aligned schedule over depth-sorted rows, in either layout -> (s, prev, anchor, row_iterations).

        s0, e: [U, ...] units of the sorted rows (rows [B, L, d], or tokens [T, d]); ``extent[n]`` is the number of
        units of the first n rows and ``context(n)`` their (rope, key mask or Varlen). The active rows at step t are
        the first n(t) and n never shrinks (a started row runs to step k_max), so the state is one tensor of the first
        extent[n] units that grows, by the starting rows' s_0, only at steps where n grows: no gather or
        concatenation of the whole batch at every step. ``span(n)`` >= extent[n] (default extent[n]) is how many
        units a call on the first n rows runs on (token buckets): the units past extent[n] enter at s_0 when the
        span grows and are never read, until their row starts and enters at s_0 again. ``s``: the last call's
        output, [span(B), ...] (its first extent[B] units are the rows' terminal states); ``prev``: s^(K_i - 1) of
        every row, [U, ...]; ``anchor`` [span(n_a), ...]: the state after K_a iterations of the rows with K_i > K_a
        (the first n_a rows), detached, zero past them; None without an anchor depth.
        """
        ks, k_max, window, anchor_depth = schedule  # ks: K_i of the sorted rows, descending (host list)
        span = span or (lambda n: extent[n])
        grad = torch.is_grad_enabled()
        state, valid, prev, row_iterations = s0[:0], 0, s0, 0  # state[:valid]: the active rows' states
        anchor = None
        if anchor_depth is not None:
            anchor = s0.new_zeros((span(sum(k > anchor_depth for k in ks)), *s0.shape[1:]))
        for t in range(1, k_max + 1):
            n = sum(k > k_max - t for k in ks)  # active rows: a prefix of the sorted batch
            u = span(n)
            if extent[n] > valid or u > state.shape[0]:
                state = torch.cat([state[:valid], s0[valid:u]])  # rows starting now (and the span's rest) at s_0
            valid = extent[n]
            if t == k_max - window + 1 and window < k_max:
                state = state.detach()  # truncated backprop: the suffix of W steps starts from a detached state
            with torch.set_grad_enabled(grad and t > k_max - window):
                state = self.core(state, e[:u], *context(n))  # called even with n = 0 (ZeRO-3 symmetry)
            row_iterations += n
            if t == k_max - 1:
                prev = torch.cat([state[:valid], s0[valid:]])  # s^(K_i - 1); rows with K_i = 1 have none (s_0)
            k_hit = None if anchor is None else k_max + anchor_depth - t
            if k_hit is not None and k_hit > anchor_depth:
                # rows whose K_a-th iteration is step t have K_i = k_hit: a run lo..hi-1 of the sorted rows
                lo, hi = sum(k > k_hit for k in ks), sum(k >= k_hit for k in ks)
                anchor[extent[lo]:extent[hi]] = state[extent[lo]:extent[hi]].detach()
        return state, prev, anchor, row_iterations


def _output(head: bool, terminal: torch.Tensor, anchor: torch.Tensor | None, **rest) -> EcoRNAOutput:
    """The forward's output: the terminal and anchor readouts as logits (the tied head applied) or, with
    head=False, as coda features."""
    if head:
        return EcoRNAOutput(logits=terminal, anchor_logits=anchor, **rest)
    return EcoRNAOutput(logits=None, anchor_logits=None, features=terminal, anchor_features=anchor, **rest)


def token_bucket(n: int, quantum: int) -> int:
    """The bucket of ``n`` tokens: the next multiple of ``quantum`` above it, and up to one quantum the next point
    of a half-octave grid (2^k and 3 x 2^(k-2), from quantum / 16 up), so that the wavefront's few-row calls do not
    pay a whole quantum. A bucket is its own bucket, and larger counts never get smaller ones. The objective sets
    quantum = the microbatch's token budget / objective.token_buckets: a run meets a few dozen sizes whatever its
    rows' lengths and depths (47 over 100 steps at 40 buckets), for about 4 % more core tokens and 2 % more FLOPs
    (docs/performance.md, "Token buckets")."""
    if n <= 0:
        return 0
    if n > quantum:
        return -(-int(n) // quantum) * quantum
    n = max(int(n), quantum // 16, 1)
    p = 1 << (n - 1).bit_length()  # the power of two at or above n
    return min(p if n > 3 * p // 4 or p < 4 else 3 * p // 4, quantum)


def _cut(lengths, total: int) -> tuple:
    """The sequences of ``lengths`` (laid end to end) that lie in the first ``total`` tokens, the last one cut."""
    out, at = [], 0
    for n in lengths:
        if at >= total:
            break
        out.append(min(n, total - at))
        at += out[-1]
    return tuple(out)
