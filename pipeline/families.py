"""Model families: name -> config class, model builder, sample transform, train-step objective.

The engine only talks to a Family; it never branches on the family name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.errors import ConfigError
from pipeline.data.tokenizer import SPM_PAD_ID
from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig
from pipeline.models.layers import SandwichBlock
from pipeline.data.protein_tokenizer import PAD_ID as ESM_PAD_ID
from pipeline.models.fixed_depth import FixedDepthConfig, FixedDepthMLM
from pipeline.models.protlingo import EsmBlock, ProtLingo, ProtLingoConfig, state_from_esm2
from pipeline.models.recursive_gpt import (DecoderBlock, RecursiveGPT, RecursiveGPTConfig, StandardGPT,
                                           StandardGPTConfig)
from pipeline.objectives import causal_lm
from pipeline.objectives import eco_rna as eco_rna_objective
from pipeline.objectives import protlingo as protlingo_objective


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    build_model: Callable  # model config -> nn.Module
    objective_cls: type
    make_transform: Callable  # RunConfig -> (uint8 tokens, np rng) -> {"input_ids", "labels"}
    plan: Callable  # (Batch, RunConfig, *, step, micro, rank) -> plan with .sync_max {name: int}
    loss: Callable  # (model, Batch, RunConfig, plan) -> LossOutput
    pad_id: int = 0
    packable: bool = False  # data.pack allowed: the objective masks attention and loss per packed document
    derive_metrics: Callable | None = None  # reduced step record -> extra metrics (e.g. routing entropy)
    # The model's transformer block classes: what train.activation_checkpointing: blocks recomputes in backward
    blocks: tuple = ()
    # Validation (pipeline/validation.py): (model, Batch, RunConfig) -> (stats, totals) of one held-out batch, stats
    # name -> (numerator, denominator) and totals name -> number, both summed over batches and ranks; a stat named
    # "loss" also gives val/perplexity, and derive_metrics applies to the totals. None: no validation (eval.every
    # is refused).
    validate: Callable | None = None
    # train.init_from a foreign checkpoint (pipeline.checkpoint.is_foreign_checkpoint: a Hugging Face directory or a
    # fair-esm .pt, read as (config.json dict, Hugging Face state dict)): (config, state, model config, a fresh
    # model's state dict) -> this family's state dict, ValueError naming what does not fit. None: refused.
    import_weights: Callable | None = None


def objective_validation(loss: Callable, plan: Callable, loss_stat: str, training_state: tuple = ()) -> Callable:
    """A family's validation by its training objective, without gradient: its stats and totals on the held-out
    batch (stat ``loss_stat`` reported as "loss"; stats ending in one of ``training_state`` describe the training
    so far, not the batch, and are left out). The plan is drawn for step 0: these objectives draw nothing."""
    def validate(model, batch, cfg) -> tuple[dict, dict]:
        out = loss(model, batch, cfg, plan(batch, cfg, step=0, stream=0, index=0))
        stats = {("loss" if k == loss_stat else k): v for k, v in out.stats.items()
                 if not k.endswith(training_state)}
        return stats, out.totals

    return validate


FAMILIES = {
    "eco_rna": Family("eco_rna", EcoRNAConfig, EcoRNA, eco_rna_objective.EcoRNAObjectiveConfig,
                      eco_rna_objective.make_transform, eco_rna_objective.plan, eco_rna_objective.recurrent_loss,
                      blocks=(SandwichBlock,), validate=eco_rna_objective.validate),
    # The matched fixed-depth control (A.6): same data, masking and loss code; depth fixed, auxiliary terms off.
    "eco_rna_control": Family("eco_rna_control", FixedDepthConfig, FixedDepthMLM,
                              eco_rna_objective.FixedDepthObjectiveConfig, eco_rna_objective.make_transform,
                              eco_rna_objective.plan, eco_rna_objective.recurrent_loss, blocks=(SandwichBlock,),
                              validate=eco_rna_objective.validate),
    # Paper 003: recursive causal decoder and its 12-layer standard baseline, causal LM on sentencepiece text.
    "recursive_gpt": Family("recursive_gpt", RecursiveGPTConfig, RecursiveGPT, causal_lm.CausalLMObjectiveConfig,
                            causal_lm.make_transform, causal_lm.plan, causal_lm.loss, pad_id=SPM_PAD_ID,
                            packable=True, blocks=(DecoderBlock,),
                            validate=objective_validation(causal_lm.loss, causal_lm.plan, "lm_loss")),
    # Paper 002: ESM2 continued pretraining with latent N-gram memory and an upcycled MoE, masked LM on UniRef.
    "protlingo": Family("protlingo", ProtLingoConfig, ProtLingo, protlingo_objective.ProtLingoObjectiveConfig,
                        protlingo_objective.make_transform, protlingo_objective.plan, protlingo_objective.loss,
                        pad_id=ESM_PAD_ID, derive_metrics=protlingo_objective.derive_metrics, blocks=(EsmBlock,),
                        # "rows_addressed": the rows this rank's training forwards ever read (a buffer)
                        validate=objective_validation(protlingo_objective.loss, protlingo_objective.plan,
                                                      "mlm_loss", training_state=("/rows_addressed",)),
                        import_weights=state_from_esm2),  # ESM2 (HF or fair-esm), upcycled exactly
    "standard_gpt": Family("standard_gpt", StandardGPTConfig, StandardGPT, causal_lm.CausalLMObjectiveConfig,
                           causal_lm.make_transform, causal_lm.plan, causal_lm.loss, pad_id=SPM_PAD_ID,
                           packable=True, blocks=(DecoderBlock,),
                           validate=objective_validation(causal_lm.loss, causal_lm.plan, "lm_loss")),
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"family: unknown model family {name!r} (known: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]
