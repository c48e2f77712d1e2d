"""Expert-parallel groups: the key, DeepSpeed's group names and the check that a layout fits (no DeepSpeed import:
the engine checks before DeepSpeed starts)."""
from __future__ import annotations

from pipeline.errors import ConfigError

EP_KEY = "train.expert_parallel_size"


def group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"  # DeepSpeed's name for the expert and expert-data-parallel groups of this size


def check_expert_parallel(model_cfg, ep_size: int, world_size: int, zero_stage: int):
    """ConfigError naming the key unless EP groups of ``ep_size`` ranks fit ``world_size`` data-parallel ranks,
    the model's experts and ZeRO ``zero_stage``."""
    if ep_size == 1:
        return
    if not getattr(model_cfg, "moe_layers", None):
        raise ConfigError(f"{EP_KEY}: {ep_size} needs a model with MoE layers (model.moe_layers is empty or the "
                          "family has none); set it to 1")
    if zero_stage == 3:
        raise ConfigError(f"{EP_KEY}: {ep_size} needs ZeRO stage 1 or 2 (DeepSpeed refuses its MoE under ZeRO-3, "
                          "and zero_optimization.stage is 3); with ZeRO-3 set it to 1: the experts are then ordinary "
                          "data-parallel parameters")
    if zero_stage not in (1, 2):
        # DeepSpeed's stage-0 MoE path reduces gradients elsewhere and keeps no ZeRO fp32 shards to export from;
        # neither is tested here.
        raise ConfigError(f"{EP_KEY}: {ep_size} needs ZeRO stage 1 or 2 (ds_configs/zero1.json, zero2.json); "
                          f"zero_optimization.stage is {zero_stage}")
    if model_cfg.num_experts % ep_size:
        raise ConfigError(f"{EP_KEY}: {ep_size} does not divide model.num_experts = {model_cfg.num_experts}")
    if world_size % ep_size:
        raise ConfigError(f"{EP_KEY}: {ep_size} does not divide the data-parallel world size {world_size}")
