"""Eco-RNA (paper 000) and its matched fixed-depth control (A.6): nucleotide masked LMs on the same data, masking and
loss code; the control's depth is fixed and its auxiliary terms are off."""
from __future__ import annotations

import math

import torch

from pipeline.families.base import (Activations, Adaptation, Depth, Family, MaskedLMInference, Proxies, Scaling,
                                    norm_extra, nucleotide_tokenizer, register_family)
from pipeline.models.eco_rna import Core, EcoRNA, EcoRNAConfig, Readout, Stack, initial_state
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


def sandwich_block_bytes(m, a: int, fused_norm: bool = True) -> float:
    """Bytes per token one differentiated SandwichBlock keeps (padded or packed layout alike), at ``a`` bytes an
    activation element: its input, the attention's normalized input, raw and rotated q and k, v, SDPA's output
    (o_proj reads it as a view), the two residual sums, the normalized MLP input, and 4 d_ff (gate, up, silu(gate),
    their product); the mask SDPA makes from the key mask (one element a token); in fp32 the four norms' and the QK
    norms' rstd and SDPA's log-sum-exp (tests/pipeline/test_memory_model.py holds it to the saved tensors)."""
    d, H, Hkv = m.d_model, m.n_heads, m.n_kv_heads
    d_kv = Hkv * m.head_dim  # from the block's own fields: any config with sandwich blocks (a toy family's too)
    plain = norm_extra(fused_norm, a) * (4 * d + d + d_kv)  # the four norms of d, the QK norms of d and d_kv
    return (9 * d + 3 * d_kv + 4 * m.d_ff + 1) * a + (4 + 2 * H + Hkv) * 4 + plain


def _activations(cfg, a: int, k_max: float | None) -> Activations:
    """Prelude, coda and the last min(K_max, W) core iterations are differentiated (truncated backprop); a core
    iteration also keeps s (retention), B e (injection) and N_r's input; outside the blocks: the token ids, N_p's
    input and e, s into W_o, N_o's input and output, the fp32 log-softmax over the vocabulary and the displacement's
    two fp32 states. ``k_max`` None: the law's cap."""
    m, obj = cfg.model, cfg.objective
    d, fused = m.d_model, cfg.train.fused_norm
    k = k_max if k_max is not None else law_depth(cfg)[0]
    iters = min(k, obj.backward_window) if obj.backward_window else k
    iteration = 3 * d * a + 4 + norm_extra(fused, a) * d
    other = 8 + 5 * d * a + 2 * 4 + 4 * m.vocab_size + 2 * d * 4 + norm_extra(fused, a) * 2 * d
    return Activations(block=sandwich_block_bytes(m, a, fused), blocks=m.n_prelude + m.n_coda + iters * m.n_core,
                       block_input=d * a, other=other + iters * iteration)


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


def _control_activations(cfg, a: int, k_max: float | None) -> Activations:
    """The fixed-depth control: its n_blocks SandwichBlocks once; outside them the token ids, the final norm's input
    and output, the fp32 log-softmax and the displacement's fp32 difference (its state is its own previous one)."""
    m, fused = cfg.model, cfg.train.fused_norm
    other = 8 + 2 * m.d_model * a + 4 + 4 * m.vocab_size + 4 * m.d_model + norm_extra(fused, a) * m.d_model
    return Activations(block=sandwich_block_bytes(m, a, fused), blocks=m.n_blocks, block_input=m.d_model * a,
                       other=other)


def _execution(model, cfg, probe) -> dict:
    """Padded rows, or the packed tokens (model.unpad) with their varlen kernel and token buckets."""
    from pipeline.models.layers import attention_kernel, varlen_kernel

    backend = cfg.model.attn_backend
    if not model.unpadded(probe.new_zeros((1, 1), dtype=torch.long)):
        return {"layout": "padded", "attention": attention_kernel(backend, probe)}
    return {"layout": "packed", "token_buckets": cfg.objective.token_buckets,
            "attention": attention_kernel(backend, probe, varlen_kernel(backend, probe))}


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
    scaling=Scaling(activations=_activations, depth_law=_depth_law, module_calls=_module_calls, train_flops=_train_flops,
                    drawn_depth=True, wavefront_depth=_wavefront_depth,
                    # the core's call count changes per microbatch unless the wavefront or the depth is fixed
                    per_step_depth=lambda cfg: not (cfg.objective.fixed_wavefront
                                                    or cfg.objective.depth_law == "fixed")),
    inference=MaskedLMInference(residue_ids=nucleotide_residue_ids, forward=_recurrent_forward, variants="rnagym",
                                prepare=lambda cfg, seed: objective.state_table(cfg.model, cfg.data.context_length,
                                                                                seed)),
    hf="pipeline.families.eco_rna_hf:EXPORT", execution=_execution,
    # compiled: the core step (injection, 3 blocks, N_r; called K_max times a microbatch), the prelude, the readout
    compiled=(Core, Stack, Readout),
    # SHAPES.core: the core's input, whose rows the right-aligned wavefront changes at every step
    proxies=Proxies(narrow=narrow_twin, shapes=shapes_model, core=(Core,), meta=True),
    # task heads read the coda features N_o(C(W_o s^(K))), each row at its drawn depth in training (the objective's
    # depth law, or objective.depth_law: fixed) and from the evaluation table in sweeps (docs/adaptation.md)
    adapt=Adaptation(width=lambda m: m.d_model, forward=objective.task_forward, eval_state=objective.eval_state,
                     hf="pipeline.families.eco_rna_hf:TASK_EXPORT", flops=objective.task_flops),
    **_COMMON))

# The matched fixed-depth control (A.6): same data, masking and loss code; depth fixed, auxiliary terms off. No HF
# classes: its export holds the pipeline's files only.
ECO_RNA_CONTROL = register_family(Family(
    name="eco_rna_control", config_cls=FixedDepthConfig, build_model=FixedDepthMLM,
    objective_cls=objective.FixedDepthObjectiveConfig, depth=Depth(trained=law_depth),
    scaling=Scaling(activations=_control_activations, module_calls=lambda cfg, k_max: {"embed": (2, 2)},  # tied head
                    train_flops=lambda cfg, pmf: (cfg.model.train_flops([1], cfg.data.context_length, 1), 0.0)),
    inference=MaskedLMInference(residue_ids=nucleotide_residue_ids, forward=_control_forward, variants="rnagym"),
    proxies=Proxies(narrow=narrow_twin, shapes=shapes_model), **_COMMON))
