"""Eco-RNA training objective (paper 000, Eq. 6-12 and A.2-A.3, A.7).

Per microbatch this returns ``S + m * A``: S the summed token cross-entropy of the terminal readout, m the number of
supervised tokens and A = lambda_fp L_fp + lambda_a L_anchor the microbatch's auxiliary means. The engine divides by
Z_acc, the supervised-token count of the whole optimizer step over every rank and microbatch, which gives Eq. A.7.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.errors import ConfigError
from pipeline.data.tokenizer import NucleotideTokenizer
from pipeline.models.eco_rna import host_to, initial_state, relative_displacement, state_table  # noqa: F401
from pipeline.objectives.masking import IGNORE_INDEX, make_mlm_transform


@dataclass
class EcoRNAObjectiveConfig:
    """The paper's Tables A2-A3 values were lost in extraction; defaults are our documented choices."""

    depth_law: str = "poisson_lognormal"  # poisson_lognormal (Eq. 12) | fixed
    train_depth: int = 4  # K for depth_law: fixed
    mu_k: float = 4.0  # expected Poisson intensity before K_min
    sigma_k: float = 0.5  # dispersion of log intensity
    k_min: int = 1
    k_cap: int | None = 32  # truncation of the law's tail (bounds one step's compute); null = none
    backward_window: int = 4  # W_bwd: autograd through the last min(K_i, W) iterations
    lambda_fp: float = 0.1  # relative displacement weight
    eps_fp: float = 1e-6
    lambda_anchor: float = 0.1
    anchor_depth: int = 1  # K_a
    anchor_margin: float = 0.0  # m_a
    # Run k_cap wavefront steps in every microbatch instead of the microbatch's K_max (the leading steps find no
    # active row: the right-aligned wavefront makes them empty calls, so the update is bit-identical). The core's
    # call count then never changes, DeepSpeed ZeRO-3's module trace stays valid and keeps the core gathered across
    # iterations instead of re-gathering it at each one: 2.5x less traffic in docs/scaling.md. Only for ZeRO-3.
    fixed_wavefront: bool = False
    # Draw each microbatch's initial state on the training device in the compute dtype (from a device generator
    # seeded by the microbatch's origin: replayable, the same on any world size, but not the CPU's numbers); false:
    # on the CPU in fp32 and copied (identical on every device type). The CPU draws on the CPU either way.
    state_on_device: bool = True
    # The packed layout's block calls run on bucketed token counts, in steps of (microbatch token budget /
    # token_buckets) for large calls and finer ones for small (pipeline/models/eco_rna.py token_bucket), so that a
    # run meets a few dozen shapes (compiled graphs, CUDA graphs, kernel plans); 0: every call on exactly its tokens.
    # About 5 % more core tokens, 3 % more FLOPs at 32 (docs/performance.md); the padded layout's (rows, length)
    # shapes are not bucketed.
    token_buckets: int = 0
    RESUME_FREE = ("token_buckets",)  # how the wavefront runs, not what it computes

    def __post_init__(self):
        def check(ok, name, msg):
            if not ok:
                raise ConfigError(f"objective.{name}: {msg}")

        check(self.depth_law in ("poisson_lognormal", "fixed"), "depth_law",
              f"must be poisson_lognormal or fixed, got {self.depth_law!r}")
        check(self.train_depth >= 1, "train_depth", f"must be >= 1, got {self.train_depth}")
        check(self.mu_k > 0, "mu_k", f"must be > 0, got {self.mu_k}")
        check(self.sigma_k >= 0, "sigma_k", f"must be >= 0, got {self.sigma_k}")
        check(self.k_min >= 1, "k_min", f"must be >= 1, got {self.k_min}")
        check(self.k_cap is None or self.k_cap >= self.k_min, "k_cap", "must be >= k_min")
        check(self.backward_window >= 1, "backward_window", f"must be >= 1, got {self.backward_window}")
        # The relative displacement ||s_K - s_{K-1}|| / ||s_{K-1}|| differentiates both terminal states (Sec. 2.4);
        # a window of 1 would detach s_{K-1} and train only half of it.
        check(self.lambda_fp == 0 or self.backward_window >= 2, "backward_window",
              f"must be >= 2 when lambda_fp > 0 (the displacement differentiates s_K and s_K-1), "
              f"got {self.backward_window}")
        check(self.lambda_fp >= 0 and self.lambda_anchor >= 0, "lambda_fp", "weights must be >= 0")
        check(self.eps_fp > 0, "eps_fp", f"must be > 0, got {self.eps_fp}")
        check(self.anchor_depth >= 1, "anchor_depth", f"must be >= 1, got {self.anchor_depth}")
        check(self.anchor_margin >= 0, "anchor_margin", f"must be >= 0, got {self.anchor_margin}")
        check(isinstance(self.token_buckets, int) and 0 <= self.token_buckets <= 1024, "token_buckets",
              f"must be an integer from 0 (off) to 1024, got {self.token_buckets!r}")
        check(not self.fixed_wavefront or self.depth_law == "fixed" or self.k_cap is not None, "fixed_wavefront",
              "needs objective.k_cap (the number of wavefront steps it runs)")


@dataclass
class FixedDepthObjectiveConfig(EcoRNAObjectiveConfig):
    """The fixed-depth control's objective (A.6): the same masking and MLM loss, one pass, no auxiliary terms.
    The anchor needs a recurrent trajectory, so a run that asks for it fails at configuration, not at step 1."""

    depth_law: str = "fixed"
    lambda_fp: float = 0.0
    lambda_anchor: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.lambda_anchor != 0:
            raise ConfigError(f"objective.lambda_anchor: the fixed-depth control has no recurrent trajectory to "
                              f"anchor; must be 0, got {self.lambda_anchor}")


@dataclass
class LossOutput:
    sum_loss: torch.Tensor  # scalar to backpropagate after division by Z_acc: S + m * A
    num_tokens: int  # supervised tokens m
    stats: dict = field(default_factory=dict)  # name -> (numerator, denominator); both summed over micro and ranks
    totals: dict = field(default_factory=dict)  # name -> number summed over micro and ranks (e.g. executed FLOPs)


def step_generator(seed: int, step: int, stream: int, index: int) -> torch.Generator:
    """A generator owned by (seed, step, microbatch) with the microbatch named by its origin, (loader stream, its
    index in that stream): nothing random depends on global state, history, or which rank reads the stream."""
    state = np.random.SeedSequence([seed, step, index, stream]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def sample_depths(n: int, cfg: EcoRNAObjectiveConfig, gen: torch.Generator) -> torch.Tensor:
    """Eq. 12: tau ~ N(log mu - sigma^2/2, sigma^2), K~ ~ Poisson(e^tau), K = max(K_min, K~) (then <= k_cap)."""
    if cfg.depth_law == "fixed":
        return torch.full((n,), cfg.train_depth, dtype=torch.long)
    tau = torch.randn(n, generator=gen, dtype=torch.float64) * cfg.sigma_k + (math.log(cfg.mu_k) - cfg.sigma_k ** 2 / 2)
    k = torch.poisson(tau.exp(), generator=gen).long().clamp(min=cfg.k_min)
    return k.clamp(max=cfg.k_cap) if cfg.k_cap is not None else k


@dataclass
class Plan:
    """What a microbatch needs before its forward, drawn first so K_max can be synchronized across ranks, and the
    host facts its loss needs, so that the loss reads nothing back from the device (no sync in the microbatch loop)."""

    depths: tuple  # K_i of each row (host ints: the schedule and the row selections are plain Python)
    generator: torch.Generator | None  # the microbatch's stream after the depth draws: its initial state
    sync_max: dict  # {"k_max": local max}; the engine replaces values by their maximum over all ranks
    host_mask: torch.Tensor | None = None  # [B, L] bool: the batch's attention mask on the host
    supervised: tuple | None = None  # supervised tokens of each row (host ints)
    init_state: torch.Tensor | None = None  # [B, L, d]: given, or once drawn from ``generator`` (draw_state)

    def draw_state(self, model_cfg, attention_mask: torch.Tensor, dtype: torch.dtype | None = None,
                   on_device: bool = False) -> torch.Tensor:
        """The microbatch's initial state [B, L, d] on attention_mask's device (initial_state), drawn on first use
        and kept: the generator's stream is consumed once."""
        if self.init_state is None:
            self.init_state = initial_state(model_cfg, attention_mask, self.generator, dtype=dtype,
                                            on_device=on_device)
        return self.init_state


def depth_pmf(objective) -> list[tuple[int, float]]:
    """[(K, P(K))] of the training depth law (pipeline.objectives.eco_rna.sample_depths) for K = k_min .. cap: K =
    clamp(Poisson(e^tau), k_min, k_cap), tau ~ N(log mu - sigma^2/2, sigma^2), by 64-point Gauss-Hermite quadrature
    over tau and the Poisson pmf summed exactly; [(train_depth, 1.0)] for the fixed law."""
    if objective.depth_law == "fixed":
        return [(int(objective.train_depth), 1.0)]
    nodes, weights = np.polynomial.hermite_e.hermegauss(64)  # probabilists' Hermite: weight exp(-x^2 / 2)
    weights = weights / weights.sum()
    lam = np.exp(math.log(objective.mu_k) - objective.sigma_k ** 2 / 2 + objective.sigma_k * nodes)
    cap = objective.k_cap if objective.k_cap is not None else int(lam.max() + 20 * math.sqrt(lam.max()) + 50)
    k = np.arange(cap)  # P(K~ = k) for k < cap; every K~ >= cap counts as cap
    log_fact = np.array([math.lgamma(j + 1) for j in k])
    probs = np.zeros(cap + 1)
    for lam_i, w in zip(lam, weights):
        pmf = np.exp(k * math.log(lam_i) - lam_i - log_fact)
        np.add.at(probs, np.maximum(k, objective.k_min), w * pmf)
        probs[cap] += w * (1 - float(pmf.sum()))
    return [(int(j), float(probs[j])) for j in range(objective.k_min, cap + 1)]


def trained_mean_depth(objective) -> float:
    """E[K] of the training depth law (depth_pmf)."""
    return sum(k * p for k, p in depth_pmf(objective))


def plan(batch, cfg, *, step: int, stream: int, index: int) -> Plan:
    """batch: on the host (the loader's)."""
    gen = step_generator(cfg.seed, step, stream, index)
    depths = tuple(sample_depths(batch.input_ids.shape[0], cfg.objective, gen).tolist())
    k_max = max(depths, default=1)
    if cfg.objective.fixed_wavefront:  # every microbatch the same number of core calls (the config's docstring)
        k_max = cfg.objective.train_depth if cfg.objective.depth_law == "fixed" else cfg.objective.k_cap
    return Plan(depths, gen, {"k_max": k_max}, batch.attention_mask.bool().cpu(),
                tuple((batch.labels != IGNORE_INDEX).sum(1).tolist()))


def make_transform(cfg):
    """Crop to the context, frame with <cls>/<eos>, corrupt. One sequence, all randomness from ``rng``."""
    tok = NucleotideTokenizer
    return make_mlm_transform(cfg.data.context_length, cfg.data.masking, cls_id=tok.cls_id, eos_id=tok.eos_id,
                              mask_id=tok.mask_id, num_special=tok.num_special,
                              random_pool=NucleotideTokenizer.residue_ids(cfg.data.molecule), sep_id=tok.sep_id)


def per_row_ce(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy per row [B] and supervised count per row [B] (fp32)."""
    ce = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return ce.sum(1), (labels != IGNORE_INDEX).sum(1)


def recurrent_loss(model, batch, cfg, p: Plan) -> LossOutput:
    """batch: pipeline.data.loader.Batch on the model's device; model: the DeepSpeed engine or a bare EcoRNA.

    Reads nothing back from the device: which rows are eligible for the displacement and the anchor, and every count,
    follow from the plan's host depths and supervised counts; the statistics stay on the device (the step reads them
    once, pipeline/train/step.py)."""
    obj = cfg.objective
    dev = batch.input_ids.device
    ks = [int(k) for k in p.depths]  # K_i, host
    host_mask = p.host_mask if p.host_mask is not None else batch.attention_mask.cpu()
    sup = list(p.supervised) if p.supervised is not None else (batch.labels != IGNORE_INDEX).sum(1).tolist()
    use_anchor = obj.lambda_anchor > 0
    s0 = p.init_state if p.init_state is not None else p.draw_state(
        cfg.model, batch.attention_mask, _compute_dtype(model), obj.state_on_device)
    out = model(batch.input_ids, batch.attention_mask, ks, s0.to(dev), k_max=p.sync_max["k_max"],
                backward_window=obj.backward_window, anchor_depth=obj.anchor_depth if use_anchor else None,
                host_mask=host_mask, token_quantum=token_quantum(cfg))
    ce_sum, m_row = per_row_ce(out.logits, batch.labels)  # [B], [B]
    S, m = ce_sum.sum(), sum(sup)
    zero = S.new_zeros(())
    stats = {"mlm_loss": (S.detach(), m)}

    fp_rows = [i for i, k in enumerate(ks) if k >= 2]  # I_fp
    r = relative_displacement(out.state, out.prev_state, batch.attention_mask, obj.eps_fp)
    r_fp = r.index_select(0, host_to(fp_rows, dev))
    L_fp = r_fp.mean() if fp_rows else zero
    stats["displacement"] = (r_fp.detach().sum(), len(fp_rows))

    L_anchor = zero
    readout_rows = [i for i, k in enumerate(ks) if k > obj.anchor_depth] if use_anchor else []  # out.anchor_rows
    keep = [j for j, i in enumerate(readout_rows) if sup[i] > 0]  # I_a = {K_i > K_a, |M_i| > 0}: readout positions
    if keep:
        a_rows = host_to([readout_rows[j] for j in keep], dev)
        ref_sum, ref_m = per_row_ce(out.anchor_logits, batch.labels[out.anchor_rows])
        kept = host_to(keep, dev)
        ell_k = ce_sum[a_rows] / m_row[a_rows]
        ell_a = (ref_sum[kept] / ref_m[kept]).detach()
        hinge = torch.relu(ell_k - ell_a - obj.anchor_margin)  # zero subgradient at equality
        L_anchor = hinge.mean()
        stats["anchor_hinge"] = (hinge.detach().sum(), len(keep))
        stats["anchor_active"] = ((hinge > 0).sum(), len(keep))
    aux = obj.lambda_fp * L_fp + obj.lambda_anchor * L_anchor
    totals = {"flops": cfg.model.train_flops(ks, batch.input_ids.shape[1], obj.backward_window, len(readout_rows)),
              "row_iterations": out.row_iterations, "core_calls": out.core_calls}
    # diagnostics: the depth histogram (row counts, host) and the mean displacement per depth (one scatter)
    count = collections.Counter(ks)
    r_by_depth = torch.zeros(max(ks, default=0) + 1, dtype=r.dtype, device=dev).index_add_(
        0, host_to(ks, dev), r.detach())
    for k in sorted(count):
        totals[f"depth_count/K{k:02d}"] = count[k]
        if k >= 2:
            stats[f"displacement/K{k:02d}"] = (r_by_depth[k], count[k])
    return LossOutput(S + m * aux, m, stats, totals)


def task_forward(model, batch, cfg, p: Plan):
    """A task model (pipeline/models/heads.py TaskModel, or its engine) with every row at the depth the plan drew,
    from the initial state drawn as :func:`recurrent_loss` draws it: the same wavefront, backward window and ranks'
    synchronized K_max. Returns the model's TaskOutput."""
    obj = cfg.objective
    s0 = p.init_state if p.init_state is not None else p.draw_state(
        cfg.model, batch.attention_mask, _compute_dtype(model), obj.state_on_device)
    return model(batch.input_ids, batch.attention_mask, [int(k) for k in p.depths], s0.to(batch.input_ids.device),
                 k_max=p.sync_max["k_max"], backward_window=obj.backward_window, host_mask=p.host_mask,
                 token_quantum=token_quantum(cfg))


def task_flops(cfg, p: Plan, batch, first: bool) -> int:
    """FLOPs of :func:`task_forward`'s backbone, as the pretraining counts them (EcoRNAConfig.train_flops: each row's
    own depth, the backward window), with the no-grad readout of the first iteration for the rows deeper than 1 when
    the head reads it (``first``)."""
    ks = [int(k) for k in p.depths]
    return cfg.model.train_flops(ks, batch.input_ids.shape[1], cfg.objective.backward_window,
                                 sum(k > 1 for k in ks) if first else 0)


def eval_state(cfg, attention_mask: torch.Tensor, seed: int) -> torch.Tensor:
    """The initial state [B, L, d] of every depth of a sweep: the seed-fixed, position-indexed evaluation table
    (zero at padding), as the reconstruction and RNAGym sweeps use it."""
    table = state_table(cfg.model, cfg.data.context_length, seed)
    return initial_state(cfg.model, attention_mask.cpu(), table=table).to(attention_mask.device)


def token_quantum(cfg) -> int | None:
    """The packed layout's call sizes are multiples of this (objective.token_buckets): the microbatch's token
    budget (train.max_tokens_per_microbatch, else micro_batch_size x context_length) / token_buckets; None: off."""
    n = cfg.objective.token_buckets
    if not n:
        return None
    t = cfg.train
    budget = t.max_tokens_per_microbatch if isinstance(t.max_tokens_per_microbatch, int) else (
        t.micro_batch_size * cfg.data.context_length)
    return max(1, -(-budget // n))


def _compute_dtype(model) -> torch.dtype:
    """The dtype the model computes in (bf16 under DeepSpeed's bf16, else its parameters' fp32)."""
    return next(model.parameters()).dtype


def supervised_sums(logits: torch.Tensor, labels: torch.Tensor) -> list:
    """[CE sum, correct, count] of logits [n, V] against labels [n] (fp32)."""
    logits = logits.float()
    return [float(F.cross_entropy(logits, labels, reduction="sum")), int((logits.argmax(-1) == labels).sum()),
            int(labels.numel())]


@torch.no_grad()
def reconstruction_sums(model, batch, depths, table: torch.Tensor) -> dict[int, list]:
    """{K: [CE sum, correct, supervised tokens]} of one batch read out at every K in ``depths`` from one trajectory
    (``EcoRNA.logits_at_depths``: max(depths) core calls); the initial state from the seed-fixed ``table`` [C, d]."""
    model_cfg = model.cfg
    s0 = initial_state(model_cfg, batch.attention_mask.cpu(), table=table).to(batch.input_ids.device)
    sup = batch.labels != IGNORE_INDEX
    labels = batch.labels[sup]
    return {k: supervised_sums(logits[sup], labels)
            for k, logits in model.logits_at_depths(batch.input_ids, batch.attention_mask, depths, s0).items()}


def validate(model, batch, cfg) -> tuple[dict, dict]:
    """Validation (pipeline/validation.py): held-out reconstruction loss and accuracy at each K of eval.depths, the
    same computation as ``launchers/evaluate.py --task reconstruction --seed eval.seed``. (stats, totals) of one
    batch: stats name -> (numerator, denominator), summed over batches and ranks before dividing."""
    table = state_table(cfg.model, cfg.data.context_length, cfg.eval.seed)
    stats = {}
    for k, (ce, correct, n) in reconstruction_sums(model, batch, cfg.eval.depths, table).items():
        stats[f"loss_K{k}"], stats[f"accuracy_K{k}"] = (ce, n), (correct, n)
    return stats, {}
