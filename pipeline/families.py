"""Model families: name -> config class, model builder, sample transform, train-step objective.

The engine only talks to a Family; it never branches on the family name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipeline.config import ConfigError
from pipeline.models.eco_rna import EcoRNA, EcoRNAConfig
from pipeline.objectives import eco_rna as eco_rna_objective


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    build_model: Callable  # model config -> nn.Module
    make_transform: Callable  # RunConfig -> (uint8 tokens, np rng) -> {"input_ids", "labels"}
    loss: Callable  # (model, Batch, RunConfig, *, step, micro, rank) -> LossOutput
    pad_id: int = 0


FAMILIES = {
    "eco_rna": Family("eco_rna", EcoRNAConfig, EcoRNA, eco_rna_objective.make_transform, eco_rna_objective.mlm_loss),
}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"family: unknown model family {name!r} (known: {', '.join(sorted(FAMILIES))})")
    return FAMILIES[name]
