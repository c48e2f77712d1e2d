"""Execution paths that change where a model's parts run, never what they compute (torchtitan's ``parallelize``
beside ``model.py``): expert parallelism over DeepSpeed's expert groups (``expert_parallel``) and, on CUDA,
MegaBlocks' dMoE kernels (``megablocks``). The model files keep the math; ``UpcycledMoE.compute_experts`` is the one
method these paths replace.

This module imports neither DeepSpeed nor MegaBlocks (``megablocks.py`` imports MegaBlocks only when asked): the
engine calls ``check_parallelism`` before DeepSpeed starts, so a bad combination fails in a second with one line naming
the key.
"""
from __future__ import annotations

import torch

from pipeline.config import ConfigError

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


def resolve_moe_backend(model_cfg, dtype: torch.dtype | None = None) -> str:
    """``model.moe_backend`` -> 'torch' (the reference ``compute_experts``) or 'megablocks', as
    ``pipeline/parallel/megablocks.py`` decides it (auto: MegaBlocks on CUDA when it imports and training runs in
    bf16, ``dtype``); where it cannot run, ``megablocks`` is a ConfigError naming the key. Without MoE layers the
    backend is moot: 'torch'."""
    backend = getattr(model_cfg, "moe_backend", "torch")
    if backend == "torch" or not getattr(model_cfg, "moe_layers", None):
        return "torch"
    from pipeline.parallel import megablocks as mb  # importable on CPU: it imports megablocks only when asked

    try:
        return mb.resolve_moe_backend(backend, dtype)
    except (mb.MegaBlocksUnavailable, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def check_parallelism(cfg, world_size: int, zero_stage: int, dtype: torch.dtype | None = None) -> str:
    """Everything about EP and the MoE backend that can be wrong, before DeepSpeed starts; returns the backend.
    ``dtype``: the training precision (torch.bfloat16 or torch.float32), when known."""
    ep = cfg.train.expert_parallel_size
    check_expert_parallel(cfg.model, ep, world_size, zero_stage)
    backend = resolve_moe_backend(cfg.model, dtype)
    if backend == "megablocks" and ep > 1:
        # Both replace compute_experts: the grouped GEMM would have to run on the tokens the all-to-all delivers to
        # each rank's local experts. That combination is not built (apply_megablocks refuses an EP module).
        raise ConfigError(f"{EP_KEY}: {ep} with model.moe_backend megablocks is not supported; use "
                          "model.moe_backend: torch for expert parallelism, or expert_parallel_size 1")
    return backend


def parallelize(model: torch.nn.Module, cfg, zero_stage: int, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Apply the MoE backend and expert parallelism of ``cfg`` to ``model`` (weights loaded, optimizer not yet
    built). Needs ``deepspeed.comm`` initialized when ``train.expert_parallel_size`` > 1."""
    import torch.distributed as dist

    backend = check_parallelism(cfg, dist.get_world_size() if dist.is_initialized() else 1, zero_stage, dtype)
    if backend == "megablocks":
        from pipeline.parallel.megablocks import apply_megablocks

        apply_megablocks(model)  # in place: the same parameters and names, compute_experts on the grouped GEMM
    if cfg.train.expert_parallel_size > 1:
        from pipeline.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, cfg.train.expert_parallel_size, zero_stage)
    return model


def optimizer_groups(model: torch.nn.Module, param_groups: list[dict]) -> list[dict]:
    """``param_groups`` as DeepSpeed's MoE support needs them: unchanged without expert-parallel parameters, else
    with the experts split into ``moe`` groups (``expert_parallel.moe_param_groups``)."""
    if not any(getattr(p, "allreduce", True) is False for p in model.parameters()):
        return param_groups
    from pipeline.parallel.expert_parallel import moe_param_groups

    return moe_param_groups(param_groups)
