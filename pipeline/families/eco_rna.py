"""Eco-RNA (paper 000) and its matched fixed-depth control (A.6): nucleotide masked LMs on the same data, masking and
loss code; the control's depth is fixed and its auxiliary terms are off."""
from __future__ import annotations

import math

from pipeline.families.base import (BlockShape, Depth, Family, MaskedLMInference, Proxies, Scaling,
                                    nucleotide_tokenizer, register_family)
from pipeline.models.eco_rna import Core, EcoRNA, EcoRNAConfig, initial_state
from pipeline.models.fixed_depth import FixedDepthConfig, FixedDepthMLM
from pipeline.models.layers import SandwichBlock
from pipeline.objectives import eco_rna as objective


# ---- depth ----------------------------------------------------------------------------------------------------------
def law_depth(cfg) -> tuple[int, str]:
    """Depth.trained: the depth law's truncation ``objective.k_cap`` (``objective.train_depth`` for ``depth_law:
    fixed``, the fixed-depth control's 1); without a k_cap, 8 x ``objective.mu_k``."""
    obj = cfg.objective
    if obj.depth_law == "fixed":
        return int(obj.train_depth), f"objective.train_depth {obj.train_depth}"
    if obj.k_cap is not None:
        return int(obj.k_cap), f"objective.k_cap {obj.k_cap}"
    return max(int(obj.k_min), math.ceil(8 * obj.mu_k)), f"8 x objective.mu_k {obj.mu_k} (no k_cap)"


def training_depth(cfg) -> int:
    """The training depth law's mean depth, rounded: the default depth of inference and of the HF export."""
    return max(1, round(objective.trained_mean_depth(cfg.objective)))


# ---- inference ------------------------------------------------------------------------------------------------------
def nucleotide_residue_ids():
    import torch

    from pipeline.data.tokenizer import NUM_SPECIAL, VOCAB

    return torch.arange(NUM_SPECIAL, len(VOCAB))


def _recurrent_forward(model, cfg, table, tokens, mask, depth):
    """Every row from the seed-fixed evaluation table; a fixed depth K is the adaptive pass that never stops early
    (tol 0)."""
    s0 = initial_state(cfg.model, mask, table=table)  # [b, L, d], zero at padding
    tol, k_max = depth
    out = model.adaptive(tokens, mask, s0, tol, k_max)
    return out.logits, out.hidden, out.depths.tolist(), out.row_iterations


def _control_forward(model, cfg, prepared, tokens, mask, depth):
    out = model(tokens, mask)
    return out.logits, out.state, None, 0


# ---- scaling --------------------------------------------------------------------------------------------------------
def _depth_law(cfg, rows: int) -> tuple[float, list]:
    """E[K_max] over ``rows`` iid draws of the training law (Eq. 12, its cap)."""
    pmf = objective.depth_pmf(cfg.objective)
    # E[max] = sum_{k >= 0} P(max > k) = sum_k (1 - F(k)^rows), F(k) = P(K <= k)
    e_max, cdf = 0.0, 0.0
    probs = dict(pmf)
    for k in range(pmf[-1][0]):
        cdf = min(1.0, cdf + probs.get(k, 0.0))
        e_max += 1.0 - cdf ** rows
    return e_max, pmf


def _module_calls(cfg, k_max: int) -> dict:
    """The tied embedding reads the tokens and is the head of the terminal readout (and of the no-grad anchor
    readout), the core runs K_max wavefront steps of which the last W are differentiated, the readout runs for the
    terminal state (and, without grad, for the anchor state)."""
    obj = cfg.objective
    anchor = int(obj.lambda_anchor > 0 and obj.anchor_depth is not None)
    window = min(k_max, obj.backward_window) if obj.backward_window else k_max
    return {"embed": (2 + anchor, 2), "core": (k_max, window), "readout": (1 + anchor, 1)}


def _blocks(cfg, k_max: float):
    m = cfg.model
    window = min(k_max, cfg.objective.backward_window or k_max)
    return BlockShape(m.d_kv, m.d_ff, True, True), m.n_prelude + m.n_coda + window * m.n_core


def _train_flops(cfg, pmf: list) -> tuple[float, float]:
    """Each sequence's FLOPs follow its drawn depth K."""
    m, L, obj = cfg.model, cfg.data.context_length, cfg.objective
    anchor = obj.lambda_anchor > 0 and obj.anchor_depth is not None
    per_k = [(p, m.train_flops([k], L, obj.backward_window, n_anchor_readouts=int(anchor and k > obj.anchor_depth)))
             for k, p in pmf]
    mean = sum(p * f for p, f in per_k)
    return mean, sum(p * (f - mean) ** 2 for p, f in per_k)


def _wavefront_depth(cfg):
    obj = cfg.objective
    if not obj.fixed_wavefront:
        return None
    return float(obj.train_depth if obj.depth_law == "fixed" else obj.k_cap)  # k_cap steps in every microbatch


def _control_blocks(cfg, k_max: float):
    m = cfg.model
    return BlockShape(m.d_kv, m.d_ff, True, True), m.n_blocks


# ---- the CPU proxies (bench/step_proxies.py) --------------------------------------------------------------------------
def narrow_twin(cfg) -> list[str]:
    """Proxies.narrow: head_dim 8 and SwiGLU width 128; blocks, heads, KV heads and vocabulary kept (2026-12-04:
    every OPS and SYNC figure of the 80M config the same at d 768 and at d 96, docs/performance.md)."""
    return [f"model.d_model={8 * cfg.model.n_heads}", "model.d_ff=128"]


def shapes_model(cfg) -> list[str]:
    """Proxies.shapes: d 64, one block per stack (prelude, core, coda)."""
    return ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128", "model.n_prelude=1",
            "model.n_core=1", "model.n_coda=1"]


# ---- the specs ------------------------------------------------------------------------------------------------------
_COMMON = dict(make_transform=objective.make_transform, plan=objective.plan, loss=objective.recurrent_loss,
               tokenizer="nucleotide", make_tokenizer=nucleotide_tokenizer, blocks=(SandwichBlock,),
               validate=objective.validate)

ECO_RNA = register_family(Family(
    name="eco_rna", config_cls=EcoRNAConfig, build_model=EcoRNA, objective_cls=objective.EcoRNAObjectiveConfig,
    depth=Depth(selectable=True, trained=law_depth, default=training_depth),
    scaling=Scaling(blocks=_blocks, depth_law=_depth_law, module_calls=_module_calls, train_flops=_train_flops,
                    drawn_depth=True, wavefront_depth=_wavefront_depth,
                    # the core's call count changes per microbatch unless the wavefront or the depth is fixed
                    per_step_depth=lambda cfg: not (cfg.objective.fixed_wavefront
                                                    or cfg.objective.depth_law == "fixed")),
    inference=MaskedLMInference(residue_ids=nucleotide_residue_ids, forward=_recurrent_forward, variants="rnagym",
                                prepare=lambda cfg, seed: objective.state_table(cfg.model, cfg.data.context_length,
                                                                                seed)),
    hf="pipeline.families.eco_rna_hf:EXPORT",
    # SHAPES.core: the core's input, whose rows the right-aligned wavefront changes at every step
    proxies=Proxies(narrow=narrow_twin, shapes=shapes_model, core=(Core,)), **_COMMON))

# The matched fixed-depth control (A.6): same data, masking and loss code; depth fixed, auxiliary terms off. No HF
# classes: its export holds the pipeline's files only.
ECO_RNA_CONTROL = register_family(Family(
    name="eco_rna_control", config_cls=FixedDepthConfig, build_model=FixedDepthMLM,
    objective_cls=objective.FixedDepthObjectiveConfig, depth=Depth(trained=law_depth),
    scaling=Scaling(blocks=_control_blocks, module_calls=lambda cfg, k_max: {"embed": (2, 2)},  # tied head
                    train_flops=lambda cfg, pmf: (cfg.model.train_flops([1], cfg.data.context_length, 1), 0.0)),
    inference=MaskedLMInference(residue_ids=nucleotide_residue_ids, forward=_control_forward, variants="rnagym"),
    proxies=Proxies(narrow=narrow_twin, shapes=shapes_model), **_COMMON))
