"""Paper 002: ProtLingo, ESM2 continued pretraining with latent N-gram memory and an upcycled MoE, masked LM on
UniRef (the ESM-2 alphabet)."""
from __future__ import annotations

import math

from pipeline.data.protein_tokenizer import PAD_ID as ESM_PAD_ID
from pipeline.families.base import (Activations, Depth, Family, MaskedLMInference, Proxies, Scaling, esm_tokenizer,
                                    layer_count, norm_extra, objective_validation, register_family)
from pipeline.models.protlingo import (EsmBlock, ProtLingo, ProtLingoConfig, config_from_hf, hf_to_protlingo,
                                      state_from_esm2)
from pipeline.objectives import protlingo as objective

ESM_FORMAT = "esm"  # export.json "format" of a dense ProtLingo written as transformers' EsmForMaskedLM


def read_export(fmt: str, state: dict) -> dict:
    """An ESM-format export's tensors under the pipeline's names (hf_to_protlingo drops the contact head and the
    rotary buffer)."""
    if fmt != ESM_FORMAT:
        raise ValueError(f"export format {fmt!r} is not one ProtLingo writes (pipeline or {ESM_FORMAT})")
    n_layers = len({k.split(".")[3] for k in state if k.startswith("esm.encoder.layer.")})
    return hf_to_protlingo(state, n_layers)


def foreign_run_config(hf_config: dict) -> dict:
    """An ESM2 checkpoint (Hugging Face config.json, or fair-esm's hyperparameters read as one) as a dense ProtLingo:
    its backbone, no MoE and no memory, the context ESM2 was trained with (1,024 tokens, <cls>/<eos> included)."""
    import dataclasses

    try:
        model = config_from_hf(hf_config)
    except KeyError as e:
        raise ValueError(f"config.json has no {e} (not an ESM2 config)") from None
    free = set(type(model).RESUME_FREE)
    return {"family": "protlingo", "model": {k: v for k, v in dataclasses.asdict(model).items() if k not in free},
            "data": {"context_length": min(1024, int(hf_config.get("max_position_embeddings", 1026)) - 2)}}


def residue_ids():
    import torch

    from pipeline.data.protein_tokenizer import RESIDUES, VOCAB

    return torch.tensor([VOCAB.index(t) for t in RESIDUES])


def _forward(model, cfg, prepared, tokens, mask, depth):
    captured = {}  # the head reads final_norm's output
    handle = model.final_norm.register_forward_hook(lambda m, a, o: captured.setdefault("h", o))
    try:
        logits = model(tokens, mask).logits
    finally:
        handle.remove()
    return logits, captured["h"], None, 0


def _activations(cfg, a: int, k_max: float | None) -> Activations:
    """Bytes per token ProtLingo's forward keeps (tests/pipeline/test_memory_model.py holds them to the saved
    tensors). An ESM block: its input, the normalized input, rotated q and k, v, SDPA's output, the residual sum,
    the normalized FFN input and the FFN's two d_ff (fc1's output, GELU's); fp32: two LayerNorms' mean and rstd,
    SDPA's log-sum-exp, its mask. An MoE block runs the shared expert on every token and one routed expert (hidden
    d_ff together, as the dense FFN), plus the real tokens' gathered copy, the routed input and output, their
    weighted sum and the experts' gathers (5 d), the router's fp32 input (bf16 runs) and its E-wide logits. A memory layer:
    9 d (norms, W_q's input, k, v, the gate's product, the padded and convolved and gated updates), the R x d_m
    looked-up rows, the latent z, the R int64 row indices, and the fp32 copies the gate multiplies. Outside: token
    ids, the final LayerNorm, the head's dense, GELU and LayerNorm, the fp32 log-softmax."""
    m = cfg.model
    d, H, E, fused = m.d_model, m.n_heads, m.num_experts, cfg.train.fused_norm
    dense = (8 * d + 2 * m.d_ff) * a + (2 * 2 + H + 1) * 4
    moe = dense + 5 * d * a + (4 - a) * d + 3 * E * 4
    n_moe = len(m.moe_layers)
    block = (dense * (m.n_layers - n_moe) + moe * n_moe) / m.n_layers
    memory = ((9 * d + m.routes * m.memory_dim + m.memory_latent) * a + (4 - a) * 2 * d + 8 * m.routes + 7 * 4
              + norm_extra(fused, a) * 3 * d)
    other = 8 + 5 * d * a + 4 * 4 + 4 * m.vocab_size + 16 + len(m.memory_layers) * memory
    return Activations(block=block, blocks=m.n_layers, block_input=d * a, other=other)


def narrow_twin(cfg) -> list[str]:
    """Proxies.narrow: head_dim 8 (d rounded up to a multiple of memory_bits: the routes split it), FFN 128 with a
    shared expert of 64, memory latent 32; blocks, heads, experts, the MoE and memory layers and the memory's bits,
    window and table kept."""
    m = cfg.model
    d = math.lcm(8 * m.n_heads, m.memory_bits)
    return [f"model.d_model={d}", "model.d_ff=128", "model.moe_shared_hidden=64", "model.memory_latent=32"]


def shapes_model(cfg) -> list[str]:
    """Proxies.shapes: the narrow twin with one block, MoE and memory on it when the config has them."""
    m = cfg.model
    return narrow_twin(cfg) + ["model.n_layers=1", f"model.moe_layers={[0] if m.moe_layers else []}",
                               f"model.memory_layers={[0] if m.memory_layers else []}"]


PROTLINGO = register_family(Family(
    name="protlingo", config_cls=ProtLingoConfig, build_model=ProtLingo,
    objective_cls=objective.ProtLingoObjectiveConfig, make_transform=objective.make_transform,
    plan=objective.plan, loss=objective.loss, tokenizer="esm", make_tokenizer=esm_tokenizer, pad_id=ESM_PAD_ID,
    derive_metrics=objective.derive_metrics, blocks=(EsmBlock,),
    # "rows_addressed": the rows this rank's training forwards ever read (a buffer)
    validate=objective_validation(objective.loss, objective.plan, "mlm_loss", training_state=("/rows_addressed",)),
    import_weights=state_from_esm2,  # ESM2 (HF or fair-esm), upcycled exactly
    from_foreign=foreign_run_config,  # ESM2 evaluated as it is (a dense ProtLingo)
    read_export=read_export, depth=Depth(trained=layer_count),
    # ESM2 layers (GELU MLP; an MoE layer runs the shared and one routed expert, together d_ff); the head is tied
    # to the embedding (a second use of its weight)
    scaling=Scaling(activations=_activations, module_calls=lambda cfg, k_max: {"embed": (2, 2)},
                    # one unpadded sequence: W_q has no backward, so not 3 x forward_flops
                    train_flops=lambda cfg, pmf: (cfg.model.train_flops(1, cfg.data.context_length,
                                                                        cfg.data.context_length), 0.0)),
    proxies=Proxies(narrow=narrow_twin, shapes=shapes_model),
    inference=MaskedLMInference(residue_ids=residue_ids, forward=_forward, variants="proteingym"),
    hf="pipeline.families.protlingo_hf:EXPORT"))
